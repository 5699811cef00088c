"""`speculative="auto"`: the policy that picks each segment's mode
(`eaglejax.decoding.autotune`), and the adaptive loop that runs it
(`eaglejax.decoding.adaptive`): greedy output identical to plain decoding whatever the
switches, sampling exact, what it learns kept for later calls."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eaglejax import SpecConfig
from eaglejax.decoding.autotune import (
    EVIDENCE_ROUNDS,
    EXPLORE,
    HALF_LIFE,
    MARGIN,
    MAX_PROBE_EVERY,
    MIN_PROBE_EVERY,
    PLAIN_TIMING_STEPS,
    PLAIN_WIDTH,
    PRIOR_ROUNDS,
    SEGMENT_S,
    SPEC_ROUNDS,
    AutoPlan,
    AutoPolicy,
    Knowledge,
)
from eaglejax.decoding.calibration import count_columns

PLAN = AutoPlan.for_device("cpu")
PLAIN, SMALL, LARGE, PROBE = range(4)


def test_the_cpu_plan():
    """Plain decoding, two trees with a 4-token lookup branch in place of their weakest
    nodes, and the probe: the largest tree (12) with the branch grafted, 16 nodes; every
    branch searches the replies decoded before too."""
    assert PLAN.modes[0] is None
    assert [PLAN.nodes(m) for m in range(4)] == [1, 6, 8, 16]
    assert all(spec.lookup_replaces for spec in PLAN.modes[1:3])
    assert all(spec.lookup_history for spec in PLAN.modes[1:])
    assert not any(s.lookup_history for s in AutoPlan.for_device("cpu", lookup_history=False)
                   .modes[1:])
    assert not PLAN.probe.lookup_replaces and PLAN.probe.total_tokens == 12
    assert PLAN.sizes == (6, 8, 12)
    # the probe's counters: block 4 (branch of 4 tokens), sizes 6 and 8
    assert [PLAN.count_column(m) for m in range(4)] == [None, 12, 13, None]


def test_the_plan_where_multiply_adds_bound_the_verify():
    """Without the tile unit the probe keeps to 12 nodes: the tree of 8 with the branch
    grafted; the candidates are 6 and 8 nodes with the branch in place of their weakest."""
    plan = AutoPlan.for_device("cpu", probe_nodes=12)
    assert [plan.nodes(m) for m in range(4)] == [1, 6, 8, 12]
    assert all(spec.lookup_replaces for spec in plan.modes[1:3])
    assert not plan.probe.lookup_replaces and plan.probe.total_tokens == 8
    assert plan.sizes == (6, 8)
    assert [plan.count_column(m) for m in range(4)] == [None, 8, 9, None]


def test_the_plan_without_a_draft_weighs_suffix_trees(target_of):
    """With no draft, the trees are suffix drafting's (SpecConfig.suffix's matches and
    depth) with no lookup branch (a suffix tree holds the copied continuation already):
    the probe of the largest size the verify allows, the two sizes below it as candidates."""
    plan = AutoPlan.for_device("cpu", probe_nodes=12, method="suffix")
    suffix = SpecConfig.suffix()
    assert plan.modes == (None, *(SpecConfig.suffix(suffix.top_k, suffix.depth, n, 0)
                                  for n in (6, 8, 12)))
    assert plan.sizes == (6, 8, 12)
    assert [plan.count_column(m) for m in range(4)] == [None, 0, 1, None]
    target = target_of("llama")
    assert AutoPlan.for_target(target, None).probe.method == "suffix"


@pytest.mark.parametrize("flags,storage,nodes", [
    (["avx512f", "amx_bf16", "amx_tile"], "bfloat16", 16),  # the tile unit multiplies
    (["avx512f", "amx_bf16", "amx_tile"], "float32", 12),  # FMA-bound
    (["avx512f", "avx512_bf16"], "bfloat16", 12),  # FMA-bound (AMD Zen 4)
])
def test_the_probe_follows_what_bounds_the_verify(monkeypatch, target_of, flags, storage,
                                                  nodes):
    from spec_helpers import random_eagle3

    from eaglejax.decoding import autotune

    monkeypatch.setattr(autotune.hardware, "isa_features", lambda: flags)
    assert autotune.cpu_probe_nodes(storage) == nodes
    target = target_of("llama").with_weight_dtype(storage)
    assert AutoPlan.for_target(target, random_eagle3(target)).probe.num_nodes == nodes


def _counts(al_small: float, al_large: float, rounds: int) -> np.ndarray:
    counts = np.zeros(len(PLAN.sizes) * 5)
    counts[PLAN.count_column(SMALL)] = (al_small - 1) * rounds
    counts[PLAN.count_column(LARGE)] = (al_large - 1) * rounds
    return counts


def _learnt(plain_s: float, probe_s: float, al_small=2.0, al_large=2.5, al_probe=3.0):
    """A fresh policy after one probe segment (4 rounds) and one plain segment (16 steps)."""
    policy = AutoPolicy(PLAN, Knowledge())
    assert policy.next_mode() == PROBE  # nothing known: the probe measures acceptance
    policy.observe(PROBE, 4 * probe_s, 4, (al_probe - 1) * 4, 4, _counts(al_small, al_large, 4))
    assert policy.next_mode() == PLAIN  # then what a plain step costs
    policy.observe(PLAIN, 16 * plain_s, 16, 0, 0)
    return policy


def test_costs_are_interpolated_in_node_count_and_the_best_rate_wins():
    policy = _learnt(plain_s=0.05, probe_s=0.075)
    assert policy.acceptance_length(SMALL) == pytest.approx(2.0)
    assert policy.acceptance_length(PROBE) == pytest.approx(3.0)
    # untimed trees: between plain (1 node, 50 ms) and the probe (16 nodes, 75 ms)
    assert policy.round_seconds(LARGE) == pytest.approx(0.05 + 7 / 15 * 0.025)
    rates = policy.expected_rates()
    assert rates[PLAIN] == pytest.approx(20.0)
    assert rates[LARGE] == pytest.approx(2.5 / (0.05 + 7 / 15 * 0.025))  # 40.5: the best
    assert rates[PROBE] == pytest.approx(40.0)
    assert policy.next_mode() == LARGE
    policy.observe(LARGE, 4 * 0.09, 4, 4 * 1.5, 4)  # slower than interpolated, AL as counted
    assert policy.round_seconds(LARGE) == pytest.approx(0.09)
    # 2.5 / 0.09 = 27.8 < 40, but the probe, counted over half the rounds, weighs its
    # acceptance over EVIDENCE_ROUNDS more: about 1.98 / 0.075 = 26.4
    assert policy.next_mode() == LARGE
    policy.observe(LARGE, 4 * 0.12, 4, 4 * 1.5, 4)  # slower still: 2.5 / 0.105 = 23.8
    assert policy.next_mode() == PROBE


def _depth_one_counts(plan: AutoPlan, accepted: float) -> np.ndarray:
    """A probe segment's summed counts (`calibration.round_counts`' columns) in which the
    depth-1 candidate accepted `accepted` draft tokens and every other column none."""
    counts = np.zeros(count_columns(plan.probe, plan.sizes, plan.long_copy))
    counts[plan.count_column(1)] = accepted
    return counts


def test_the_depth_one_tree_is_timed_right_after_plain_and_the_probe():
    """A head's CPU plan times its depth-1 tree as soon as plain decoding and the probe are
    timed, even where the cost interpolated between them and the probe's few rounds make
    plain decoding look faster (a first call then decoded plainly throughout); once timed,
    the rates decide as before. Plans without one (no head) time nothing early."""
    plan = AutoPlan.for_device("cpu", probe_nodes=12, depth_one=True)
    depth_one = 1
    assert plan.timed_early == (depth_one,) and plan.modes[depth_one].depth == 1
    assert AutoPlan.for_device("cpu", probe_nodes=12).timed_early == ()
    assert AutoPlan.for_device("cpu", probe_nodes=12, method="suffix").timed_early == ()
    policy = AutoPolicy(plan, Knowledge())
    counts = _depth_one_counts(plan, 0.2 * 2)  # AL 1.2 over the probe's 2 rounds
    assert policy.next_mode() == len(plan.modes) - 1
    policy.observe(len(plan.modes) - 1, 2 * 0.012, 2, 2 * 1.0, 2, counts)  # 12 ms a round
    assert policy.next_mode() == PLAIN
    policy.observe(PLAIN, 4 * 0.004, 4, 0, 0)  # 4 ms a step
    # interpolated, the 3-node tree would cost 4 + 2/11 * 8 = 5.5 ms: 1.2 / 5.5 < 1 / 4
    assert policy.expected_rates()[depth_one] < EXPLORE * policy.expected_rates()[PLAIN]
    assert policy.next_mode() == depth_one
    policy.observe(depth_one, 8 * 0.0045, 8, 8 * 0.5, 8)  # it costs 4.5 ms: AL 1.5 pays
    assert policy.next_mode() == depth_one


def test_trees_are_chosen_between_on_their_evidence():
    """A tree counted over two probe rounds does not displace one that ran for sixty on
    its higher count alone: acceptance is spread over EVIDENCE_ROUNDS more rounds when
    trees are compared; with as many rounds as the running tree it wins. Against plain
    decoding the chosen tree's own estimate is weighed."""
    plan = AutoPlan.for_device("cpu", probe_nodes=12, depth_one=True)
    depth_one, six = 1, 2
    names = [plan.name(m) for m in range(len(plan.modes))]
    policy = AutoPolicy(plan, Knowledge(round_s={names[PLAIN]: [0.004], names[depth_one]:
                                                 [0.0048], names[six]: [0.0074],
                                                 names[-1]: [0.012]}))

    def counted(six_rounds: float) -> None:
        policy.use_acceptance({names[depth_one]: 0.6 * 60, names[six]: 2.0 * six_rounds,
                               names[-1]: 1.0 * six_rounds},
                              {names[depth_one]: 60, names[six]: six_rounds,
                               names[-1]: six_rounds})

    counted(2)  # tree 6: AL 3.0 over two probe rounds, 405 tokens/s against 333
    assert policy.expected_rates()[six] > policy.expected_rates()[depth_one]
    assert EVIDENCE_ROUNDS >= 2 and policy.best == depth_one
    counted(60)  # as many rounds as the depth-1 tree: the higher rate wins
    assert policy.best == six
    # against plain decoding (1 / 4 ms) the chosen tree's own estimate counts: AL 1.1 in
    # 4.8 ms loses, AL 1.3 wins (spread over EVIDENCE_ROUNDS more rounds it would lose)
    policy.use_acceptance({names[depth_one]: 0.1 * 2}, {names[depth_one]: 2})
    assert policy.best == PLAIN
    policy.use_acceptance({names[depth_one]: 0.3 * 2}, {names[depth_one]: 2})
    assert policy.best == depth_one


