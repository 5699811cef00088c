"""`auto` in the serving engine (`serving.shape_policy`, `Engine(speculative="auto")`): each
step's mode chosen from the live requests' acceptance and the batch's size; greedy tokens
are plain decoding's whatever the switches; `/metrics` shows the shape mix."""

import itertools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from eaglejax.decoding.autotune import (
    MARGIN,
    PRIOR_ROUNDS,
    PROBE_ROUNDS,
    AutoPlan,
    Knowledge,
)
from eaglejax.serving.shape_policy import STEP_ROUNDS, ShapePolicy

PLAN = AutoPlan.for_device("cpu")
PLAIN, SMALL, LARGE, PROBE = range(4)
NAMES = [PLAN.name(m) for m in range(4)]


@pytest.fixture
def policy(monkeypatch):
    monkeypatch.setenv("EAGLEJAX_AUTOTUNE_CACHE", "0")  # nothing read from or kept on disk
    model = SimpleNamespace(source="test")
    return ShapePolicy(model, model, PLAN, "cpu")


@pytest.fixture
def gpu_policy(monkeypatch):
    monkeypatch.setenv("EAGLEJAX_AUTOTUNE_CACHE", "0")
    model = SimpleNamespace(source="test")
    return ShapePolicy(model, model, PLAN, "gpu")


def _knows(policy: ShapePolicy, key: str, accepted: dict[int, float]) -> None:
    """Request `key` live, having accepted `accepted[mode]` draft tokens per round."""
    policy.admit(key)
    policy.requests[key] = Knowledge({NAMES[m]: a for m, a in accepted.items()},
                                     {NAMES[m]: 1.0 for m in accepted})


def _costs(policy: ShapePolicy, rows: int, seconds: dict[int, float]) -> None:
    policy.policy(rows).knowledge.round_s = {NAMES[m]: [s] for m, s in seconds.items()}


def test_load_decides_between_speculation_and_plain(gpu_policy):
    policy = gpu_policy
    """The same request speculates in a batch of 1, where a round costs 1.6 plain steps, and
    decodes plainly in a batch of 4, where a round costs 3 (its acceptance, 2.2 tokens a
    round, pays for the first and not the second)."""
    _knows(policy, "a", {SMALL: 1.2, LARGE: 1.0, PROBE: 1.3})
    _costs(policy, 1, {PLAIN: 0.020, SMALL: 0.032, LARGE: 0.034, PROBE: 0.040})
    _costs(policy, 4, {PLAIN: 0.030, SMALL: 0.090, LARGE: 0.095, PROBE: 0.120})
    assert policy.choose(["a"], 1) == (SMALL, STEP_ROUNDS)
    assert policy.choose(["a"], 4) == (PLAIN, 16)  # measured, not the CPU's row limit


def test_a_cpu_step_past_the_native_kernels_rows_decodes_plainly(policy):
    _knows(policy, "a", {SMALL: 3.0, LARGE: 3.0, PROBE: 3.0})
    _costs(policy, 2, {PLAIN: 0.030, SMALL: 0.031, LARGE: 0.032, PROBE: 0.033})
    assert PLAN.probe.num_nodes == 16 and policy.modes(1) == range(4)
    assert policy.modes(2) == range(1) and policy.choose(["a"], 2) == (PLAIN, 16)
    model = SimpleNamespace(source="test")
    assert ShapePolicy(model, model, PLAN, "gpu").modes(32) == range(4)


def test_the_live_requests_acceptance_decides(policy):
    """A predictable request alone speculates, a chat request alone does not, and together
    the mean of their acceptance lengths is weighed against the cost."""
    _knows(policy, "code", {SMALL: 1.5, LARGE: 1.6, PROBE: 1.7})
    _knows(policy, "chat", {SMALL: 0.1, LARGE: 0.1, PROBE: 0.1})
    for rows in (1, 2):
        _costs(policy, rows, {PLAIN: 0.020, SMALL: 0.030, LARGE: 0.031, PROBE: 0.040})
    policy.max_speculative_rows = None  # as on an accelerator: 2 rows may speculate
    assert policy.choose(["code"], 1)[0] == LARGE  # 2.6 / 0.031 beats 2.5 / 0.030
    assert policy.choose(["chat"], 1)[0] == PLAIN
    mean = 1 + (1.5 + 0.1) / 2  # SMALL over both: 1.8 tokens in 1.5 steps
    assert mean / 0.030 >= MARGIN / 0.020
    assert policy.choose(["code", "chat"], 2)[0] == SMALL


