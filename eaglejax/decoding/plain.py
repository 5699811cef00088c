"""Plain (non-speculative) decoding: the prefill state and one decode step, which
`decoding.loops.PlainLoop` runs (compiled: `loops.prefill`, `loops.decode_loop`).

Rows are right-padded with per-row lengths, so padding never changes any row's tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.config import ModelConfig
from eaglejax.decoding.output import Output, empty_output, record, row_step_keys
from eaglejax.decoding.prefill import PREFILL_CHUNK, prefill_target
from eaglejax.decoding.sampling import SamplingParams, sample_tokens
from eaglejax.decoding.stopping import StopCriteria, StopTable
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import Params, forward, lm_head


class DecodeState(NamedTuple):
    """Everything the plain loop carries."""

    target_cache: kv_cache.KVCache
    last_token: jax.Array  # [B] the newest token, already recorded, not yet in the cache
    out: Output
    row_keys: jax.Array  # [B] PRNG keys, one per row
    forwards: jax.Array  # int32 scalar: target forwards run by the loop


def prefill_state(params: Params, config: ModelConfig, prompt: jax.Array,
                  prompt_lengths: jax.Array, row_keys: jax.Array, sampling: SamplingParams,
                  max_new_tokens: jax.Array, *, capacity: int, max_tokens: int, greedy: bool,
                  stop: StopCriteria | StopTable, attn_impl: AttentionImpl = "auto",
                  prefill_chunk: int = PREFILL_CHUNK,
                  cached: kv_cache.KVCache | None = None,
                  logprobs: int | None = None) -> DecodeState:
    """Run the right-padded prompts [B,P] (`prefill_chunk` tokens at a time; after the rows
    of `cached`, when given: `prefill.prefill_target`), fill the cache and record the first
    new token (an output keeping `logprobs` most likely tokens' log-probabilities, if not
    None: `output.empty_output`)."""
    batch = prompt.shape[0]
    cache, logits, _, _ = prefill_target(params, config, prompt, prompt_lengths, capacity,
                                         attn_impl=attn_impl, chunk=prefill_chunk,
                                         cached=cached)
    out = empty_output(batch, max_tokens, logprobs)
    first = sample_tokens(logits, sampling, row_step_keys(row_keys, out.counts), greedy)
    out = record(out, first, out.running, stop, max_new_tokens, logits)
    return DecodeState(cache, first, out, row_keys, jnp.int32(0))


def decode_step(params: Params, config: ModelConfig, s: DecodeState, sampling: SamplingParams,
                max_new_tokens: jax.Array, *, greedy: bool, stop: StopCriteria | StopTable,
                attn_impl: AttentionImpl = "auto") -> DecodeState:
    """One target forward: every running row gains a token (finished rows stay as they are)."""
    running = s.out.running
    cache = s.target_cache
    out = forward(params, config, s.last_token[:, None], cache.lengths[:, None], cache,
                  attn_impl=attn_impl)
    cache = out.cache._replace(lengths=cache.lengths + running.astype(jnp.int32))
    logits = lm_head(params, out.hidden[:, 0])
    token = sample_tokens(logits, sampling, row_step_keys(s.row_keys, s.out.counts), greedy)
    return DecodeState(cache, jnp.where(running, token, s.last_token),
                       record(s.out, token, running, stop, max_new_tokens, logits), s.row_keys,
                       s.forwards + 1)