def test_plain_wins_unless_speculation_beats_it_by_the_margin():
    policy = _learnt(plain_s=0.01, probe_s=0.075)  # a cheap step: every tree loses
    assert policy.next_mode() == PLAIN
    # the probe's rate exactly MARGIN / 1.01 of plain's: still plain
    policy = _learnt(plain_s=0.025, probe_s=0.075, al_small=1.0, al_large=1.0,
                     al_probe=3.0 * MARGIN / 1.01)
    assert policy.next_mode() == PLAIN
    policy = _learnt(plain_s=0.025, probe_s=0.075, al_small=1.0, al_large=1.0,
                     al_probe=3.0 * MARGIN * 1.01)
    assert policy.next_mode() == PROBE


def test_a_tree_close_to_plain_is_timed_once_before_plain_is_settled():
    """Plain is best on interpolated costs (50 tok/s), but the 6-node tree's estimate (1.4 /
    30 ms = 46.7) is within EXPLORE of it and the tree never ran: it runs once to be timed.
    Timed cheaper (25 ms: 56 tok/s, past the margin) it wins; timed dearer it is left, and
    the 8-node tree (44.1, below 0.9 x 50) is never tried."""
    for seconds, after in ((0.025, SMALL), (0.035, PLAIN)):
        policy = _learnt(plain_s=0.02, probe_s=0.05, al_small=1.4, al_large=1.5, al_probe=1.6)
        assert policy.best == PLAIN
        assert policy.expected_rates()[SMALL] >= EXPLORE * 50.0 > policy.expected_rates()[LARGE]
        assert policy.next_mode() == SMALL
        policy.observe(SMALL, 4 * seconds, 4, 4 * 0.4, 4)
        assert policy.next_mode() == after
        assert policy.next_mode() == after  # settled: no tree left to time


