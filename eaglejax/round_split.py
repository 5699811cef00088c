"""Where a speculative round's time goes, measured in the compiled loop itself.

The speculative loop is compiled five ways, each running a fixed number of rounds: whole,
and truncated after each phase (`decoding.speculative.PHASES`: loop bookkeeping only,
+ drafting, + the verify forward, + acceptance and commit); the differences between
neighbours are the phases' costs. The plain loop runs as many steps beside them,
interleaved, so every phase is also given in plain steps. Truncation changes what XLA can
fuse across a phase's border, so a phase's figure is its marginal cost in this loop, not a
kernel's time in isolation (it can come out negative); `benchmarks/profile_round.py` times
each kernel in the round from XLA's profiler instead.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.decoding import loops
from eaglejax.decoding.batch import batch_inputs, cache_capacity
from eaglejax.decoding.buckets import bucket
from eaglejax.decoding.bundle import Bundle
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.speculative import PHASES
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.target import Target

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft

# What each phase's figure covers (the keys of `round_split`'s "phases_ms").
PHASE_NAMES = {"loop": "other", "draft": "draft", "verify": "verify",
               "accept": "accept_commit", "catch_up": "catch_up"}


def _timed_runs(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per forward of each run (a call returning its final state), after one
    warm-up call each (compiling); repeats interleaved, the order rotating."""
    for run in runs.values():
        jax.block_until_ready(run())
    names, times = list(runs), {name: [] for name in runs}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            state = jax.block_until_ready(runs[name]())
            times[name].append((time.perf_counter() - start) / max(int(state.forwards), 1))
    return {name: float(np.median(t)) for name, t in times.items()}


def side_by_side(target: Target, draft: "Draft", spec: SpecConfig, prompt: list[int],
                 rounds: int, sampling: SamplingParams) -> dict[str, tuple[Bundle, tuple]]:
    """`rounds` plain steps ("plain") and `rounds` speculative rounds of `spec` ("round")
    on token-id `prompt` (batch 1): each one's bundle and its `loops.decode_loop` arguments
    after the loop and weights, from a prefilled state (which the loop donates: copy it)."""
    greedy = bool(sampling.temperature == 0)
    spec.check_sampling(greedy)
    max_new = rounds * (spec.max_depth + 1) + 1
    capacity = cache_capacity(len(prompt), max_new, spec.most_nodes)
    speculating, plainly = Bundle.of(target, draft, spec), Bundle.of(target)
    inputs = batch_inputs(speculating, [prompt], [0], sampling, max_new)
    sized = dict(capacity=capacity, max_tokens=bucket(max_new, 16), greedy=greedy,
                 stop=StopCriteria())
    spec_state = speculating.run(loops.prefill, *inputs, **sized)
    plain_inputs = inputs._replace(max_new=plainly.put(np.int32(rounds + 1)))
    plain_state = plainly.run(loops.prefill, *plain_inputs, **sized)
    return {"plain": (plainly, (plain_state, inputs.sampling, plain_inputs.max_new)),
            "round": (speculating, (spec_state, inputs.sampling, inputs.max_new,
                                    speculating.put(np.int32(rounds))))}


def round_split(target: Target, draft: "Draft", spec: SpecConfig, prompt: list[int], *,
                rounds: int = 32, repeats: int = 5, sampling: SamplingParams | None = None,
                split: bool = True) -> dict[str, Any]:
    """Time `rounds` speculative rounds of `spec` on token-id `prompt` (batch 1), whole and
    truncated after each phase, beside `rounds` plain steps: the round's cost per phase in
    ms and in plain steps. Greedy unless `sampling` (temperature > 0) is given. With
    `split=False` only whole rounds are timed (two compiled loops instead of six) and the
    result has no "phases_ms"."""
    sampling = sampling or SamplingParams.make()
    greedy = bool(sampling.temperature == 0)
    calls = side_by_side(target, draft, spec, prompt, rounds, sampling)
    (plainly, plain_args), (speculating, spec_args) = calls["plain"], calls["round"]
    copy = lambda state: jax.tree.map(jnp.copy, state)  # noqa: E731  (loops donate it)
    runs = {"plain": lambda: plainly.run(loops.decode_loop, copy(plain_args[0]),
                                         *plain_args[1:], greedy=greedy, stop=StopCriteria())}
    for phase in PHASES if split else PHASES[-1:]:
        truncated = speculating.with_loop(dataclasses.replace(speculating.loop, through=phase))
        runs[phase] = lambda truncated=truncated: truncated.run(
            loops.decode_loop, copy(spec_args[0]), *spec_args[1:], greedy=greedy,
            stop=StopCriteria())
    seconds = _timed_runs(runs, repeats)
    plain_ms = 1e3 * seconds["plain"]
    round_ms = 1e3 * seconds[PHASES[-1]]
    whole = {"speculative": spec.describe(), "prompt_tokens": len(prompt), "rounds": rounds,
             "repeats": repeats, "plain_step_ms": plain_ms, "round_ms": round_ms,
             "round_in_plain_steps": round_ms / plain_ms}
    if not split:
        return whole
    through_ms = [1e3 * seconds[phase] for phase in PHASES]
    phases_ms = {PHASE_NAMES[PHASES[0]]: through_ms[0]}
    for phase, before, after in zip(PHASES[1:], through_ms, through_ms[1:]):
        phases_ms[PHASE_NAMES[phase]] = after - before
    return {
        **whole,
        "phases_ms": phases_ms,
        "phases_in_plain_steps": {name: ms / plain_ms for name, ms in phases_ms.items()},
        "outside_verify_in_plain_steps": (round_ms - phases_ms["verify"]) / plain_ms,
    }


def describe_split(split: dict[str, Any]) -> str:
    """One line per phase of a `round_split` result, for people."""
    lines = [f"round split of {split['speculative']} ({split['rounds']} rounds, median of "
             f"{split['repeats']}): round {split['round_ms']:.2f} ms = "
             f"{split['round_in_plain_steps']:.2f} plain steps of {split['plain_step_ms']:.2f} "
             f"ms"]
    for name, ms in split.get("phases_ms", {}).items():
        lines.append(f"{name:>26}: {ms:7.2f} ms  {split['phases_in_plain_steps'][name]:5.2f} "
                     f"plain steps")
    return "\n".join(lines)
