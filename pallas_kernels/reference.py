"""XLA reference for tree attention: the CPU path and the oracle for the Pallas kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
) -> jax.Array:
    """Attention of new queries over a per-row cached prefix plus the masked new tokens.

    q [B,T,Hq,D]; k_cache/v_cache [B,S,Hkv,D]; cache_lengths [B] int32;
    k_new/v_new [B,T,Hkv,D]; mask [B,T,T] bool. Query t of row b attends to cache
    positions < cache_lengths[b] and to new position j iff mask[b,t,j].
    Returns [B,T,Hq,D] in q's dtype; softmax is computed in float32.
    """
    batch, t_new, n_q_heads, head_dim = q.shape
    s_cache, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    qg = q.reshape(batch, t_new, n_kv_heads, group, head_dim)
    keys = jnp.concatenate([k_cache, k_new.astype(k_cache.dtype)], axis=1)
    values = jnp.concatenate([v_cache, v_new.astype(v_cache.dtype)], axis=1)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32) * scale
    cache_visible = jnp.arange(s_cache)[None, None, :] < cache_lengths[:, None, None]
    visible = jnp.concatenate(
        [jnp.broadcast_to(cache_visible, (batch, t_new, s_cache)), mask.astype(bool)], axis=2
    )
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    # A query that sees nothing gets zeros rather than NaN.
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(values.dtype), values,
                     preferred_element_type=jnp.float32)
    return out.reshape(batch, t_new, n_q_heads, head_dim).astype(q.dtype)
