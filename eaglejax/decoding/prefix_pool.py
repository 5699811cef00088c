"""The device half of the serving engine's prefix cache (`serving.prefix_cache`): a pool of
KV blocks, `BLOCK` consecutive positions of one sequence each (all layers' keys and values),
copied out of a slot's cache and back into a prefilling row."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from eaglejax.models import kv_cache
from eaglejax.models.placement import committed

BLOCK = 32  # positions per block


class PrefixPool(NamedTuple):
    """Cached rows on the device: k, v one [blocks, kv_heads, BLOCK, head_dim] array per
    layer."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def empty_pool(cache: kv_cache.KVCache, blocks: int) -> PrefixPool:
    """A pool of `blocks` blocks for the rows of caches like `cache` (its layers, heads,
    head dim and dtype), committed to its device (`placement.committed`: the pool the
    saves return is). A cache on a mesh gets a pool on it: KV heads split as the cache's,
    blocks whole on every device (a slot on any data-parallel shard reads any)."""
    _, kv, _, dim = cache.k[0].shape
    shape = (blocks, kv, BLOCK, dim)

    def zeros(like: jax.Array) -> jax.Array:
        sharding = like.sharding
        if not isinstance(sharding, NamedSharding):
            return jnp.zeros(shape, like.dtype)
        spec = PartitionSpec(None, *tuple(sharding.spec)[1:])
        return jax.jit(lambda: jnp.zeros(shape, like.dtype),
                       out_shardings=NamedSharding(sharding.mesh, spec))()

    return committed(PrefixPool(tuple(map(zeros, cache.k)), tuple(map(zeros, cache.v))))


def load_rows(pool: PrefixPool, blocks: jax.Array, cached: jax.Array, capacity: int
              ) -> kv_cache.KVCache:
    """A one-row cache of `capacity` slots (n * BLOCK >= capacity) holding pool `blocks`
    [n] in order, valid through `cached` [1] rows (the rest hold whatever the blocks do)."""
    def rows(buffers: jax.Array) -> jax.Array:
        return kv_cache.gather_rows(buffers, blocks[None])[:, :, :capacity]

    return kv_cache.KVCache(tuple(map(rows, pool.k)), tuple(map(rows, pool.v)),
                            cached.astype(jnp.int32))


@functools.partial(jax.jit, donate_argnames=("pool",))
def save_blocks(pool: PrefixPool, cache: kv_cache.KVCache, slot: jax.Array,
                sources: jax.Array, targets: jax.Array) -> PrefixPool:
    """Copy blocks sources [n] of `slot`'s rows in `cache` into pool blocks targets [n]
    (targets past the pool: not written)."""
    def save(buffer: jax.Array, rows: jax.Array) -> jax.Array:
        row = kv_cache.row_buffer(rows, slot, cache.tables)  # [kv, capacity, D]
        kv, capacity, dim = row.shape
        blocks = jnp.swapaxes(row.reshape(kv, capacity // BLOCK, BLOCK, dim), 0, 1)
        return buffer.at[targets].set(blocks[sources].astype(buffer.dtype), mode="drop")

    return PrefixPool(tuple(map(save, pool.k, cache.k)), tuple(map(save, pool.v, cache.v)))