def test_a_tree_timed_dear_once_is_timed_again_after_a_probe():
    """Plain is the choice on the cost the 6-node tree measured once (35 ms: 40 tok/s against
    50), while its node count gives 30 ms (46.7, within EXPLORE): the next probe that leaves
    plain the choice makes it forget that cost, so it runs again; timed at 25 ms it wins."""
    policy = _learnt(plain_s=0.02, probe_s=0.05, al_small=1.4, al_large=1.5, al_probe=1.6)
    assert policy.next_mode() == SMALL
    policy.observe(SMALL, 4 * 0.035, 4, 4 * 0.4, 4)
    while policy.next_mode() == PLAIN:
        policy.observe(PLAIN, 16 * 0.02, 16, 0, 0)
    assert policy.next_mode() == PROBE
    policy.observe(PROBE, 0.05, 1, 0.6, 1, _counts(1.4, 1.5, 1))
    assert policy.best == PLAIN and not policy.timed(SMALL)
    assert policy.next_mode() == SMALL
    policy.observe(SMALL, 4 * 0.025, 4, 4 * 0.4, 4)
    assert policy.next_mode() == SMALL


def test_the_depth_one_tree_is_timed_again_after_every_probe_that_leaves_plain():
    """The depth-1 tree timed once at a busy moment (7 ms: AL 1.2 loses to a 4 ms step) is
    timed again after the next probe that leaves plain the choice, although the cost its
    node count gives (interpolated between the step and the 12 ms probe, 5.5 ms: about 220
    tok/s against 0.9 x 250) would not have it run again; timed at 4.5 ms it wins."""
    plan = AutoPlan.for_device("cpu", probe_nodes=12, depth_one=True)
    depth_one, probe = 1, len(plan.modes) - 1
    counts = _depth_one_counts(plan, 0.2 * 2)  # AL 1.2 over the probe's 2 rounds
    policy = AutoPolicy(plan, Knowledge())
    policy.observe(probe, 2 * 0.012, 2, 2 * 1.0, 2, counts)
    policy.observe(PLAIN, 4 * 0.004, 4, 0, 0)
    assert policy.next_mode() == depth_one
    policy.observe(depth_one, 8 * 0.007, 8, 8 * 0.2, 8)  # a busy moment
    assert policy.best == PLAIN
    while policy.next_mode() == PLAIN:
        policy.observe(PLAIN, 16 * 0.004, 16, 0, 0)
    assert policy.next_mode() == probe
    policy.observe(probe, 2 * 0.012, 2, 2 * 1.0, 2, counts)
    assert policy.best == PLAIN and not policy.timed(depth_one)
    assert policy.expected_rates()[depth_one] < EXPLORE * policy.expected_rates()[PLAIN]
    assert policy.next_mode() == depth_one
    policy.observe(depth_one, 8 * 0.0045, 8, 8 * 0.5, 8)
    assert policy.best == depth_one and policy.next_mode() == depth_one


