"""Plain (non-speculative) decoding: a jitted prefill and a jitted `lax.while_loop` decode.

The host starts the loop and collects the result; no token ever makes a host round trip.
Rows are right-padded with per-row lengths, so padding never changes any row's tokens.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.config import ModelConfig
from eaglejax.decoding.sampling import SamplingParams, sample_tokens
from eaglejax.decoding.stopping import FINISH_NONE, StopCriteria, update_finish
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import Params, forward, lm_head


class DecodeState(NamedTuple):
    """Everything the loop carries. tokens [B,N] hold the generated ids, counts [B] how many."""

    cache: kv_cache.KVCache
    last_token: jax.Array  # [B] the newest token, already recorded, not yet in the cache
    tokens: jax.Array  # [B,N] int32
    counts: jax.Array  # [B] int32
    finish: jax.Array  # [B] int32 finish code (FINISH_NONE while running)
    row_keys: jax.Array  # [B] PRNG keys, one per row
    forwards: jax.Array  # int32 scalar: target forwards run by the loop


def _row_step_keys(row_keys: jax.Array, counts: jax.Array) -> jax.Array:
    """A row's key for its n-th token depends only on its own seed and n."""
    return jax.vmap(jax.random.fold_in)(row_keys, counts)


def record(state: DecodeState, new_token: jax.Array, stop: StopCriteria,
           max_new_tokens: jax.Array) -> DecodeState:
    """Append new_token [B] to every running row and update finish codes."""
    running = state.finish == FINISH_NONE
    batch_idx = jnp.arange(new_token.shape[0])
    tokens = state.tokens.at[batch_idx, state.counts].set(
        jnp.where(running, new_token, state.tokens[batch_idx, state.counts]), mode="drop")
    counts = state.counts + running.astype(jnp.int32)
    finish = update_finish(state.finish, tokens, counts, new_token, running, stop, max_new_tokens)
    return state._replace(last_token=jnp.where(running, new_token, state.last_token),
                          tokens=tokens, counts=counts, finish=finish)


@functools.partial(jax.jit, static_argnames=("config", "capacity", "max_tokens", "greedy",
                                             "stop", "attn_impl"))
def prefill(params: Params, config: ModelConfig, prompt: jax.Array, prompt_lengths: jax.Array,
            row_keys: jax.Array, sampling: SamplingParams, max_new_tokens: jax.Array, *,
            capacity: int, max_tokens: int, greedy: bool, stop: StopCriteria,
            attn_impl: AttentionImpl = "auto") -> DecodeState:
    """Run the right-padded prompts [B,P], fill the cache and record the first new token."""
    batch, prompt_len = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(prompt_len)[None], (batch, prompt_len))
    out = forward(params, config, prompt, positions, None, attn_impl=attn_impl)
    cache = kv_cache.init_cache(config.num_layers, batch, capacity, config.num_kv_heads,
                                config.head_dim, params["embed"].dtype)
    cache = kv_cache.append(cache, out.k_new, out.v_new, prompt_lengths)
    last_hidden = out.hidden[jnp.arange(batch), prompt_lengths - 1]
    counts = jnp.zeros((batch,), jnp.int32)
    first = sample_tokens(lm_head(params, last_hidden), sampling,
                          _row_step_keys(row_keys, counts), greedy)
    state = DecodeState(cache, first, jnp.zeros((batch, max_tokens), jnp.int32), counts,
                        jnp.full((batch,), FINISH_NONE, jnp.int32), row_keys, jnp.int32(0))
    return record(state, first, stop, max_new_tokens)


@functools.partial(jax.jit, static_argnames=("config", "greedy", "stop", "attn_impl"),
                   donate_argnames=("state",))
def decode_loop(params: Params, config: ModelConfig, state: DecodeState, sampling: SamplingParams,
                max_new_tokens: jax.Array, *, greedy: bool, stop: StopCriteria,
                attn_impl: AttentionImpl = "auto") -> DecodeState:
    """Decode one token per step until every row has finished."""

    def running(s: DecodeState) -> jax.Array:
        return jnp.any(s.finish == FINISH_NONE)

    def step(s: DecodeState) -> DecodeState:
        is_running = s.finish == FINISH_NONE
        positions = s.cache.lengths[:, None]
        out = forward(params, config, s.last_token[:, None], positions, s.cache,
                      attn_impl=attn_impl)
        cache = out.cache._replace(lengths=s.cache.lengths + is_running.astype(jnp.int32))
        token = sample_tokens(lm_head(params, out.hidden[:, 0]), sampling,
                              _row_step_keys(s.row_keys, s.counts), greedy)
        s = s._replace(cache=cache, forwards=s.forwards + 1)
        return record(s, token, stop, max_new_tokens)

    return jax.lax.while_loop(running, step, state)
