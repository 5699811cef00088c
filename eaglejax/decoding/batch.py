"""One static batch: token-id prompts prefilled and decoded by one compiled program pair
(what `generate()` runs; autotuning and benchmarks time it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax import native
from eaglejax.decoding import loops
from eaglejax.decoding.bundle import Bundle
from eaglejax.decoding.buckets import bucket
from eaglejax.decoding.calibration import calibration_loop
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.models.attention import resolve_impl
from eaglejax.native import cache_attention
from eaglejax.target import Target

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft


# Where attention reads only each row's valid prefix (the native CPU kernel, the Pallas
# kernels), a larger cache costs memory and no time: every call whose prompt, output and
# scratch rows fit this many slots then runs the same compiled loops, so a prompt of a new
# length never compiles them again (`auto` switches only between compiled shapes on a
# short call).
SHARED_CAPACITY = 1024


def cache_capacity(prompt_tokens: int, max_new_tokens: int, extra: int = 0,
                   floor: int = 0) -> int:
    """Static cache size for prompts up to `prompt_tokens` long: bucketed prompt and output
    lengths plus `extra` scratch rows, rounded up to a multiple of 128, at least `floor`."""
    total = bucket(prompt_tokens, 16) + bucket(max_new_tokens, 16) + extra
    return max(floor, -(-total // 128) * 128)


def capacity_floor(target: Target) -> int:
    """`SHARED_CAPACITY` where a larger cache costs `target`'s attention no time, else 0."""
    if resolve_impl(target.attn_impl) == "pallas":
        return SHARED_CAPACITY
    prefix_only = (jax.default_backend() == "cpu" and target.dtype == jnp.float32
                   and native.kernels_allowed() and cache_attention.available())
    return SHARED_CAPACITY if prefix_only else 0


class DecodeRun(NamedTuple):
    """A finished decode: the loop's final state, its timings (compiling excluded from
    prefill_s and decode_s) and, when asked for, the calibration counts [B,S*(1+L)]
    (`decoding.calibration`)."""

    state: loops.State
    compile_s: float
    prefill_s: float
    decode_s: float
    calibration: jax.Array | None = None


class Inputs(NamedTuple):
    """A batch's device inputs: right-padded prompts [B,P], their lengths [B], per-row PRNG
    keys, the sampling parameters and the new-token limit (replicated over a target's mesh)."""

    prompt: jax.Array
    prompt_lengths: jax.Array
    row_keys: jax.Array
    sampling: SamplingParams
    max_new: jax.Array


def batch_inputs(models: Bundle, encoded: list[list[int]], seeds: list[int],
                 sampling: SamplingParams, max_new_tokens: int) -> Inputs:
    """`Inputs` for token-id prompts (prompt length bucketed to a multiple of 16), placed
    for `models`."""
    lengths = [len(ids) for ids in encoded]
    prompt = np.zeros((len(encoded), bucket(max(lengths), 16)), np.int32)
    for i, ids in enumerate(encoded):
        prompt[i, :len(ids)] = ids
    keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray(seeds, jnp.uint32))
    return Inputs(*models.put((prompt, np.asarray(lengths, np.int32), keys, sampling,
                               np.int32(max_new_tokens))))


def decode(target: Target, draft: "Draft | None", encoded: list[list[int]], seeds: list[int],
           sampling: SamplingParams, max_new_tokens: int, criteria: StopCriteria,
           spec: SpecConfig | None, calibration_sizes: tuple[int, ...] = (),
           logprobs: int | None = None) -> DecodeRun:
    """Prefill and decode validated token-id prompts in one compiled batch (outputs keeping
    `logprobs` most likely tokens' log-probabilities, if not None); with
    `calibration_sizes`, greedily with `spec`'s largest tree, counting what each smaller
    size would have accepted (`decoding.calibration`)."""
    models = Bundle.of(target, draft if spec is not None else None, spec)
    greedy = bool(sampling.temperature == 0)
    if spec is not None:
        spec.check_sampling(greedy)
    lengths = [len(ids) for ids in encoded]
    capacity = cache_capacity(max(lengths), max_new_tokens, models.loop.scratch_rows,
                              capacity_floor(target))
    inputs = batch_inputs(models, encoded, seeds, sampling, max_new_tokens)
    prefilled = models.compile_then_run(
        loops.prefill, *inputs, capacity=capacity, max_tokens=bucket(max_new_tokens, 16),
        greedy=greedy, stop=criteria, logprobs=logprobs)
    loop_args = (prefilled.result, inputs.sampling, inputs.max_new)
    if calibration_sizes:
        decoded = models.compile_then_run(calibration_loop, *loop_args,
                                          sizes=calibration_sizes, stop=criteria)
        state, counts = decoded.result
        return DecodeRun(state, prefilled.compile_s + decoded.compile_s, prefilled.run_s,
                         decoded.run_s, counts)
    decoded = models.compile_then_run(loops.decode_loop, *loop_args, greedy=greedy,
                                      stop=criteria)
    return DecodeRun(decoded.result, prefilled.compile_s + decoded.compile_s,
                     prefilled.run_s, decoded.run_s)
