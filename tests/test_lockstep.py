"""Multi-process serving (`serving.lockstep`): two processes of two devices each run one
engine over a tp=2 x dp=2 mesh, process 0 scheduling (submissions arriving while others run,
a cancellation), and every request gets the tokens a one-device engine gives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
VOCAB = 96


def _requests():
    from eaglejax.serving.engine import Request, SamplingOptions

    lengths, limits = [3, 17, 9, 12, 5], [10, 6, 12, 1, 9]
    sampling = [SamplingOptions(), SamplingOptions(0.9, seed=4), SamplingOptions(),
                SamplingOptions(1.2, 8, 0.9, 5), SamplingOptions()]
    return [Request(f"r{i}", [(7 * i + 3 * j) % VOCAB for j in range(n)], limit, s)
            for i, (n, limit, s) in enumerate(zip(lengths, limits, sampling))]


def _serve(engine) -> dict[str, list[int]]:
    """Two requests first, the rest once they run; one more cancelled while queued."""
    from eaglejax.serving.engine import Request

    requests = _requests()
    for r in requests[:2]:
        engine.submit(r)
    tokens: dict[str, list[int]] = {}
    done = {}
    while not engine.idle:
        if len(tokens) == 2 and len(requests) > 2:
            for r in requests[2:]:
                engine.submit(r)
            engine.submit(Request("cancelled", [1, 2, 3], 5))
            engine.cancel("cancelled")
            requests = requests[:2]
        for u in engine.step():
            tokens.setdefault(u.key, []).extend(u.token_ids)
            if u.finish_reason:
                done[u.key] = [tokens[u.key], u.finish_reason]
    return done


def _engine(target):
    from eaglejax import SpecConfig
    from eaglejax.serving.engine import Engine
    from spec_helpers import self_draft

    return Engine(target, self_draft(target), speculative=SpecConfig.tree(3, 3, 8),
                  num_slots=2, capacity=64, rounds_per_call=2)


@pytest.mark.slow
def test_two_processes_serve_like_one(tmp_path):
    from conftest import make_hf_model
    from spec_helpers import make_selfdraftable
    from test_multihost import _free_port

    import eaglejax

    model = make_hf_model("llama", tmp_path / "model", seed=3, num_hidden_layers=2,
                          vocab_size=VOCAB)
    make_selfdraftable(model)
    model.save_pretrained(tmp_path / "model")
    expected = _serve(_engine(eaglejax.load_target(tmp_path / "model")))
    assert sorted(expected) == [f"r{i}" for i in range(5)]

    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", EAGLEJAX_COORDINATOR=f"127.0.0.1:{port}",
               EAGLEJAX_NUM_PROCESSES="2")
    procs = [subprocess.Popen([sys.executable, str(HERE / "test_lockstep.py"), str(tmp_path)],
                              cwd=HERE, env={**env, "EAGLEJAX_PROCESS_ID": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {rank}:\n{out[-3000:]}"
    assert json.loads((tmp_path / "served.json").read_text()) == expected


if __name__ == "__main__":  # one process of test_two_processes_serve_like_one
    sys.path.insert(0, str(HERE))
    from eaglejax.sharding.distributed import initialize

    initialize()
    import jax

    import eaglejax
    from eaglejax.serving.lockstep import LockstepEngine, follow

    assert jax.process_count() == 2 and jax.device_count() == 4
    directory = Path(sys.argv[1])
    target = eaglejax.load_target(directory / "model", mesh=eaglejax.make_mesh(tp=2, dp=2))
    engine = _engine(target)
    if jax.process_index() == 0:
        lockstep = LockstepEngine(engine)
        served = _serve(lockstep)
        lockstep.close()
        (directory / "served.json").write_text(json.dumps(served))
    else:
        follow(engine)
