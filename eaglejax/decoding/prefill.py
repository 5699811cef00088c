"""Prefilling the target: right-padded prompts into a fresh KV cache, in blocks when long.

Both loops start here (`plain.prefill_state`, `speculative.prefill_state`); the speculative
one also keeps every position's hidden state or taps for the draft head.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.config import ModelConfig
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import Params, compute_dtype, forward, forward_chunked, lm_head
from eaglejax.native import cache_attention

PREFILL_CHUNK = 512  # prompt tokens per prefill block


class Prefilled(NamedTuple):
    """A prefilled prompt batch: the cache (lengths = prompt lengths), the logits at each
    row's last prompt token [B,V], and every position's final-normed hidden state [B,P,H]
    and taps (or None)."""

    cache: kv_cache.KVCache
    logits: jax.Array
    hidden: jax.Array
    taps: jax.Array | None


def prefill_target(params: Params, config: ModelConfig, prompt: jax.Array,
                   prompt_lengths: jax.Array, capacity: int, tap_layers: tuple[int, ...] = (),
                   attn_impl: AttentionImpl = "auto", chunk: int = PREFILL_CHUNK, *,
                   heads_axis: str | None = "kv_heads",
                   cached: kv_cache.KVCache | None = None) -> Prefilled:
    """Run right-padded prompts [B,P] into a fresh cache of `capacity` slots (over a mesh,
    its heads split along `heads_axis`, see `kv_cache.init_cache`), or after the rows of
    `cached` (a cache of `capacity` slots holding each row's earlier tokens, e.g. a prompt
    prefix kept by the serving engine's prefix cache): then `prompt` is what follows them,
    at positions cached.lengths + [0, P), and the lengths returned count both.

    A prompt longer than `chunk` runs `chunk` tokens at a time, each block attending to the
    cache written so far plus itself, so memory grows linearly with P."""
    batch, prompt_len = prompt.shape
    if cached is not None:
        hidden, taps, cache = forward_chunked(params, config, prompt, cached,
                                              chunk=_chunk_after(config, cached, chunk,
                                                                 prompt_len),
                                              tap_layers=tap_layers, attn_impl=attn_impl)
        cache = cache._replace(lengths=cached.lengths + prompt_lengths)
        last_hidden = hidden[jnp.arange(batch), prompt_lengths - 1]
        return Prefilled(cache, lm_head(params, last_hidden), hidden, taps)
    cache = kv_cache.init_cache(config.num_layers, batch, capacity, config.num_kv_heads,
                                config.head_dim, compute_dtype(params), heads_axis)
    if prompt_len <= chunk:
        positions = jnp.broadcast_to(jnp.arange(prompt_len)[None], (batch, prompt_len))
        out = forward(params, config, prompt, positions, None, tap_layers=tap_layers,
                      attn_impl=attn_impl)
        cache = kv_cache.append(cache, out.k_new, out.v_new, prompt_lengths)
        hidden, taps = out.hidden, out.taps
    else:
        hidden, taps, cache = forward_chunked(params, config, prompt, cache, chunk=chunk,
                                              tap_layers=tap_layers, attn_impl=attn_impl)
        cache = cache._replace(lengths=prompt_lengths)
    last_hidden = hidden[jnp.arange(batch), prompt_lengths - 1]
    return Prefilled(cache, lm_head(params, last_hidden), hidden, taps)


def _chunk_after(config: ModelConfig, cached: kv_cache.KVCache, chunk: int, length: int
                 ) -> int:
    """Tokens per block of a prefill after cached rows: where the native CPU kernel attends
    (reading only each row's valid rows, at most `MAX_QUERIES` queries), blocks it takes
    (XLA's attention would read the whole capacity: a 64-token rest after 192 cached rows of
    a 2,176-row SmolLM2 slot took 102 ms in one block, 54 in blocks of 16); else `chunk`."""
    query = jax.ShapeDtypeStruct((1, 1, config.num_heads, config.head_dim), cached.k[0].dtype)
    if cache_attention.applies(query, cached.k[0]):
        if cached.tables is not None and length <= cache_attention.MAX_QUERIES:
            # At least two blocks over a paged slot's pools: in a program whose scan runs
            # once, XLA:CPU copied every layer's pools (60 copies for SmolLM2; a 3-token
            # rest after a prefix hit then took 435 ms, in two blocks ~25 ms).
            return max(length // 2, 1)
        return min(cache_attention.MAX_QUERIES, length)
    return min(chunk, length)