def test_what_a_request_shows_is_its_own_and_then_the_prior(policy):
    """A probe step teaches each request what it accepted (every candidate's count too); a
    plain step only decays; a released request's acceptance becomes the next one's prior,
    weighing PRIOR_ROUNDS rounds; a request never seen first runs the probe."""
    policy.admit("x")
    assert policy.choose(["x"], 1) == (PROBE, PROBE_ROUNDS)  # nothing known: probe
    counts = np.zeros(len(PLAN.sizes) * (1 + 4))
    counts[PLAN.count_column(SMALL)], counts[PLAN.count_column(LARGE)] = 6.0, 9.0
    policy.observe(PROBE, 1, 0.2, 4, {"x": (12.0, 4, counts)})
    known = policy.requests["x"]
    assert known.accepted == {NAMES[PROBE]: 12.0, NAMES[SMALL]: 6.0, NAMES[LARGE]: 9.0}
    assert known.rounds == {NAMES[m]: 4.0 for m in (PROBE, SMALL, LARGE)}
    policy.observe(PLAIN, 1, 0.1, 16, {"x": (0.0, 0, None)})
    assert known.rounds[NAMES[PROBE]] == pytest.approx(4 * 0.5 ** (16 / 64))
    assert policy.forwards_by_mode == {NAMES[PROBE]: 4, NAMES[PLAIN]: 16}
    assert set(policy.round_seconds()) == {(NAMES[PROBE], 1), (NAMES[PLAIN], 1)}
    policy.release("x")
    policy.admit("y")
    prior = policy.requests["y"]
    assert prior.rounds[NAMES[PROBE]] == pytest.approx(min(4 * 0.5 ** (16 / 64), PRIOR_ROUNDS))
    assert prior.accepted[NAMES[PROBE]] / prior.rounds[NAMES[PROBE]] == pytest.approx(3.0)
    policy.observe(PROBE, 1, 0.5, 40, {"y": (40.0, 40, counts)})
    policy.release("y")
    policy.admit("z")
    prior = policy.requests["z"]
    assert prior.rounds[NAMES[PROBE]] == pytest.approx(PRIOR_ROUNDS)
    assert 1.0 < prior.accepted[NAMES[PROBE]] / prior.rounds[NAMES[PROBE]] < 3.0


# The engine itself runs in a fresh interpreter, as the adaptive loop does (test_auto): XLA:CPU
# (jax 0.10.2) once segfaulted compiling the probe's loop after the suite's earlier compiles.
def test_engine_in_a_fresh_process(tmp_path):
    here = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, str(here / "test_engine_auto.py"), str(tmp_path)],
                          cwd=here, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "engine ok" in proc.stdout


class Scripted(ShapePolicy):
    """Runs `script` [(mode, forwards)] round and round, learning as `auto` does."""

    def __init__(self, engine, script):
        super().__init__(engine.target, engine.draft, engine.policy.plan, "gpu")  # any rows
        self.script = itertools.cycle(script)

    def choose(self, keys, rows):
        return next(self.script)


