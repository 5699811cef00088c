"""The KV cache: a pytree with static capacity and per-row valid lengths."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """k, v: [layers, batch, capacity, kv_heads, head_dim]; lengths: [batch] int32 valid rows."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def logical_axes() -> "KVCache":
        kv = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
        return KVCache(k=kv, v=kv, lengths=("batch",))


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
               dtype: jnp.dtype) -> KVCache:
    """An empty cache (all lengths 0)."""
    shape = (num_layers, batch, capacity, num_kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def write_rows(cache: KVCache, k_new: jax.Array, v_new: jax.Array, rows: jax.Array,
               new_lengths: jax.Array) -> KVCache:
    """Write new K/V [L,B,T,kv,D] into cache slots `lengths + j` for the row indices
    rows [B,N] (taking k_new[:, b, rows[b, j]]), then set lengths to new_lengths [B].

    Slots past `capacity` are dropped; rows beyond a row's accepted count may hold
    anything since lengths mark what is valid.
    """
    n_rows = rows.shape[1]
    batch_idx = jnp.arange(k_new.shape[1])[:, None]
    slots = cache.lengths[:, None] + jnp.arange(n_rows)[None, :]
    k_sel = k_new[:, batch_idx, rows]  # [L,B,N,kv,D]
    v_sel = v_new[:, batch_idx, rows]
    k = cache.k.at[:, batch_idx, slots].set(k_sel.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[:, batch_idx, slots].set(v_sel.astype(cache.v.dtype), mode="drop")
    return KVCache(k, v, new_lengths.astype(jnp.int32))


def append(cache: KVCache, k_new: jax.Array, v_new: jax.Array, n_valid: jax.Array) -> KVCache:
    """Append all T new rows per batch row, advancing each row's length by n_valid [B]."""
    t_new = k_new.shape[2]
    rows = jnp.broadcast_to(jnp.arange(t_new)[None, :], (k_new.shape[1], t_new))
    return write_rows(cache, k_new, v_new, rows, cache.lengths + n_valid)