def test_the_probe_interval_doubles_while_the_choice_holds_and_resets_when_it_changes():
    policy = _learnt(plain_s=0.01, probe_s=0.075)
    assert policy.knowledge.probe_every == MIN_PROBE_EVERY  # the first probe changed nothing
    intervals = []
    for _ in range(6):
        while policy.next_mode() == PLAIN:
            policy.observe(PLAIN, 16 * 0.01, 16, 0, 0)
        intervals.append(policy.since_probe)
        policy.observe(PROBE, 0.075, 1, 2, 1, _counts(2.0, 2.5, 1))  # plain still best
    assert intervals == [min(MIN_PROBE_EVERY * 2 ** i, MAX_PROBE_EVERY) for i in range(6)]
    assert policy.knowledge.probe_every == min(MIN_PROBE_EVERY * 2 ** 6, MAX_PROBE_EVERY)
    # text turns predictable: the probe accepts 8 tokens a round, the choice changes
    policy.observe(PROBE, 0.075, 1, 8, 1, _counts(6.0, 7.0, 1))
    assert policy.next_mode() != PLAIN and policy.knowledge.probe_every == MIN_PROBE_EVERY


def test_every_call_first_probes_its_own_text():
    """A call that inherits every cost and a settled choice (plain, probe interval grown)
    still opens with a probe of its own text, which leaves the interval as it was; text
    that accepts far more than the prior switches to a tree at once."""
    settled = _learnt(plain_s=0.01, probe_s=0.075)
    settled.knowledge.probe_every = 4 * MIN_PROBE_EVERY
    for al, after in ((2.0, PLAIN), (8.0, SMALL)):
        call = AutoPolicy(PLAN, Knowledge.from_json(settled.knowledge.to_json()))
        assert call.best == PLAIN and call.next_mode() == PROBE
        rounds = call.segment_rounds(PROBE)
        call.observe(PROBE, rounds * 0.075, rounds, (al - 1) * rounds, rounds,
                     _counts(al - 0.5, al - 0.2, rounds))
        assert call.knowledge.probe_every == 4 * MIN_PROBE_EVERY
        assert call.next_mode() == after
    call.observe(PROBE, 0.075, 1, 7, 1, _counts(7.5, 7.8, 1))  # a later probe counts again
    assert call.knowledge.probe_every == 8 * MIN_PROBE_EVERY


