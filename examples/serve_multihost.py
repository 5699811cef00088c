"""Start `eaglejax serve` as N local processes of one jax.distributed run (one mesh over all
their devices): process 0 answers HTTP and schedules, the others follow its steps.

    python examples/serve_multihost.py --num-processes 2 [--cpu-devices 2] -- \
        --tp 2 --dp 2 --port 8000 [other `eaglejax serve` flags]

On several hosts, run `eaglejax serve --coordinator HOST0:PORT --num-processes N
--process-id I ...` on each instead (the same flags everywhere). `--cpu-devices D` makes
each process a CPU process of D simulated devices (for trying it on one machine).
Ctrl-C stops every process.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--cpu-devices", type=int, default=None, metavar="D")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="after --: the `eaglejax serve` flags")
    args = parser.parse_args()
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    if args.num_processes < 1:
        parser.error("--num-processes must be >= 1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, EAGLEJAX_COORDINATOR=f"127.0.0.1:{port}",
               EAGLEJAX_NUM_PROCESSES=str(args.num_processes))
    if args.cpu_devices:
        env.update(JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={args.cpu_devices}")
    procs = [subprocess.Popen([sys.executable, "-m", "eaglejax.cli", "serve", *serve_args],
                              env={**env, "EAGLEJAX_PROCESS_ID": str(rank)})
             for rank in range(args.num_processes)]

    def stop(*_):
        for proc in procs:
            proc.send_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    codes = [proc.wait() for proc in procs]
    sys.exit(max(codes, key=abs))


if __name__ == "__main__":
    main()
