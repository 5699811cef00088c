"""One static batch: token-id prompts prefilled and decoded by one compiled program pair
(what `generate()` runs; autotuning and benchmarks time it)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax import compilation_cache, native
from eaglejax.decoding import plain
from eaglejax.decoding.buckets import bucket
from eaglejax.decoding.calibration import calibration_loop
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.speculative import spec_loop, spec_prefill
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.models.attention import resolve_impl
from eaglejax.native import cache_attention
from eaglejax.sharding.mesh import mesh_context
from eaglejax.models.placement import replicate
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

    state: object
    compile_s: float
    prefill_s: float
    decode_s: float
    calibration: jax.Array | None = None


class Timed(NamedTuple):
    """A jitted call's result, the seconds spent compiling it and running it."""

    result: object
    compile_s: float
    run_s: float


def compile_once(fn, *args, **kwargs) -> float:
    """Compile jitted `fn` for these arguments ahead of time (a lookup when this process
    already did; maybe a persistent cache load); the seconds it took. A call with the same
    arguments reuses the program."""
    start = time.perf_counter()
    with compilation_cache.caching_every_program():
        fn.lower(*args, **kwargs).compile()
    return time.perf_counter() - start


def compile_then_run(fn, *args, **kwargs) -> Timed:
    """`compile_once`, then run: compiling and running are timed apart."""
    compile_s = compile_once(fn, *args, **kwargs)
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args, **kwargs))
    return Timed(result, compile_s, time.perf_counter() - start)


class Inputs(NamedTuple):
    """A batch's device inputs: right-padded prompts [B,P], their lengths [B], per-row PRNG
    keys, the sampling parameters and the new-token limit (replicated over a target's mesh)."""

    prompt: jax.Array
    prompt_lengths: jax.Array
    row_keys: jax.Array
    sampling: SamplingParams
    max_new: jax.Array


def batch_inputs(target: Target, encoded: list[list[int]], seeds: list[int],
                 sampling: SamplingParams, max_new_tokens: int) -> Inputs:
    """`Inputs` for token-id prompts (prompt length bucketed to a multiple of 16)."""
    lengths = [len(ids) for ids in encoded]
    prompt = np.zeros((len(encoded), bucket(max(lengths), 16)), np.int32)
    for i, ids in enumerate(encoded):
        prompt[i, :len(ids)] = ids
    inputs = Inputs(jnp.asarray(prompt), jnp.asarray(lengths, jnp.int32),
                    jax.vmap(jax.random.PRNGKey)(jnp.asarray(seeds, jnp.uint32)), sampling,
                    jnp.int32(max_new_tokens))
    if target.mesh is not None:  # every process passes the same inputs, replicated
        inputs = Inputs(*replicate(tuple(inputs), target.mesh))
    return inputs


def decode(target: Target, draft: "Draft | None", encoded: list[list[int]], seeds: list[int],
           sampling: SamplingParams, max_new_tokens: int, criteria: StopCriteria,
           spec: SpecConfig | None, calibration_sizes: tuple[int, ...] = ()) -> DecodeRun:
    """Prefill and decode validated token-id prompts in one compiled batch; with
    `calibration_sizes`, greedily with `spec`'s largest tree, counting what each smaller
    size would have accepted (`decoding.calibration`)."""
    lengths = [len(ids) for ids in encoded]
    max_tokens = bucket(max_new_tokens, 16)
    capacity = cache_capacity(max(lengths), max_new_tokens, spec.num_nodes if spec else 0,
                              capacity_floor(target))
    greedy = bool(sampling.temperature == 0)
    if spec is not None:
        spec.check_sampling(greedy)
    common = dict(stop=criteria, attn_impl=target.attn_impl)
    args = (target.params, target.config)
    prompt, prompt_lengths, row_keys, sampling, max_new = batch_inputs(
        target, encoded, seeds, sampling, max_new_tokens)
    with mesh_context(target.mesh):
        return _decode_compiled(target, draft, args, prompt, prompt_lengths, row_keys, sampling,
                                max_new, capacity, max_tokens, greedy, spec, calibration_sizes,
                                common)


def _decode_compiled(target, draft, args, prompt, prompt_lengths, row_keys, sampling, max_new,
                     capacity, max_tokens, greedy, spec, calibration_sizes, common) -> DecodeRun:
    if draft is None:
        prefilled = compile_then_run(
            plain.prefill, *args, prompt, prompt_lengths, row_keys, sampling, max_new,
            capacity=capacity, max_tokens=max_tokens, greedy=greedy, **common)
        decoded = compile_then_run(plain.decode_loop, *args, prefilled.result, sampling,
                                    max_new, greedy=greedy, **common)
    else:
        prefilled = compile_then_run(
            spec_prefill, *args, draft.params, draft.config, prompt, prompt_lengths, row_keys,
            sampling, max_new, capacity=capacity, max_tokens=max_tokens, spec=spec,
            greedy=greedy, **common)
        loop_args = (*args, draft.params, draft.config, draft.d2t, prefilled.result, sampling,
                     max_new)
        if calibration_sizes:
            decoded = compile_then_run(calibration_loop, *loop_args, spec=spec,
                                        sizes=calibration_sizes, **common)
            state, counts = decoded.result
            return DecodeRun(state, prefilled.compile_s + decoded.compile_s, prefilled.run_s,
                             decoded.run_s, counts)
        decoded = compile_then_run(spec_loop, *loop_args, spec=spec, greedy=greedy, **common)
    return DecodeRun(decoded.result, prefilled.compile_s + decoded.compile_s,
                     prefilled.run_s, decoded.run_s)
