"""XLA references for tree attention and paged attention: CPU paths and the kernels' oracles."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_pool_layout, pool_dims

KVLayout = Literal["bshd", "bhsd"]
PoolLayout = Literal["token_major", "head_major"]


def tree_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    kv_layout: KVLayout = "bshd",
    cache_mask: jax.Array | None = None,
) -> jax.Array:
    """Attention of new queries over a per-row cached prefix plus the masked new tokens.

    q [B,T,Hq,D]; k_cache/v_cache [B,S,Hkv,D] (or [B,Hkv,S,D] with kv_layout="bhsd");
    cache_lengths [B] int32; k_new/v_new [B,T,Hkv,D]; mask [B,T,T] bool. Query t of row b
    attends to cache positions < cache_lengths[b] (and, given `cache_mask` [B,T,S] bool,
    where cache_mask[b,t] allows) and to new position j iff mask[b,t,j].
    Returns [B,T,Hq,D] in q's dtype; everything is computed in float32, the softmax over both parts
    jointly, without concatenating the cache and the new keys (no cache copy).
    """
    if kv_layout not in ("bshd", "bhsd"):
        raise ValueError(f"kv_layout must be 'bshd' or 'bhsd', got {kv_layout!r}")
    batch, t_new, n_q_heads, head_dim = q.shape
    n_kv_heads = k_new.shape[2]
    s_cache = k_cache.shape[1] if kv_layout == "bshd" else k_cache.shape[2]
    cache_dims = "bskd" if kv_layout == "bshd" else "bksd"
    group = n_q_heads // n_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    f32 = jnp.float32
    # Everything in float32: the oracle's accuracy comes first, and XLA:CPU cannot run some
    # bfloat16 x bfloat16 -> float32 dots. A no-op for float32 inputs.
    out_dtype = q.dtype
    q, k_cache, v_cache, k_new, v_new = (x.astype(f32) for x in (q, k_cache, v_cache, k_new, v_new))
    # Queries of one KV head side by side: [B, Hkv, T*G, D] with (t, g) flattened t-major.
    queries = jnp.swapaxes(q.reshape(batch, t_new, n_kv_heads, group, head_dim), 1, 2)
    queries = queries.reshape(batch, n_kv_heads, t_new * group, head_dim)
    # Scores are laid out [B, Hkv, keys, queries] so the keys are the matmul's left operand
    # in their stored layout (no transposed copy of the cache).
    scores_cache = jnp.einsum(f"{cache_dims},bkqd->bksq", k_cache, queries) * scale
    scores_new = jnp.einsum("bskd,bkqd->bksq", k_new, queries) * scale
    cache_visible = (jnp.arange(s_cache)[None, :] < cache_lengths[:, None])[..., None]
    if cache_mask is not None:  # [B,S,T*G], as the scores lay the queries out
        cache_visible = cache_visible & jnp.repeat(jnp.swapaxes(cache_mask.astype(bool), 1, 2),
                                                   group, axis=2)
    scores_cache = jnp.where(cache_visible[:, None], scores_cache, -jnp.inf)
    new_visible = jnp.repeat(jnp.swapaxes(mask.astype(bool), 1, 2), group, axis=2)  # [B,key,T*G]
    scores_new = jnp.where(new_visible[:, None], scores_new, -jnp.inf)

    row_max = jnp.maximum(jnp.max(scores_cache, axis=2, keepdims=True, initial=-jnp.inf),
                          jnp.max(scores_new, axis=2, keepdims=True, initial=-jnp.inf))
    # A query that sees nothing gets zeros rather than NaN.
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights_cache = jnp.exp(scores_cache - row_max)
    weights_new = jnp.exp(scores_new - row_max)
    denom = jnp.sum(weights_cache, axis=2) + jnp.sum(weights_new, axis=2)  # [B,Hkv,T*G]
    out = (jnp.einsum(f"bksq,{cache_dims}->bkqd", weights_cache, v_cache)
           + jnp.einsum("bksq,bskd->bkqd", weights_new, v_new))
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    out = jnp.swapaxes(out.reshape(batch, n_kv_heads, t_new, group, head_dim), 1, 2)
    return out.reshape(batch, t_new, n_q_heads, head_dim).astype(out_dtype)


def paged_attention_reference(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    context_lengths: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    pool_layout: PoolLayout = "token_major",
) -> jax.Array:
    """Attention of a verify block over a paged KV cache (layout: `pallas_kernels.paged_kv`).

    q [B,T,Hq,D]; k_pool/v_pool [num_blocks, block_size, Hkv, D] (pool_layout="token_major")
    or [num_blocks, Hkv, block_size, D] ("head_major"); block_tables [B, max_blocks] int32
    (entries outside the pool read a clamped block); context_lengths [B] int32; mask [B,T,T]
    bool. Row b's position p lives in block block_tables[b, p // block_size], slot
    p % block_size; the T new tokens' own K/V are
    already in the pool at positions ctx .. ctx+T-1 (ctx = context_lengths[b]). Query t sees
    every position < ctx and position ctx + j iff mask[b,t,j]; nothing at or past ctx + T is
    read as valid (stale slots and unused table entries may hold anything, even NaN).
    Returns [B,T,Hq,D] in q's dtype, computed in float32 over a gathered copy of every
    table entry's block (the oracle and the CPU path; the kernels read only used blocks).
    """
    check_pool_layout(pool_layout)
    batch, t_new, n_q_heads, head_dim = q.shape
    num_blocks, block_size, n_kv_heads = pool_dims(k_pool.shape, pool_layout)
    span = block_tables.shape[1] * block_size
    group = n_q_heads // n_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    f32 = jnp.float32
    pages = jnp.clip(block_tables.astype(jnp.int32), 0, num_blocks - 1)  # no block: any block
    ctx = context_lengths.astype(jnp.int32)
    rel = jnp.arange(span)[None, :] - ctx[:, None]  # [B, span]: position - ctx
    valid = rel < t_new

    def gather(pool: jax.Array) -> jax.Array:  # [B, span, Hkv, D], zero at and past ctx + T
        blocks = pool[pages] if pool_layout == "token_major" else jnp.swapaxes(pool[pages], 2, 3)
        rows = blocks.reshape(batch, span, n_kv_heads, head_dim).astype(f32)
        return jnp.where(valid[:, :, None, None], rows, 0.0)

    keys, values = gather(k_pool), gather(v_pool)
    index = jnp.broadcast_to(jnp.clip(rel, 0, t_new - 1)[:, None, :], (batch, t_new, span))
    in_tree = jnp.take_along_axis(mask.astype(bool), index, axis=2)  # [B, T, span]
    visible = (rel < 0)[:, None, :] | (valid & (rel >= 0))[:, None, :] & in_tree
    visible = jnp.repeat(visible, group, axis=1)  # [B, T*G, span], token-major rows

    queries = jnp.swapaxes(q.astype(f32).reshape(batch, t_new, n_kv_heads, group, head_dim), 1, 2)
    queries = queries.reshape(batch, n_kv_heads, t_new * group, head_dim)
    scores = jnp.einsum("bskd,bkqd->bkqs", keys, queries) * scale
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("bkqs,bskd->bkqd", weights, values) / jnp.where(denom > 0, denom, 1.0)
    out = jnp.swapaxes(out.reshape(batch, n_kv_heads, t_new, group, head_dim), 1, 2)
    return out.reshape(batch, t_new, n_q_heads, head_dim).astype(q.dtype)