def check_engine(target):
    """Greedy requests get plain decoding's tokens through every switch between modes
    (scripted) and under the default policy; sampled ones run to their limits; the rounds
    reported count every target forward; /metrics names the modes."""
    from spec_helpers import self_draft

    import eaglejax
    from eaglejax.serving.engine import Engine, Request, SamplingOptions
    from eaglejax.serving.metrics import ServingMetrics

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, n).tolist() for n in (5, 19, 11, 30, 8)]
    limits = [30, 12, 41, 25, 3]
    plain = [eaglejax.generate([p], target=target, max_new_tokens=n, ignore_eos=True)[0].token_ids
             for p, n in zip(prompts, limits)]
    from eaglejax.decoding import slots
    from eaglejax.decoding.loops import SpecLoop

    draft = self_draft(target)
    shared = Engine(target, draft, num_slots=2, capacity=96, rounds_per_call=8)
    fills = []
    for name in ("fill", "fill_target"):  # count the prefills of each kind
        fill = getattr(slots, name)
        setattr(slots, name, lambda *a, _fill=fill, _name=name, **k: (fills.append(
            "fill_spec" if _name == "fill" and isinstance(a[0], SpecLoop) else _name),
            _fill(*a, **k))[1])
    got = shared.run([Request(i, p, n, ignore_eos=True) for i, (p, n) in
                      enumerate(zip(prompts, limits))])  # rows that share a step: target alone
    assert [got[i].token_ids for i in range(len(plain))] == plain
    # each request's own rounds (a slot's last request's are not the next one's)
    assert all(1 <= got[i].rounds <= limits[i] - 1 for i in range(len(plain)) if limits[i] > 1)
    assert shared._stale.any() and set(shared.policy.forwards_by_mode) >= {"plain"}
    # requests that arrive together share steps, and a request that joins a row left behind
    # decodes plainly: no head is ever prefilled (the first of the five arrived with the rest)
    assert fills == ["fill_target"] * len(prompts), fills
    fills.clear()  # ... while one arriving alone may speculate: its head is prefilled
    lone = rng.integers(0, 97, 13).tolist()
    want = eaglejax.generate([lone], target=target, max_new_tokens=9, ignore_eos=True)[0]
    got = shared.run([Request("alone", lone, 9, ignore_eos=True)])
    assert got["alone"].token_ids == want.token_ids and fills == ["fill_spec"], fills
    for scripted in (True, False):
        engine = Engine(target, draft, num_slots=2, capacity=96, rounds_per_call=8)
        assert engine.speculation == "auto"
        modes = len(engine.policy.plan.modes)  # the target's plan: on a CPU, depth-1
        probe = modes - 1  # trees before the deeper ones
        if scripted:
            engine.policy = Scripted(engine, [(probe, 1), (PLAIN, 3), (1, 2), (PLAIN, 1),
                                              (2, 1), (probe, 2),
                                              *((mode, 1) for mode in range(3, probe)),
                                              (PLAIN, 16)])
        requests = [Request(i, p, n, ignore_eos=True) for i, (p, n) in
                    enumerate(zip(prompts, limits))]
        requests.append(Request("hot", prompts[0], 20, SamplingOptions(0.8, seed=2),
                                ignore_eos=True))
        if scripted:  # several rows at once, every mode at every row count
            got = engine.run(requests)
        else:  # one at a time: on a CPU only a single row speculates (one probe fills the
            got = {}  # native kernels' 16 rows)
            for request in requests:
                got.update(engine.run([request]))
        for i, want in enumerate(plain):
            assert got[i].token_ids == want, (scripted, i)
            assert 1 <= got[i].rounds <= limits[i] - 1 or limits[i] == 1
        assert len(got["hot"].token_ids) == 20
        mix = dict(engine.policy.forwards_by_mode)
        names = [engine.policy.plan.name(m) for m in range(modes)]
        if scripted:
            assert set(mix) == set(names)
        else:  # what the probes showed is kept: the self-draft's proposals are accepted
            prior = engine.policy.prior  # (how many a round depends on the modes that the
            name = names[probe]  # measured costs chose, so no length is asserted)
            assert prior.rounds.get(name, 0.0) > 0.0 and prior.accepted[name] > 0.0
        assert not engine.policy.requests  # every request released
        page = ServingMetrics(engine.policy).render()[0].decode()
        for name in mix:
            assert f'eaglejax_target_forwards_total{{mode="{name}"}} {float(mix[name])}' in page
        assert 'eaglejax_round_seconds{mode="plain",rows="' in page


if __name__ == "__main__":  # the fresh-process half of test_engine_in_a_fresh_process
    import os

    from conftest import make_hf_model, share_native_builds
    from spec_helpers import make_selfdraftable

    import eaglejax

    directory = Path(sys.argv[1])
    os.environ.update(EAGLEJAX_AUTOTUNE_CACHE="1",
                      EAGLEJAX_CACHE=str(share_native_builds(directory / "cache")))
    model = make_hf_model("llama", directory, seed=11, num_hidden_layers=2)
    make_selfdraftable(model)
    model.save_pretrained(directory)
    check_engine(eaglejax.load_target(directory))
    print("engine ok")
