"""The KV cache: a pytree with static capacity and per-row valid lengths."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """k, v: one [batch, capacity, kv_heads, head_dim] array per layer; lengths: [batch] int32.

    Separate per-layer buffers let XLA update each in place and read it without copies.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @staticmethod
    def logical_axes(num_layers: int) -> "KVCache":
        kv = (("batch", "cache_seq", "kv_heads", "head_dim"),) * num_layers
        return KVCache(k=kv, v=kv, lengths=("batch",))


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
               dtype: jnp.dtype) -> KVCache:
    """An empty cache (all lengths 0)."""
    shape = (batch, capacity, num_kv_heads, head_dim)
    layers = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    return KVCache(layers, tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   jnp.zeros((batch,), jnp.int32))


def write_rows(cache: KVCache, k_new: tuple[jax.Array, ...], v_new: tuple[jax.Array, ...],
               rows: jax.Array, new_lengths: jax.Array) -> KVCache:
    """Write new K/V (per layer [B,T,kv,D]) into cache slots `lengths + j` for the row
    indices rows [B,N] (taking new[b, rows[b, j]]), then set lengths to new_lengths [B].

    Slots past `capacity` are dropped; rows beyond a row's accepted count may hold
    anything since lengths mark what is valid.
    """
    n_rows = rows.shape[1]
    batch_idx = jnp.arange(rows.shape[0])[:, None]
    slots = cache.lengths[:, None] + jnp.arange(n_rows)[None, :]

    def put(buffer: jax.Array, new: jax.Array) -> jax.Array:
        return buffer.at[batch_idx, slots].set(new[batch_idx, rows].astype(buffer.dtype),
                                               mode="drop")

    return KVCache(tuple(map(put, cache.k, k_new)), tuple(map(put, cache.v, v_new)),
                   new_lengths.astype(jnp.int32))


def append(cache: KVCache, k_new: tuple[jax.Array, ...], v_new: tuple[jax.Array, ...],
           n_valid: jax.Array) -> KVCache:
    """Append all T new rows per batch row, advancing each row's length by n_valid [B]."""
    batch, t_new = k_new[0].shape[:2]
    rows = jnp.broadcast_to(jnp.arange(t_new)[None, :], (batch, t_new))
    return write_rows(cache, k_new, v_new, rows, cache.lengths + n_valid)