def test_a_call_that_inherits_a_tree_with_its_costs_starts_with_the_tree():
    """No opening probe where the inherited choice is a tree and plain's cost is known: the
    tree's segments measure the call's own acceptance, and a call whose text no tree suits
    goes to plain decoding."""
    settled = _learnt(plain_s=0.05, probe_s=0.075)
    assert settled.best == LARGE
    call = AutoPolicy(PLAN, Knowledge.from_json(settled.knowledge.to_json()))
    assert not call.opening
    assert call.next_mode() == LARGE and call.segment_rounds(LARGE) == call.spec_rounds
    call.observe(LARGE, 8 * 0.06, 8, 0, 8)  # 8 rounds accepting nothing
    assert call.next_mode() == PROBE  # best on what it inherited: it measures too
    call.observe(PROBE, 32 * 0.075, 32, 0, 32, _counts(1.0, 1.0, 32))
    assert call.best == PLAIN
    # with plain's cost unknown, or plain the inherited choice, the call opens with a probe
    unpriced = Knowledge.from_json(settled.knowledge.to_json())
    del unpriced.round_s[PLAN.name(PLAIN)]
    assert AutoPolicy(PLAN, unpriced).opening  # (plain is timed first, then the probe)
    plain_choice = _learnt(plain_s=0.01, probe_s=0.075)
    assert AutoPolicy(PLAN, Knowledge.from_json(
        plain_choice.knowledge.to_json())).next_mode() == PROBE


def test_a_call_starts_from_the_tree_earlier_calls_ran_not_a_probes_estimate():
    """Earlier calls ran SMALL for 200 rounds, then a probe's 2 rounds counted LARGE at a
    higher estimated rate (untimed: its cost interpolated). A new call weighs each mode's
    acceptance as PRIOR_ROUNDS rounds (both: a tie of weights), yet starts with SMALL: the
    estimate alone would choose LARGE, and once a tree runs the evidence rule keeps it."""
    earlier = _learnt(plain_s=0.05, probe_s=0.075, al_small=2.0, al_large=2.6)
    earlier.observe(SMALL, 200 * 0.055, 200, 200 * 1.0, 200)  # AL 2.0 at 55 ms a round
    earlier.observe(PROBE, 2 * 0.075, 2, 2 * 2.0, 2, _counts(2.0, 3.2, 2))
    rates = earlier.expected_rates()
    assert rates[LARGE] > rates[SMALL] and earlier.best == SMALL
    call = AutoPolicy(PLAN, Knowledge.from_json(earlier.knowledge.to_json()))
    assert call.knowledge.rounds[PLAN.name(SMALL)] == pytest.approx(PRIOR_ROUNDS)
    assert call.best == SMALL and call.next_mode() == SMALL and not call.opening
    call.observe(SMALL, 16 * 0.055, 16, 16 * 1.0, 16)
    assert call.next_mode() == SMALL  # its own rounds now weigh most


def test_plain_is_first_timed_briefly_and_never_costed_from_the_trees():
    """Once the probe is timed, plain decoding's cost is still unknown (a round's time says
    nothing of a step's), so plain is tried next; its first segment is short, the later ones
    full width."""
    policy = AutoPolicy(PLAN, Knowledge())
    policy.observe(PROBE, 2 * 0.03, 2, 2.0, 2, _counts(1.5, 1.8, 2))
    assert policy.round_seconds(PROBE) == pytest.approx(0.03)
    assert policy.round_seconds(SMALL) == pytest.approx(0.03)  # a tree: the nearest known
    assert policy.round_seconds(PLAIN) is None and policy.expected_rates()[PLAIN] is None
    assert policy.next_mode() == PLAIN
    assert policy.segment_rounds(PLAIN) == PLAIN_TIMING_STEPS < PLAIN_WIDTH
    policy.observe(PLAIN, PLAIN_TIMING_STEPS * 0.016, PLAIN_TIMING_STEPS, 0, 0)
    assert policy.segment_rounds(PLAIN) == PLAIN_WIDTH


def test_a_cheap_tree_runs_segments_that_fill_the_segment_time():
    """A timed tree runs as many rounds as fill `SEGMENT_S` (each segment's dispatch idles
    the machine), at least `spec_rounds` and at most 4x; an untimed one `spec_rounds`; the
    serving engine's policy (`segment_s=0`) exactly `spec_rounds`."""
    for segment_s, round_s, rounds in ((SEGMENT_S, 0.02, int(SEGMENT_S / 0.02)),
                                       (SEGMENT_S, 0.0005, 4 * SPEC_ROUNDS),
                                       (SEGMENT_S, 0.2, SPEC_ROUNDS), (0, 0.02, SPEC_ROUNDS)):
        policy = AutoPolicy(PLAN, Knowledge(), segment_s=segment_s)
        assert policy.segment_rounds(SMALL) == SPEC_ROUNDS  # not timed yet
        policy.observe(SMALL, 4 * round_s, 4, 4, 4)
        assert policy.segment_rounds(SMALL) == rounds


