"""`speculative="auto"` decoding: segments of plain steps or speculative rounds, each mode
chosen from what the segments before it measured (`eaglejax.decoding.autotune`).

Every mode is one compiled program over the same speculative state (prefilled once for the
probe's shape: its cache, history and lookup context are the largest any mode needs), run
until a target-forward budget or every row's end: the probe counts what each candidate
would have accepted (`decoding.calibration.calibration_loop`), the other trees decode as
fixed shapes do (`loops.decode_loop`), and plain segments keep the head caught up
(`decoding.plain_segment`). Between segments the host reads a few counters and times the
segment; no token leaves the device. Every mode's program is compiled before the first
segment, so a switch never compiles (a later process loads them from the disk cache), and
first run on a copy of the state, counted as compile time: one round (XLA:CPU links a
program's kernels as they first run), then segments of no round, which time what a
segment costs beyond its rounds; the policy learns each mode's cost per round without it.
Then, once per process, a few plain segments on that copy time plain decoding's step, which
the call's metrics report (`speedup_over_plain`).
A call the prefill finishes (max_new_tokens=1) compiles none.
Greedy output is the plain output; sampled output follows the target's
distribution exactly whatever the modes, since each round is exact given what came before
it (the tokens themselves depend on the modes chosen, and with them on the batch).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.decoding.autotune import (
    PLAIN_TIMING_STEPS,
    PLAIN_WIDTH,
    AutoPlan,
    AutoPolicy,
    recall,
    remember,
)
from eaglejax.decoding import loops
from eaglejax.decoding.batch import DecodeRun, batch_inputs, cache_capacity, capacity_floor
from eaglejax.decoding.buckets import bucket
from eaglejax.decoding.bundle import Bundle
from eaglejax.decoding.calibration import calibration_loop
from eaglejax.decoding.plain_segment import plain_segment
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.target import Target

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft


class AdaptiveRun(NamedTuple):
    """A finished `auto` decode: the run (as `decoding.batch.decode` gives), the target
    forwards each mode ran, by mode name, in the order first used, and a plain decoding
    step's time as `auto` measured it (None: never timed)."""

    run: DecodeRun
    forwards_by_mode: dict[str, int]
    plain_step_s: float | None = None


def describe_mix(forwards_by_mode: dict[str, int]) -> str:
    """E.g. "auto: tree top_k=4 ... 81%, plain 19%" (shares of target forwards)."""
    total = sum(forwards_by_mode.values())
    if not total:
        return "auto: no decode step"
    parts = sorted(forwards_by_mode.items(), key=lambda item: -item[1])
    return "auto: " + ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in parts if n)


# Per program (function, static arguments, argument shapes) this process ran: what a
# segment of it costs beyond its rounds (the dispatch of its arrays, the loop's exit, the
# host's reading of the counters, a plain segment's catch-up of the head).
_SEGMENT_OVERHEAD_S: dict[tuple, float] = {}
IDLE_RUNS = 3  # segments of no round timed per program; the least is its overhead
# Per plain program this process ran: its step's seconds, timed on the scratch state over
# `PLAIN_CHECKS` segments of `PLAIN_WIDTH` steps (the least), which the call's metrics report
# (`speedup_over_plain`). The policy's own plain cost, from its segments, runs high (a first
# 4-step segment timed 7.4 ms where plain decoding ran 5.5-5.9, a 2-core Zen 4; the printed
# speed-up 1.28-1.82x beside `--no-draft`'s 0.95-1.45x); given this figure instead, it chose
# plain decoding for the README's prompt and decoded at 0.82-0.92x `--no-draft`
# (BENCHMARKS.md, session 50), so it keeps its own.
_PLAIN_STEP_S: dict[tuple, float] = {}
PLAIN_CHECKS = 2


def _program_key(fn, args: tuple, static: dict) -> tuple:
    return (fn, tuple(sorted(static.items())),
            tuple((leaf.shape, str(leaf.dtype)) if hasattr(leaf, "shape") else leaf
                  for leaf in jax.tree.leaves(args)))


def adaptive_decode(target: Target, draft: "Draft", encoded: list[list[int]],
                    seeds: list[int], sampling: SamplingParams, max_new_tokens: int,
                    criteria: StopCriteria, policy: AutoPolicy | None = None,
                    logprobs: int | None = None) -> AdaptiveRun:
    """Prefill and decode validated token-id prompts in one batch, switching modes between
    segments as `policy` chooses (by default the device's plan, starting from what earlier
    calls learnt; see the module docstring); what it learnt is kept for the next call (not
    from a call keeping `logprobs`, whose steps cost more)."""
    batch = len(encoded)
    if policy is None:
        plan = AutoPlan.for_target(target, draft)
        policy = AutoPolicy(plan, recall(target, draft, batch, plan))
    run = _adaptive_decode(target, draft, encoded, seeds, sampling, max_new_tokens, criteria,
                           policy, logprobs)
    if logprobs is None:
        remember(target, draft, batch, policy.plan, policy.knowledge)
    return run


