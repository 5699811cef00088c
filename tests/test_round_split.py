"""The round split (`eaglejax.round_split`): truncated loops keep each phase's work, and the
split is reported for a real compiled loop."""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import pytest
from spec_helpers import random_eagle3

from eaglejax.bench import profile_rounds, shapes_to_profile
from eaglejax.decoding.autotune import AutoPlan
from eaglejax.decoding.batch import batch_inputs
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding import loops
from eaglejax.decoding.bundle import Bundle
from eaglejax.decoding.speculative import PHASES
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.round_split import PHASE_NAMES, describe_split

SPEC = SpecConfig.tree(top_k=3, depth=3, total_tokens=6).with_lookup(2, 2)
PROMPT = [5, 9, 17, 5, 9, 23, 40, 2, 8, 5, 9]


def _products_in_loop(hlo: str) -> int:
    """Matrix products and native kernels run by the round of a compiled loop's text: in the
    computations that while-loop bodies reach (work hoisted out of the loop not counted)."""
    computations = {}
    for block in re.split(r"\n(?=(?:ENTRY )?%\S+ \()", hlo):
        name = re.match(r"(?:ENTRY )?(%\S+) \(", block)
        if name:
            computations[name.group(1)] = block
    todo, seen = re.findall(r" while\(.*body=(%[^,\s]+)", hlo), set()
    while todo:
        name = todo.pop()
        if name in computations and name not in seen:
            seen.add(name)
            todo += re.findall(r"%[^,\s(){}]+", computations[name])
    return sum(len(re.findall(r"= \S+ (?:dot|custom-call)\(", computations[name]))
               for name in seen)


def test_each_truncated_loop_keeps_the_work_of_its_phases(target_of):
    """A truncated round must not let the compiler drop the phase it stops after, nor hoist
    it out of the loop (its inputs would be loop-invariant): every further phase adds
    products (head steps, the verify forward, the catch-up's head
    forward; acceptance and commit add gathers but no product, so they only must not
    remove any)."""
    target = target_of("llama")
    draft = random_eagle3(target, draft_vocab=60)
    sampling = SamplingParams.make()
    models = Bundle.of(target, draft, SPEC)
    inputs = batch_inputs(models, [PROMPT], [0], sampling, 32)
    common = dict(greedy=True, stop=StopCriteria())
    state = models.run(loops.prefill, *inputs, capacity=128, max_tokens=32, **common)

    def truncated(phase):
        return dataclasses.replace(models.loop, through=phase)

    counts = [_products_in_loop(loops.decode_loop.lower(
        truncated(phase), models.weights, state, sampling, inputs.max_new, jnp.int32(4),
        **common).compile().as_text()) for phase in PHASES]
    loop, drafted, verified, accepted, whole = counts
    assert loop < drafted < verified <= accepted < whole, dict(zip(PHASES, counts))
    with pytest.raises(ValueError, match="through='commit'"):
        loops.decode_loop.lower(truncated("commit"), models.weights, state, sampling,
                                inputs.max_new, jnp.int32(4), **common)


def test_bench_profiles_every_shape_it_may_run(target_of):
    target = target_of("llama")
    draft = random_eagle3(target, draft_vocab=60)
    plan = AutoPlan.for_target(target, draft)
    assert shapes_to_profile(target, draft, "auto") == [m for m in plan.modes if m is not None]
    assert shapes_to_profile(target, draft, None) == [SpecConfig.default_for(False, "cpu")]
    [split] = profile_rounds(target, draft, PROMPT, SPEC, rounds=3, repeats=1)
    assert split["speculative"] == SPEC.describe() and split["rounds"] == 3
    _check_split(split)
    assert describe_split(split).count("plain steps") == len(PHASES) + 1


def _check_split(split: dict) -> None:
    assert list(split["phases_ms"]) == [PHASE_NAMES[p] for p in PHASES]
    assert split["plain_step_ms"] > 0 and split["round_ms"] > 0
    # bit identity is the property: the same two floats divided again
    for name, ms in split["phases_ms"].items():
        assert split["phases_in_plain_steps"][name] == ms / split["plain_step_ms"]
    verify = split["phases_ms"]["verify"]
    assert split["outside_verify_in_plain_steps"] == ((split["round_ms"] - verify)
                                                     / split["plain_step_ms"])


def test_serving_metrics_show_the_engines_round_split(target_of):
    """`eaglejax serve --profile-rounds`: the engine measures its shape's round at start-up
    and /metrics gives every phase in seconds and in plain steps."""
    from eaglejax.serving.engine import Engine
    from eaglejax.serving.metrics import ServingMetrics

    target = target_of("llama")
    engine = Engine(target, random_eagle3(target, draft_vocab=60), speculative=SPEC,
                    num_slots=2, capacity=128)
    [split] = engine.profile_rounds(PROMPT, rounds=3, repeats=1)
    _check_split(split)
    text = ServingMetrics(engine.policy, engine.round_splits).render()[0].decode()
    for phase, ms in split["phases_ms"].items():
        labels = re.escape(f'{{mode="{SPEC.describe()}",phase="{phase}"}}')
        for name, value in (("seconds", ms / 1e3),
                            ("plain_steps", split["phases_in_plain_steps"][phase])):
            [shown] = re.findall(rf"^eaglejax_round_phase_{name}{labels} (\S+)$", text, re.M)
            assert float(shown) == value  # the exposition writes repr(value)
    assert "eaglejax_round_phase_seconds" not in ServingMetrics().render()[0].decode()


def test_whole_rounds_only(target_of):
    """`split=False` (the device benchmark's wide trees): the whole round beside the plain
    step, no phase."""
    from eaglejax.round_split import round_split

    target = target_of("llama")
    whole = round_split(target, random_eagle3(target, draft_vocab=60), SPEC, PROMPT, rounds=3,
                        repeats=1, split=False)
    assert "phases_ms" not in whole and whole["rounds"] == 3
    assert whole["round_in_plain_steps"] == whole["round_ms"] / whole["plain_step_ms"] > 0
    assert describe_split(whole).count("plain steps") == 1