def test_acceptance_is_a_decayed_mean_and_a_prior_weighs_little():
    policy = AutoPolicy(PLAN, Knowledge())
    policy.observe(SMALL, 0.2, 4, 0, 16)  # 4 rounds of 4 rows accepting nothing
    policy.observe(SMALL, 0.2, 4, 64, 16)  # then 4 each: the older weigh 2^(-4 / HALF_LIFE)
    older = 0.5 ** (4 / HALF_LIFE)
    assert policy.acceptance_length(SMALL) == pytest.approx(1 + 64 / (16 + 16 * older))
    inherited = AutoPolicy(PLAN, Knowledge.from_json(policy.knowledge.to_json()))
    name = PLAN.name(SMALL)
    assert inherited.knowledge.rounds[name] == pytest.approx(PRIOR_ROUNDS)
    assert inherited.acceptance_length(SMALL) == pytest.approx(policy.acceptance_length(SMALL))
    inherited.observe(SMALL, 0.2, 4, 0, 16)  # the new request's own rounds soon dominate
    assert inherited.acceptance_length(SMALL) < 1.5
    for _ in range(4):
        policy.observe(PLAIN, 0.1, HALF_LIFE, 0, 0)  # 4 half-lives of plain steps
    assert policy.knowledge.rounds[PLAN.name(SMALL)] == pytest.approx((16 + 16 * older) / 16)


def _stored(**changes) -> dict:
    return {**Knowledge().to_json(), **changes}


@pytest.mark.parametrize("stored", [
    None, [], {"accepted": {}}, _stored(accepted={"x": -1.0}),
    _stored(round_s={"plain": ["fast"]}), _stored(probe_every=0)])
def test_malformed_knowledge_is_refused(stored):
    assert Knowledge.from_json(_stored()) == Knowledge()
    with pytest.raises((ValueError, KeyError, TypeError)):
        Knowledge.from_json(stored)


def test_the_mix_names_modes_by_their_share_of_forwards():
    from eaglejax.decoding.adaptive import describe_mix

    assert describe_mix({"plain": 30, PLAN.name(PROBE): 10}) == \
        f"auto: plain 75%, {PLAN.name(PROBE)} 25%"
    assert describe_mix({"plain": 7}) == "auto: plain 100%"
    assert describe_mix({}) == "auto: no decode step"  # max_new_tokens=1: the prefill's token


# The adaptive loop itself runs in a fresh interpreter: inside the full suite, XLA:CPU (jax
# 0.10.2) once segfaulted compiling the probe's loop on the tiny model after the earlier
# tests' compiles (see test_tree_decoding), while the same code passes in a fresh process.
# One process runs the three checks in turn (one start and one model build, not three).
CHECKS = ["switching", "auto", "sampling"]


def test_adaptive_loop_in_a_fresh_process(tmp_path):
    here = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, str(here / "test_auto.py"), str(tmp_path)],
                          cwd=here, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [f"{check} ok" for check in CHECKS] == proc.stdout.split("\n")[-1 - len(CHECKS):-1]


class Scripted(AutoPolicy):
    """Runs `script` [(mode, target forwards)] round and round, learning as `auto` does."""

    def __init__(self, plan: AutoPlan, script: list[tuple[int, int]]):
        super().__init__(plan, Knowledge())
        self.script, self.now = itertools.cycle(script), None

    def next_mode(self) -> int:
        self.now = next(self.script)
        return self.now[0]

    def segment_rounds(self, mode: int) -> int:
        return self.now[1]


# every mode after every other, budgets that cut segments short and long
SCRIPT = [(PROBE, 1), (PLAIN, 3), (SMALL, 2), (PLAIN, 1), (LARGE, 1), (PROBE, 2), (SMALL, 1),
          (PLAIN, 16), (LARGE, 3)]


def _prompts(seed, n):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, 97, size=rs.randint(2, 40)).tolist() for _ in range(n)]


def _decode(target, draft, prompts, policy, max_new, **sampling):
    from eaglejax.decoding.adaptive import adaptive_decode
    from eaglejax.decoding.sampling import SamplingParams
    from eaglejax.prompting import stop_criteria

    params = SamplingParams.make(sampling.get("temperature", 0.0), 0, sampling.get("top_p", 1.0))
    run = adaptive_decode(target, draft, prompts, sampling.get("seeds", [0] * len(prompts)),
                          params, max_new, stop_criteria(target, [], False), policy)
    out = run.run.state.out
    counts = np.asarray(out.counts)
    return [np.asarray(out.tokens)[i, :counts[i]].tolist() for i in range(len(prompts))], run