def _adaptive_decode(target, draft, encoded, seeds, sampling, max_new_tokens, criteria,
                     policy, logprobs) -> AdaptiveRun:
    plan = policy.plan
    greedy = bool(sampling.temperature == 0)
    probe = Bundle.of(target, draft, plan.probe)
    capacity = cache_capacity(max(len(ids) for ids in encoded), max_new_tokens,
                              probe.loop.scratch_rows, capacity_floor(target))
    inputs = batch_inputs(probe, encoded, seeds, sampling, max_new_tokens)
    sampling, max_new = inputs.sampling, inputs.max_new
    prefilled = probe.compile_then_run(loops.prefill, *inputs, capacity=capacity,
                                       max_tokens=bucket(max_new_tokens, 16), greedy=greedy,
                                       stop=criteria, logprobs=logprobs)
    state, compile_s, prefill_s = prefilled

    def segment(mode: int, state, until: jax.Array):
        """The program of `mode`, its bundle, arguments and static arguments."""
        spec = plan.modes[mode]
        args = (state, sampling, max_new, until)
        if spec is None:
            return plain_segment, probe, args, dict(width=PLAIN_WIDTH, greedy=greedy,
                                                    stop=criteria)
        if mode == policy.probe:
            return calibration_loop, probe, args, dict(sizes=plan.sizes, greedy=greedy,
                                                       stop=criteria, long_copy=plan.long_copy)
        return loops.decode_loop, probe.with_spec(spec), args, dict(greedy=greedy,
                                                                    stop=criteria)

    def run_segment(mode: int, state, until: int):
        """`mode` until `until` target forwards: the state, the host's copies of its
        forwards, running rows and acceptance histogram, a probe's counts, the seconds."""
        fn, models, args, static = segment(mode, state, jnp.int32(until))
        start = time.perf_counter()
        result = models.run(fn, *args, **static)
        state, counts = result if mode == policy.probe else (result, None)
        fetched = jax.device_get((state.forwards, state.out.running, state.accept_hist))
        if counts is not None:
            counts = jax.device_get(counts).sum(axis=0)
        return state, *fetched, counts, time.perf_counter() - start

    running = bool(jax.device_get(jnp.any(state.out.running)))  # max_new_tokens=1: done
    overhead_s = [0.0] * len(plan.modes)
    scratch, scratch_forwards = None, 0  # a copy of the state for each mode's first runs
    keys = []
    for mode in range(len(plan.modes) if running else 0):  # nothing to decode: no segment
        fn, models, args, static = segment(mode, state, jnp.int32(0))
        compile_s += models.compile(fn, *args, **static)
        key = _program_key(fn, (models.loop, *args), static)
        keys.append(key)
        if key not in _SEGMENT_OVERHEAD_S:
            # XLA:CPU links a program's kernels as they first run (a one-token round's
            # first run 16 ms against 6, BENCHMARKS.md): one round on a copy of the state,
            # with the compiling; then segments of no round time what one costs beyond its
            # rounds, which the policy's round costs leave out (a plain step timed in
            # 4-step segments measured 4.9 ms where plain decoding's steps take 3.8).
            start = time.perf_counter()
            if scratch is None:
                scratch = jax.tree.map(jnp.copy, state)
            scratch_forwards += 1
            idle = []
            for _ in range(1 + IDLE_RUNS):
                scratch, *_, seconds = run_segment(mode, scratch, scratch_forwards)
                idle.append(seconds)
            _SEGMENT_OVERHEAD_S[key] = min(idle[1:])
            compile_s += time.perf_counter() - start
        overhead_s[mode] = _SEGMENT_OVERHEAD_S[key]
    plain_key = keys[0] if keys else None  # modes[0]: plain decoding
    if plain_key is not None and plain_key not in _PLAIN_STEP_S:
        if scratch is None:
            scratch = jax.tree.map(jnp.copy, state)
        start = time.perf_counter()
        steps_s = _time_plain_steps(run_segment, scratch, scratch_forwards, overhead_s[0])
        compile_s += time.perf_counter() - start
        if steps_s:
            _PLAIN_STEP_S[plain_key] = min(steps_s)
    del scratch
    forwards_by_mode: dict[str, int] = {}
    decode_s, forwards = 0.0, 0
    hist = np.zeros(state.accept_hist.shape, np.int64)
    while running:
        mode = policy.next_mode()
        state, now_forwards, rows_running, new_hist, counts, seconds = run_segment(
            mode, state, forwards + policy.segment_rounds(mode))
        running = bool(rows_running.any())
        decode_s += seconds
        segment_forwards, rounds = int(now_forwards) - forwards, new_hist - hist
        forwards, hist = int(now_forwards), new_hist
        name = plan.name(mode)
        forwards_by_mode[name] = forwards_by_mode.get(name, 0) + segment_forwards
        # the rounds' own time (at least half the segment's, whatever the noise)
        rounds_s = max(seconds - overhead_s[mode], seconds / 2)
        policy.observe(mode, rounds_s, segment_forwards,
                       (rounds * np.arange(rounds.shape[1])).sum(), int(rounds.sum()), counts)
    return AdaptiveRun(DecodeRun(state, compile_s, prefill_s, decode_s), forwards_by_mode,
                       _PLAIN_STEP_S.get(plain_key) or policy.round_seconds(0))


def _time_plain_steps(run_segment, scratch, forwards: int, overhead_s: float) -> list[float]:
    """Plain decoding's step time, measured on the scratch state after every mode's first
    runs: `PLAIN_CHECKS` segments of `PLAIN_WIDTH` steps, each less what a segment costs
    beyond its steps, in seconds a step (those that ran `PLAIN_TIMING_STEPS` steps or more)."""
    timed = []
    for _ in range(PLAIN_CHECKS):
        scratch, now, running, *_, seconds = run_segment(0, scratch, forwards + PLAIN_WIDTH)
        steps, forwards = int(now) - forwards, int(now)
        if steps >= PLAIN_TIMING_STEPS:
            timed.append(max(seconds - overhead_s, seconds / 2) / steps)
        if not running.any():
            break
    return timed
