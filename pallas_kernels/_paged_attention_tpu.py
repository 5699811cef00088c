"""Paged attention as a Pallas TPU (Mosaic) kernel, built as ragged paged attention is.

The block tables (flattened) and the context lengths are scalar-prefetched into SMEM; the
pools stay in HBM (``memory_space=ANY``) and each program copies its row's pages into VMEM
itself, ``pages_per_step`` pages per step, double buffered: step i + 1's DMAs are started
before step i computes. Only pages before ``ceil((ctx + T) / block_size)`` are copied, so
unused table entries are never read (nor dereferenced); pages a step does not copy leave
stale VMEM, which the masks hide.

Grid ``(B, Hkv // hb, row_blocks)``, one program per row, head group and block of query
rows, the online-softmax state carried through two loops: the steps wholly before the
context length (no mask), then the few holding the verify block, whose visibility comes from
:func:`pallas_kernels._common.paged_tail_mask`. ``hb`` heads per program as in the
tree-attention kernel, and a page's ``hb`` heads are one DMA from the pool as it is: a
token-major pool is viewed as ``[num_blocks, block_size, Hkv * D]`` (a free reshape) and
copied as ``[block_size, hb * D]`` (lane dim a multiple of 128), a head-major one
``[num_blocks, Hkv, block_size, D]`` as ``[hb, block_size, D]`` (D the full lane dim).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    finalize,
    init_state,
    online_step,
    pack_queries,
    paged_tail_mask,
    pool_dims,
    round_up,
    tail_steps,
    unpack_output,
)
from pallas_kernels._tree_attention_tpu import heads_per_block, mosaic_params

_STEP_KEYS = 256  # keys per step by default (16 pages of 16 or 8 of 32)
_MAX_BLOCK_M = 256


def _kernel(len_ref, table_ref, q_ref, tail_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, *,
            scale: float, block_size: int, pages_per_step: int, t_new: int, max_blocks: int,
            heads_major: bool):
    b, h = pl.program_id(0), pl.program_id(1)
    heads, _, head_dim = q_ref.shape
    width = heads * head_dim
    step_keys = pages_per_step * block_size
    ctx = len_ref[b]
    end = ctx + t_new
    # lax.div, not //: the operands are non-negative, and floor division lowers through
    # `sign`, whose Mosaic rule asks for the TPU generation (no AOT lowering from a host).
    n_pages = lax.div(end + block_size - 1, block_size)
    n_full = lax.div(ctx, step_keys)
    n_steps = lax.div(end + step_keys - 1, step_keys)

    def copies(i, slot):
        """(needed, DMA) for every page of step i into buffer ``slot``."""
        out = []
        for p in range(pages_per_step):
            index = i * pages_per_step + p
            block = table_ref[b * max_blocks + jnp.minimum(index, max_blocks - 1)]
            rows = pl.ds(p * block_size, block_size)
            for kind, (pool, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                if heads_major:
                    src, dst = pool.at[block, pl.ds(h * heads, heads)], buf.at[slot, :, rows]
                else:
                    src, dst = pool.at[block, :, pl.ds(h * width, width)], buf.at[slot, rows]
                dma = pltpu.make_async_copy(src, dst, sems.at[kind, slot])
                out.append((index < n_pages, dma))
        return out

    def start(i, slot):
        for needed, dma in copies(i, slot):
            pl.when(needed)(dma.start)

    def wait(i, slot):
        for needed, dma in copies(i, slot):
            pl.when(needed)(dma.wait)

    def fold(i, states, visible, stale_values: bool):
        slot = lax.rem(i, 2)

        @pl.when(i + 1 < n_steps)
        def _prefetch():
            start(i + 1, 1 - slot)

        wait(i, slot)
        out = []
        for j, st in enumerate(states):
            if heads_major:
                k, v = k_buf[slot, j], v_buf[slot, j]
            else:
                lanes = pl.ds(j * head_dim, head_dim)
                k, v = k_buf[slot, :, lanes], v_buf[slot, :, lanes]
            if stale_values:  # slots at or past ctx + T: stale or never copied (NaN-safe)
                pos = i * step_keys + lax.broadcasted_iota(jnp.int32, (step_keys, 1), 0)
                v = jnp.where(pos < end, v, jnp.zeros_like(v))
            out.append(online_step(st, q_ref[j], k, v, visible, scale=scale))
        return tuple(out)

    start(0, 0)
    states = tuple(init_state(q_ref.shape[1], head_dim) for _ in range(heads))
    states = lax.fori_loop(0, n_full, lambda i, sts: fold(i, sts, None, False), states)
    states = lax.fori_loop(
        n_full, n_steps, lambda i, sts: fold(i, sts, tail_ref[i - n_full] != 0, True), states)
    for j, st in enumerate(states):
        o_ref[j] = finalize(st).astype(o_ref.dtype)


def paged_attention_tpu(q, k_pool, v_pool, block_tables, context_lengths, mask, *,
                        scale: float, interpret: bool, pages_per_step: int | None,
                        pool_layout: str) -> jax.Array:
    """Pallas/Mosaic paged attention; shapes as in :func:`pallas_kernels.paged_attention`
    (context_lengths already clipped to the table's span less T, tables to the pool).
    ``interpret`` runs Pallas's TPU interpreter (DMAs and semaphores simulated, fresh VMEM
    filled with NaN)."""
    batch, t_new, n_q_heads, head_dim = q.shape
    num_blocks, block_size, n_kv_heads = pool_dims(k_pool.shape, pool_layout)
    max_blocks = block_tables.shape[1]
    group = n_q_heads // n_kv_heads
    rows = t_new * group
    hb = heads_per_block(n_kv_heads, head_dim)
    if pages_per_step is None:
        pages_per_step = min(max(1, _STEP_KEYS // block_size), max_blocks)
    if pages_per_step < 1:
        raise ValueError(f"pages_per_step must be >= 1, got {pages_per_step}")
    step_keys = pages_per_step * block_size

    block_m = min(round_up(rows, 16), _MAX_BLOCK_M)
    m_pad = round_up(rows, block_m)
    n_tail = tail_steps(t_new, step_keys)
    queries = pack_queries(q, n_kv_heads, jnp.result_type(q.dtype, k_pool.dtype), m_pad)
    tail = paged_tail_mask(mask, context_lengths, group=group, m_pad=m_pad, block=step_keys)
    heads_major = pool_layout == "head_major"
    if heads_major:
        buffer = (2, hb, step_keys, head_dim)  # per slot, hb heads' pages
    else:
        k_pool, v_pool = (x.reshape(num_blocks, block_size, n_kv_heads * head_dim)  # free
                          for x in (k_pool, v_pool))
        buffer = (2, step_keys, hb * head_dim)

    q_spec = pl.BlockSpec((None, hb, block_m, head_dim), lambda b, h, r, *_: (b, h, r, 0))
    tail_spec = pl.BlockSpec((None, n_tail, block_m, step_keys), lambda b, h, r, *_: (b, 0, r, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, n_kv_heads // hb, m_pad // block_m),
        in_specs=[q_spec, tail_spec, hbm, hbm],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM(buffer, k_pool.dtype),
            pltpu.VMEM(buffer, v_pool.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
        ],
    )
    kernel = functools.partial(_kernel, scale=scale, block_size=block_size,
                               pages_per_step=pages_per_step, t_new=t_new, max_blocks=max_blocks,
                               heads_major=heads_major)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, n_kv_heads, m_pad, head_dim), q.dtype),
        compiler_params=mosaic_params("parallel", "parallel", "parallel"),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_attention_tpu",
    )(context_lengths, block_tables.reshape(-1), queries, tail, k_pool, v_pool)
    return unpack_output(out, t_new, n_q_heads, q.dtype)