class Recorded(Scripted):
    """`Scripted`, noting each segment in `events`."""

    def __init__(self, plan: AutoPlan, script: list[tuple[int, int]], events: list[str]):
        super().__init__(plan, script)
        self.events = events

    def next_mode(self) -> int:
        self.events.append("segment")
        return super().next_mode()


def check_switching(target):
    """Greedy, with every switch between modes: the plain tokens, cut at EOS where plain
    decoding cuts (inside a plain segment or a round), the other rows going on. Every
    program is compiled before the first segment: a switch never compiles."""
    from spec_helpers import self_draft

    import eaglejax
    from eaglejax.decoding import bundle

    prompts = _prompts(4, 4)
    free = eaglejax.generate(prompts, target=target, max_new_tokens=48, ignore_eos=True)
    eos = free[1].token_ids[9]
    target = eaglejax.Target(target.config, target.params, None, target.source, (eos,))
    plain = eaglejax.generate(prompts, target=target, max_new_tokens=48)
    assert plain[1].finish_reason == "eos" and plain[0].finish_reason == "length"
    events: list[str] = []
    compile_once = bundle.compile_once
    bundle.compile_once = lambda fn, *a, **k: events.append("compile") or compile_once(
        fn, *a, **k)
    try:
        tokens, run = _decode(target, self_draft(target), prompts,
                              Recorded(PLAN, SCRIPT, events), 48)
    finally:
        bundle.compile_once = compile_once
    assert tokens == [p.token_ids for p in plain]
    assert set(run.forwards_by_mode) == {PLAN.name(m) for m in range(4)}
    first = events.index("segment")
    assert events[:first] == ["compile"] * (1 + len(PLAN.modes))  # the prefill, every mode
    assert set(events[first:]) == {"segment"}


def check_auto(target, cache_dir):
    """The default policy: plain tokens with a head that drafts well and one that never
    does; the modes named in the metrics; what it learnt kept on disk for a new process,
    and a damaged file is learnt anew."""
    from spec_helpers import random_eagle3, self_draft

    import eaglejax
    from eaglejax.decoding import adaptive, autotune, bundle
    from eaglejax.decoding.suffix_history import shared_history

    os.environ.update(EAGLEJAX_AUTOTUNE_CACHE="1", EAGLEJAX_CACHE=str(cache_dir))
    prompts = _prompts(5, 2)
    plain = eaglejax.generate(prompts, target=target, max_new_tokens=40, ignore_eos=True)
    good, useless = self_draft(target), random_eagle3(target, seed=3)
    plan = AutoPlan.for_target(target, good)  # the plan generate() uses
    # a plain step another process once timed at a busy moment (1 s)
    autotune.remember(target, good, 2, plan, Knowledge(round_s={"plain": [1.0]}))
    for draft in (good, useless):
        # auto's lookup branches search the replies decoded before: the useless head's
        # would copy the good one's replies to the same prompts.
        shared_history().clear()
        out = eaglejax.generate(prompts, target=target, draft=draft, speculative="auto",
                                max_new_tokens=40, ignore_eos=True)
        assert [o.token_ids for o in out] == [p.token_ids for p in plain]
        m = out[0].metrics
        assert m.speculative.startswith("auto: ")
        # the speed-up over plain steps as this process timed them apart, not as inherited
        assert m.plain_step_s in adaptive._PLAIN_STEP_S.values() and m.plain_step_s < 0.5
        assert m.speedup_over_plain == m.decode_tokens_per_s * m.plain_step_s
    assert "plain" in m.speculative  # the useless head decoded plainly
    compiled: list = []  # the prefill finishes the call: no mode is compiled
    compile_once = bundle.compile_once
    bundle.compile_once = lambda fn, *a, **k: compiled.append(fn) or compile_once(fn, *a, **k)
    try:
        (one,) = eaglejax.generate(prompts[:1], target=target, draft=good,
                                   speculative="auto", max_new_tokens=1, ignore_eos=True)
    finally:
        bundle.compile_once = compile_once
    assert len(compiled) == 1, compiled
    assert one.token_ids == plain[0].token_ids[:1]
    assert one.metrics.speculative == "auto: no decode step"
    learnt = autotune.recall(target, good, 2, plan)
    # the self-draft's probe accepts deep paths; the random head's trees far less (its
    # lookup branch copies from the repeating text of this random target: AL about 2)
    good_policy = AutoPolicy(plan, learnt)
    useless_policy = AutoPolicy(plan, autotune.recall(target, useless, 2, plan))
    # on a CPU the 6-node tree comes after the depth-1 tree
    probe, small = len(plan.modes) - 1, plan.modes.index(PLAN.modes[SMALL])
    # a head's CPU plan weighs a depth-1 tree of two draft tokens
    assert (plan.modes[1].depth, plan.modes[1].num_nodes) == (1, 3)
    assert good_policy.acceptance_length(probe) > 2.0  # measured 3.7 (useless: 1.7)
    assert useless_policy.acceptance_length(probe) < good_policy.acceptance_length(probe) - 1
    assert useless_policy.acceptance_length(small) < good_policy.acceptance_length(small) - 0.5
    # the depth-1 tree accepts at most 2 tokens a round (a copied one under the head's best),
    # 6 where it verifies a long copy instead (`autotune.DEPTH_ONE_LONG_COPY`): on this
    # random target's looping text both heads' copies accept most (AL 3.0-3.3 when written)
    assert plan.modes[1].long_lookup == autotune.DEPTH_ONE_LONG_COPY[0] == 6
    for policy in (useless_policy, good_policy):
        assert 1.5 <= policy.acceptance_length(1) <= 7.0, policy.acceptance_length(1)
    stored = json.loads((cache_dir / autotune.KNOWLEDGE_FILE).read_text())
    assert len(stored) == 3 and all(set(v) == set(learnt.to_json()) for v in stored.values())
    autotune._KNOWN.clear()  # as a new process
    again = autotune.recall(target, good, 2, plan)
    assert again.round_s == learnt.round_s and again.probe_every == learnt.probe_every
    (cache_dir / autotune.KNOWLEDGE_FILE).write_text("{not json")
    autotune._KNOWN.clear()
    assert autotune.recall(target, good, 2, plan) == Knowledge()
    eaglejax.generate(prompts, target=target, draft=good, speculative="auto",
                      max_new_tokens=40, ignore_eos=True)  # the programs compiled above
    assert len(json.loads((cache_dir / autotune.KNOWLEDGE_FILE).read_text())) == 1

    # With no draft, auto over one row is the gated suffix tree; over several it weighs
    # suffix trees: plain tokens, and where the text repeats itself the probe's suffix trees
    # are accepted.
    echo = prompts[0] + plain[0].token_ids + prompts[0]
    want = eaglejax.generate([echo, echo], target=target, max_new_tokens=24, ignore_eos=True)
    got = eaglejax.generate([echo, echo], target=target, speculative="auto",
                            max_new_tokens=24, ignore_eos=True)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    suffix_plan = AutoPlan.for_target(target, None)
    assert suffix_plan.name(PROBE) in got[0].metrics.speculative
    (one,) = eaglejax.generate([echo], target=target, speculative="auto", max_new_tokens=24,
                               ignore_eos=True)
    assert one.token_ids == want[0].token_ids
    assert one.metrics.speculative == SpecConfig.suffix().describe()
    assert one.metrics.acceptance_length > 1.5, one.metrics  # the echo is copied
    want = want[0]
    probing = Scripted(suffix_plan, [(PROBE, 4)])  # the probe's counts over the whole echo
    assert _decode(target, None, [echo], probing, 24)[0] == [want.token_ids]
    assert probing.acceptance_length(PROBE) > 1.5, probing.knowledge  # the echo is copied


