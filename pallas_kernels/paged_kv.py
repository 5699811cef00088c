"""The paged KV cache's layout, and writing new tokens' K/V into it through a block table.

Layout, per layer (one pool for K, one for V):

- ``k_pool``, ``v_pool`` ``[num_blocks, block_size, kv_heads, head_dim]``: token-major
  blocks (``block_size`` 16 or 32). One token's K for every KV head is one contiguous
  ``kv_heads * head_dim`` row, so writing a verify block is T contiguous row writes, and
  a block is a dense ``[block_size, kv_heads * head_dim]`` tile: the TPU kernel views the
  pool as ``[num_blocks, block_size, kv_heads * head_dim]`` (a free reshape) and copies a
  page's heads with one DMA whose lane dim is a multiple of 128; the GPU kernel reads one
  head's page as ``block_size`` rows of ``head_dim`` contiguous values. Splitting heads over a
  mesh (``tp``) splits axis 2 and keeps every page whole on each device.
- or head-major ``[num_blocks, kv_heads, block_size, head_dim]`` (``pool_layout=
  "head_major"``, the serving engine's pools, `eaglejax.models.kv_cache`): a head's page is
  one contiguous ``[block_size, head_dim]`` tile; the TPU kernel copies a page's heads as one
  ``[hb, block_size, head_dim]`` DMA. :func:`write_paged_kv` writes token-major pools (the
  engine writes its own with `eaglejax.models.kv_cache.write_paged`).
- ``block_tables`` ``[rows, max_blocks]`` int32: row b's position p lives in block
  ``block_tables[b, p // block_size]``, slot ``p % block_size``.
- ``context_lengths`` ``[rows]`` int32: the tokens cached before the verify block.

A round writes the verify block first (:func:`write_paged_kv` at ``context_lengths``, the
table already covering ``ctx + T`` positions), then attends
(:func:`pallas_kernels.paged_attention`): the block's own K/V are read from the pool. Table
entries past ``ceil((ctx + T) / block_size)`` are never read, nor are slots at or past
``ctx + T`` in the last used block, so they may hold anything.

Rollback is a length change: after verification the row's length becomes ``ctx + accepted``
and whatever was written past it is never read again; the next write overwrites it. A chain's
accepted tokens are already in place. A tree's accepted path (nodes ``picks[b, :accepted]`` of
the verify forward's K/V, which the caller still holds) is written again at ``ctx``:
``write_paged_kv(..., context_lengths, take(k_new, picks), take(v_new, picks),
n_valid=accepted)``. Blocks wholly past the new length go back to the allocator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit  # traced once per shape: every layer's pools share it
def write_paged_kv(
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    start: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    n_valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Write k_new/v_new [B,T,Hkv,D] at positions start[b] .. start[b]+T-1 of each row.

    k_pool/v_pool [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int32;
    start [B] int32; n_valid [B] int32 (optional): only the first n_valid[b] tokens of row b
    are written. Tokens past ``n_valid`` or past the table (``max_blocks * block_size``) are
    dropped: no other block is touched. One scatter per pool (in place where XLA can
    update the pools, as when a caller's jit donates them).
    """
    t_new = k_new.shape[1]
    num_blocks, block_size = k_pool.shape[:2]
    pos = start.astype(jnp.int32)[:, None] + jnp.arange(t_new, dtype=jnp.int32)  # [B, T]
    entry = pos // block_size
    in_table = entry < block_tables.shape[1]
    keep = in_table if n_valid is None else in_table & (jnp.arange(t_new) < n_valid[:, None])
    page = jnp.take_along_axis(block_tables.astype(jnp.int32),
                               jnp.where(in_table, entry, 0), axis=1)
    page = jnp.where(keep, page, num_blocks)  # out of bounds: dropped
    slot = pos % block_size

    def write(pool: jax.Array, new: jax.Array) -> jax.Array:
        return pool.at[page, slot].set(new.astype(pool.dtype), mode="drop")

    return write(k_pool, k_new), write(v_pool, v_new)
