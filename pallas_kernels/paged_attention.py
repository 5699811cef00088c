"""Public entry point for paged attention: the Pallas GPU (Triton) or TPU (Mosaic) kernel.

The cache layout, writing into it and rollback: :mod:`pallas_kernels.paged_kv`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_pool_layout, pool_dims, resolve_backend
from pallas_kernels._paged_attention_gpu import paged_attention_gpu
from pallas_kernels._paged_attention_tpu import paged_attention_tpu
from pallas_kernels.reference import PoolLayout


def _check_shapes(q, k_pool, v_pool, block_tables, context_lengths, mask, pool_layout) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    batch, t_new, n_q_heads, head_dim = q.shape
    want = ("[num_blocks, block_size, Hkv, D]" if pool_layout == "token_major"
            else "[num_blocks, Hkv, block_size, D]")
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool/v_pool must both be {want} (pool_layout={pool_layout!r}), "
                         f"got {k_pool.shape} and {v_pool.shape}")
    _, block_size, n_kv_heads = pool_dims(k_pool.shape, pool_layout)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size} "
                         f"(k_pool {want} = {k_pool.shape})")
    if k_pool.shape[3] != head_dim:
        raise ValueError(f"k_pool {k_pool.shape} does not match q {q.shape} in D")
    if n_kv_heads < 1 or n_q_heads % n_kv_heads:
        raise ValueError(f"Hq={n_q_heads} is not a multiple of Hkv={n_kv_heads} "
                         f"(k_pool {want} = {k_pool.shape})")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, max_blocks], got {block_tables.shape}")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"block_tables must be integers, got {block_tables.dtype}")
    if block_tables.shape[1] * block_size < t_new:
        raise ValueError(f"block tables of {block_tables.shape[1]} blocks of {block_size} "
                         f"cannot hold the T={t_new} new tokens")
    if context_lengths.shape != (batch,):
        raise ValueError(f"context_lengths must be [B]={batch}, got {context_lengths.shape}")
    if mask.shape != (batch, t_new, t_new):
        raise ValueError(f"mask must be [B, T, T]={(batch, t_new, t_new)}, got {mask.shape}")


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "backend", "num_splits", "pages_per_step",
                     "pool_layout"),
)
def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    context_lengths: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool = False,
    backend: str | None = None,
    num_splits: int | None = None,
    pages_per_step: int | None = None,
    pool_layout: PoolLayout = "token_major",
) -> jax.Array:
    """Pallas paged attention; same contract as :func:`paged_attention_reference`.

    q [B,T,Hq,D]; k_pool/v_pool [num_blocks, block_size, Hkv, D] (pool_layout="token_major",
    the default) or [num_blocks, Hkv, block_size, D] ("head_major"), block_size a power of
    two >= 16; block_tables [B, max_blocks] int32; context_lengths [B] int32, the tokens
    cached before the verify block; mask [B,T,T] bool. The T new tokens' K/V must already be
    in the pool at positions ctx .. ctx+T-1 (`pallas_kernels.write_paged_kv`); query t sees
    every position < ctx and position ctx + j iff mask[b,t,j] (a query that sees nothing
    returns zeros). Only the table entries covering positions < ctx + T are read; an entry
    outside [0, num_blocks) (no block) reads a clamped block, so such a row's output is
    meaningless but touches nothing else. ctx is clipped to max_blocks * block_size - T.
    Returns [B,T,Hq,D] in q's dtype, softmax accumulated in float32.

    backend: "gpu" (Pallas Triton), "tpu" (Pallas Mosaic) or None for jax.default_backend().
    interpret: run the chosen kernel in Pallas interpret mode (any platform, e.g. CPU tests).
    num_splits: GPU only, flash-decoding splits of the context pages (None: from the grid).
    pages_per_step: TPU only, pages copied per double-buffered step (None: 256 keys' worth).
    pool_layout: static; both layouts are read in place by the kernels (the pool is never
        transposed or copied).
    """
    check_pool_layout(pool_layout)
    _check_shapes(q, k_pool, v_pool, block_tables, context_lengths, mask, pool_layout)
    kind = resolve_backend(backend, interpret, "paged_attention")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    num_blocks, block_size, _ = pool_dims(k_pool.shape, pool_layout)
    span = block_tables.shape[1] * block_size
    lengths = jnp.clip(context_lengths.astype(jnp.int32), 0, span - q.shape[1])
    tables = jnp.clip(block_tables.astype(jnp.int32), 0, num_blocks - 1)
    args = (q, k_pool, v_pool, tables, lengths, mask)
    if kind == "tpu":
        return paged_attention_tpu(*args, scale=scale, interpret=interpret,
                                   pages_per_step=pages_per_step, pool_layout=pool_layout)
    return paged_attention_gpu(*args, scale=scale, interpret=interpret, num_splits=num_splits,
                               pool_layout=pool_layout)
