"""The KV cache: a pytree with static capacity and per-row valid lengths, its rows either
contiguous per batch row or paged (blocks of a shared pool, found through block tables)."""

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

    Paged (`tables` not None: `init_paged_cache`): k, v are one pool [blocks, kv_heads,
    block_size, head_dim] per layer shared by every row, and row b's position p lives in
    block tables[b, p // block_size] ([B, W] int32; an entry outside the pool: no block,
    writes there are dropped) at p % block_size. Rows then hold only the blocks they use.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    tables: jax.Array | None = None

    @property
    def capacity(self) -> int:
        """Positions a row may hold."""
        if self.tables is None:
            return self.k[0].shape[2]
        return self.tables.shape[1] * self.k[0].shape[2]


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


def init_paged_cache(num_layers: int, batch: int, blocks: int, block_size: int,
                     table_width: int, num_kv_heads: int, head_dim: int, dtype: jnp.dtype,
                     heads_axis: str | None = "kv_heads") -> KVCache:
    """An empty paged cache: pools of `blocks` blocks of `block_size` positions, `batch` rows
    of `table_width` table entries, none pointing at a block yet. Traced over a device mesh,
    the pools' heads are split along `heads_axis` (None: every device holds all heads) and
    every device holds every block's rows of its heads; tables and lengths are replicated
    (any row may use any block)."""
    shape = (blocks, num_kv_heads, block_size, head_dim)
    axes = ("kv_blocks", heads_axis, "cache_seq", "head_dim")
    pools = tuple(constrain(jnp.zeros(shape, dtype), axes) for _ in range(2 * num_layers))
    return KVCache(pools[:num_layers], pools[num_layers:],
                   constrain(jnp.zeros((batch,), jnp.int32), (None,)),
                   constrain(jnp.full((batch, table_width), blocks, jnp.int32), (None, None)))


def paged_slots(tables: jax.Array, positions: jax.Array, blocks: int, block_size: int
                ) -> tuple[jax.Array, jax.Array]:
    """The pool block and offset of each of positions [B,T] of the rows of `tables` ([B,W]);
    positions past the table or in entries without a block get block `blocks` (out of the
    pool: a write there is dropped)."""
    entry = positions // block_size
    block = jnp.take_along_axis(tables, jnp.clip(entry, 0, tables.shape[1] - 1), axis=1)
    inside = (entry < tables.shape[1]) & (block >= 0) & (block < blocks)
    return jnp.where(inside, block, blocks), positions % block_size


@jax.jit
def write_paged(pool: jax.Array, new: jax.Array, start: jax.Array, tables: jax.Array
                ) -> jax.Array:
    """Write new [B,T,kv,D] into pool [blocks,kv,block_size,D] at positions start[b] ..
    start[b]+T-1 of the rows of tables [B,W] (positions without a block are dropped)."""
    positions = start[:, None] + jnp.arange(new.shape[1])[None, :]
    block, offset = paged_slots(tables, positions, pool.shape[0], pool.shape[2])
    return pool.at[block, :, offset].set(new.astype(pool.dtype), mode="drop")


def gather_rows(pool: jax.Array, tables: jax.Array) -> jax.Array:
    """The contiguous cache [B,kv,W*block_size,D] of the rows of tables [B,W] (entries
    without a block read an arbitrary block: past a row's length, never valid)."""
    blocks = pool[jnp.clip(tables, 0, pool.shape[0] - 1)]  # [B,W,kv,bs,D]
    batch, width, kv, size, dim = blocks.shape
    return jnp.swapaxes(blocks, 1, 2).reshape(batch, kv, width * size, dim)


def put_rows(cache: KVCache, rows: KVCache, start: jax.Array | int) -> KVCache:
    """Paged `cache` with its batch rows from `start` replaced by `rows`: contiguous rows of
    the cache's capacity (a prefill's) are written into the blocks the tables give those rows
    (entries without a block drop theirs); a paged part of this cache (its first rows, after
    a loop ran them) brings the pools and its lengths."""
    lengths = jax.lax.dynamic_update_slice_in_dim(cache.lengths, rows.lengths, start, axis=0)
    if rows.tables is not None:
        return KVCache(rows.k, rows.v, lengths, cache.tables)
    tables = jax.lax.dynamic_slice_in_dim(cache.tables, start, rows.lengths.shape[0], axis=0)

    def scatter(pool: jax.Array, new: jax.Array) -> jax.Array:
        n, kv, _, dim = new.shape
        blocks = jnp.swapaxes(new.reshape(n, kv, tables.shape[1], pool.shape[2], dim), 1, 2)
        return pool.at[tables].set(blocks.astype(pool.dtype), mode="drop")

    return KVCache(tuple(map(scatter, cache.k, rows.k)), tuple(map(scatter, cache.v, rows.v)),
                   lengths, cache.tables)


def first_rows(cache: KVCache, rows: int) -> KVCache:
    """A paged cache's first `rows` rows (the pools shared)."""
    return cache._replace(lengths=cache.lengths[:rows], tables=cache.tables[:rows])


def row_buffer(buffer: jax.Array, slot: jax.Array, tables: jax.Array | None) -> jax.Array:
    """Row `slot` of a cache buffer, contiguous: [kv, capacity, D] (a paged pool's through
    its tables)."""
    if tables is None:
        return buffer[slot]
    return gather_rows(buffer, jax.lax.dynamic_slice_in_dim(tables, slot, 1, axis=0))[0]


def stage(buffer: jax.Array, new: jax.Array, start: jax.Array,
          tables: jax.Array | None = None) -> jax.Array:
    """`write_block`, or `write_paged` through `tables` for a paged cache's pool."""
    return write_block(buffer, new, start) if tables is None else write_paged(
        buffer, new, start, tables)


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
    k = tuple(stage(buf, new, cache.lengths, cache.tables) for buf, new in zip(cache.k, k_new))
    v = tuple(stage(buf, new, cache.lengths, cache.tables) for buf, new in zip(cache.v, v_new))
    return KVCache(k, v, (cache.lengths + n_valid).astype(jnp.int32), cache.tables)


def write_rows(cache: KVCache, k_new: tuple[jax.Array, ...], v_new: tuple[jax.Array, ...],
               picks: jax.Array) -> KVCache:
    """Write rows picks[b, p] of the new K/V (per layer [B,N,kv,D]) into slots
    lengths[b] + p of every layer (slots past the capacity are dropped; lengths unchanged):
    on CPU one native call for all layers, in place (`eaglejax.native.cache_rows`)."""
    buffers, rows = cache.k + cache.v, tuple(k_new) + tuple(v_new)

    def reference(picks: jax.Array, lengths: jax.Array, tables: jax.Array | None,
                  buffers: tuple[jax.Array, ...], rows: tuple[jax.Array, ...]
                  ) -> tuple[jax.Array, ...]:
        pick = lambda new: jnp.take_along_axis(new, picks[:, :, None, None], axis=1)  # noqa: E731
        return tuple(stage(buf, pick(new), lengths, tables) for buf, new in zip(buffers, rows))

    if not cache_rows.applies(buffers, rows):
        written = reference(picks, cache.lengths, cache.tables, buffers, rows)
    elif cache.tables is None:
        written = cache_rows.write(buffers, rows, picks, cache.lengths,
                                   lambda p, n, b, r: reference(p, n, None, b, r))
    else:
        written = cache_rows.write_paged(buffers, rows, picks, cache.lengths, cache.tables,
                                         reference)
    layers = len(cache.k)
    return KVCache(tuple(written[:layers]), tuple(written[layers:]), cache.lengths,
                   cache.tables)
