"""Multi-process decoding (`jax.distributed` on localhost, CPU collectives over gloo): two
processes of two devices each run a tp=2 x dp=2 mesh and produce one process's tokens, with
`generate` and with the serving engine in lockstep (`serving.lockstep`: process 0 schedules,
submissions arriving while others run, a cancellation), its KV cache paged (a request
preempted alike on every process), the tokens of one process's slot engine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eaglejax.errors import InputError
from eaglejax.sharding.distributed import initialize

HERE = Path(__file__).resolve().parent
VOCAB = 96
PAGED_KV_TOKENS = 4 * 32  # one request's blocks: r5 and r6 outgrow it together


def _prompts() -> list[list[int]]:
    rs = np.random.RandomState(8)
    return [rs.randint(0, VOCAB, size=rs.randint(2, 30)).tolist() for _ in range(4)]


def _decode_all(target) -> dict[str, list[list[int]]]:
    """Greedy plain and tree decoding, and sampled tree decoding with per-row seeds."""
    import eaglejax
    from eaglejax import SpecConfig
    from spec_helpers import self_draft

    tree = SpecConfig.tree(3, 3, 8)
    common = dict(target=target, max_new_tokens=12, ignore_eos=True)
    runs = {
        "plain": eaglejax.generate(_prompts(), **common),
        "tree": eaglejax.generate(_prompts(), draft=self_draft(target), speculative=tree,
                                  **common),
        "sampled": eaglejax.generate(_prompts(), draft=self_draft(target), speculative=tree,
                                     temperature=0.9, seed=[5, 6, 7, 8], **common),
    }
    return {name: [g.token_ids for g in out] for name, out in runs.items()}


def _requests():
    from eaglejax.serving.engine import Request, SamplingOptions

    lengths, limits = [3, 17, 9, 12, 5, 30, 28], [10, 6, 12, 1, 9, 34, 36]
    sampling = [SamplingOptions(), SamplingOptions(0.9, seed=4), SamplingOptions(),
                SamplingOptions(1.2, 8, 0.9, 5), SamplingOptions(),
                SamplingOptions(0.7, seed=9), SamplingOptions(0.8, seed=6)]
    return [Request(f"r{i}", [(7 * i + 3 * j) % VOCAB for j in range(n)], limit, s)
            for i, (n, limit, s) in enumerate(zip(lengths, limits, sampling))]


def _serve(engine) -> dict[str, list]:
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


def _engine(target, kv_tokens=None):
    from eaglejax import SpecConfig
    from eaglejax.serving.engine import Engine
    from spec_helpers import self_draft

    return Engine(target, self_draft(target), speculative=SpecConfig.tree(3, 3, 8),
                  num_slots=2, capacity=64, rounds_per_call=2, kv_tokens=kv_tokens)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_missing_process_settings_are_named(monkeypatch):
    for variable in ("EAGLEJAX_COORDINATOR", "EAGLEJAX_NUM_PROCESSES", "EAGLEJAX_PROCESS_ID"):
        monkeypatch.delenv(variable, raising=False)
    assert initialize() is False  # nothing given: one process
    with pytest.raises(InputError, match="missing process_id"):
        initialize("127.0.0.1:1234", 2)
    monkeypatch.setenv("EAGLEJAX_PROCESS_ID", "x")
    with pytest.raises(InputError, match="must be integers"):
        initialize("127.0.0.1:1234", 2)
    with pytest.raises(InputError, match=r"process_id must be in \[0, num_processes=2\)"):
        initialize("127.0.0.1:1234", 2, 2)


@pytest.mark.slow
def test_two_processes_decode_like_one(tmp_path):
    from conftest import make_hf_model
    from spec_helpers import make_selfdraftable

    import eaglejax

    model = make_hf_model("llama", tmp_path / "model", seed=3, num_hidden_layers=2,
                          vocab_size=VOCAB)
    make_selfdraftable(model)
    model.save_pretrained(tmp_path / "model")
    one_device = eaglejax.load_target(tmp_path / "model")
    expected = _decode_all(one_device)
    served = _serve(_engine(one_device))
    assert sorted(served) == [f"r{i}" for i in range(7)]

    port = _free_port()
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags,
               JAX_PLATFORMS="cpu")
    procs = []
    for rank in range(2):
        # process 0 is told by arguments, process 1 by the environment variables
        extra = {} if rank == 0 else dict(EAGLEJAX_COORDINATOR=f"127.0.0.1:{port}",
                                          EAGLEJAX_NUM_PROCESSES="2",
                                          EAGLEJAX_PROCESS_ID="1")
        argv = [str(tmp_path), str(rank)] + ([f"127.0.0.1:{port}"] if rank == 0 else [])
        procs.append(subprocess.Popen([sys.executable, str(HERE / "test_multihost.py"), *argv],
                                      cwd=HERE, env={**env, **extra}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {rank}:\n{out[-3000:]}"
        got = json.loads((tmp_path / f"tokens-{rank}.json").read_text())
        assert got == expected, rank
    # served in lockstep by a paged engine: every process's host block tables preempt the
    # same request, which resumes with the tokens it had, and tp-split pools serve the
    # tokens of one process's slot engine
    assert json.loads((tmp_path / "paged.json").read_text()) == served
    preemptions = [json.loads((tmp_path / f"preemptions-{rank}.json").read_text())
                   for rank in range(2)]
    assert preemptions[0] == preemptions[1] > 0


if __name__ == "__main__":  # one process of test_two_processes_decode_like_one
    sys.path.insert(0, str(HERE))
    directory, rank = Path(sys.argv[1]), int(sys.argv[2])
    if rank == 0:
        initialize(sys.argv[3], 2, 0)
    else:
        initialize()
    import jax

    import eaglejax

    assert jax.process_count() == 2 and jax.device_count() == 4
    target = eaglejax.load_target(directory / "model", mesh=eaglejax.make_mesh(tp=2, dp=2))
    # each process holds only its own devices' slices of a tp-split weight
    wqkv = target.params["layers"][0]["wqkv"]
    assert [s.data.shape[0] for s in wqkv.addressable_shards] == [1, 1]
    (directory / f"tokens-{rank}.json").write_text(json.dumps(_decode_all(target)))
    from eaglejax.serving.lockstep import LockstepEngine, follow

    engine = _engine(target, PAGED_KV_TOKENS)
    if rank == 0:
        lockstep = LockstepEngine(engine)
        (directory / "paged.json").write_text(json.dumps(_serve(lockstep)))
        lockstep.close()
    else:
        follow(engine)
    (directory / f"preemptions-{rank}.json").write_text(json.dumps(engine.preemptions))