def check_sampling(target):
    """Sampled tokens follow the target's exact law while the modes switch under them (a
    head that drafts well, so rounds accept and reject; the rejection paths of each shape
    are tested in test_speculative_sampling)."""
    from spec_helpers import self_draft
    from test_speculative_sampling import (
        PROMPT,
        N,
        assert_follows,
        exact_marginals,
        sharpened,
    )

    from eaglejax.decoding.sampling import SamplingParams

    target = sharpened(target, 4.0)
    target = type(target)(target.config, target.params, None, target.source, ())
    tokens, _ = _decode(target, self_draft(target), [PROMPT] * N,
                        Scripted(PLAN, [(PROBE, 1), (PLAIN, 1), (SMALL, 1)]), 3,
                        temperature=0.7, top_p=0.9, seeds=list(range(N)))
    assert_follows(np.array(tokens), exact_marginals(target, SamplingParams.make(0.7, 0, 0.9), 3))


if __name__ == "__main__":  # the fresh-process half of test_adaptive_loop_in_a_fresh_process
    from conftest import make_hf_model
    from spec_helpers import make_selfdraftable

    import eaglejax

    directory = Path(sys.argv[1])
    model = make_hf_model("llama", directory, seed=11, num_hidden_layers=2)
    make_selfdraftable(model)
    model.save_pretrained(directory)
    fresh_target = eaglejax.load_target(directory)
    check_switching(fresh_target)
    print("switching ok", flush=True)
    check_auto(fresh_target, directory / "eaglejax-cache")
    print("auto ok", flush=True)
    check_sampling(fresh_target)
    print("sampling ok", flush=True)
