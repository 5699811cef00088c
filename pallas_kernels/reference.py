"""XLA reference for tree attention: the CPU path and the oracle for the Pallas kernels."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

KVLayout = Literal["bshd", "bhsd"]


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
) -> jax.Array:
    """Attention of new queries over a per-row cached prefix plus the masked new tokens.

    q [B,T,Hq,D]; k_cache/v_cache [B,S,Hkv,D] (or [B,Hkv,S,D] with kv_layout="bhsd");
    cache_lengths [B] int32; k_new/v_new [B,T,Hkv,D]; mask [B,T,T] bool. Query t of row b
    attends to cache positions < cache_lengths[b] and to new position j iff mask[b,t,j].
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
    cache_visible = jnp.arange(s_cache)[None, :] < cache_lengths[:, None]
    scores_cache = jnp.where(cache_visible[:, None, :, None], scores_cache, -jnp.inf)
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
