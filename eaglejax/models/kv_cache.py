"""The KV cache: a pytree with static capacity and per-row valid lengths."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.native import cache_rows
from eaglejax.sharding.rules import constrain


class KVCache(NamedTuple):
    """k, v: one [batch, kv_heads, capacity, head_dim] array per layer; lengths: [batch] int32.

    Separate per-layer buffers let XLA update each in place and read it without copies;
    the head-major layout makes every head's keys one contiguous block for the attention
    matmuls (no transposed copy of the cache on CPU) and for kernel block loads.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @staticmethod
    def logical_axes(num_layers: int) -> "KVCache":
        kv = (("batch", "kv_heads", "cache_seq", "head_dim"),) * num_layers
        return KVCache(k=kv, v=kv, lengths=("batch",))


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
               dtype: jnp.dtype, heads_axis: str | None = "kv_heads") -> KVCache:
    """An empty cache (all lengths 0). Traced over a device mesh, rows are split along
    "batch" and heads along `heads_axis` (None: every device holds all heads, as for the
    replicated draft head); see `eaglejax.sharding.rules`."""
    shape = (batch, num_kv_heads, capacity, head_dim)
    axes = ("batch", heads_axis, "cache_seq", "head_dim")

    def zeros() -> jax.Array:
        return constrain(jnp.zeros(shape, dtype), axes)

    return KVCache(tuple(zeros() for _ in range(num_layers)),
                   tuple(zeros() for _ in range(num_layers)),
                   constrain(jnp.zeros((batch,), jnp.int32), ("batch",)))


@jax.jit  # traced once per shape: every layer of a cache shares it
def write_block(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B,T,kv,D] into buffer [B',kv,S,D] at slots start[b] .. start[b]+T-1
    (slots past the capacity are dropped); a buffer of more rows (B' > B: a serving batch's
    slots, of which the first B run) keeps its other rows.

    One scatter whose heads and head dims are whole windows: XLA:CPU updates the buffer in
    place, and over a mesh each device writes its own rows and heads (with the heads as an
    index array, the partitioner gathered every head's new rows onto every device)."""
    t_new = new.shape[1]
    extra = buffer.shape[0] - new.shape[0]
    if extra:  # the other rows write past the capacity: dropped
        new = jnp.pad(new, [(0, extra)] + [(0, 0)] * (new.ndim - 1))
        start = jnp.pad(start, (0, extra), constant_values=buffer.shape[2])

    def one_row(buf: jax.Array, rows: jax.Array, first: jax.Array) -> jax.Array:
        slots = first + jnp.arange(t_new)
        return buf.at[:, slots].set(jnp.swapaxes(rows, 0, 1).astype(buf.dtype), mode="drop")

    return jax.vmap(one_row)(buffer, new, start)


def append(cache: KVCache, k_new: tuple[jax.Array, ...], v_new: tuple[jax.Array, ...],
           n_valid: jax.Array) -> KVCache:
    """Write the T new rows (per layer [B,T,kv,D]) after each row's valid prefix and advance
    each row's length by n_valid [B]."""
    k = tuple(write_block(buf, new, cache.lengths) for buf, new in zip(cache.k, k_new))
    v = tuple(write_block(buf, new, cache.lengths) for buf, new in zip(cache.v, v_new))
    return KVCache(k, v, (cache.lengths + n_valid).astype(jnp.int32))


def write_rows(cache: KVCache, k_new: tuple[jax.Array, ...], v_new: tuple[jax.Array, ...],
               picks: jax.Array) -> KVCache:
    """Write rows picks[b, p] of the new K/V (per layer [B,N,kv,D]) into slots
    lengths[b] + p of every layer (slots past the capacity are dropped; lengths unchanged):
    on CPU one native call for all layers, in place (`eaglejax.native.cache_rows`)."""
    buffers, rows = cache.k + cache.v, tuple(k_new) + tuple(v_new)

    def reference(picks: jax.Array, lengths: jax.Array, buffers: tuple[jax.Array, ...],
                  rows: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        pick = lambda new: jnp.take_along_axis(new, picks[:, :, None, None], axis=1)  # noqa: E731
        return tuple(write_block(buf, pick(new), lengths) for buf, new in zip(buffers, rows))

    if cache_rows.applies(buffers, rows):
        written = cache_rows.write(buffers, rows, picks, cache.lengths, reference)
    else:
        written = reference(picks, cache.lengths, buffers, rows)
    layers = len(cache.k)
    return KVCache(tuple(written[:layers]), tuple(written[layers:]), cache.lengths)
