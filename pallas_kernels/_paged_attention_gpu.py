"""Paged attention as a Pallas GPU kernel lowered through Triton (also runs in interpret mode).

Grid ``(B, Hkv, row_blocks, splits)`` as in the tree-attention kernel: each program owns
``block_m`` query rows of one KV head. The pool of that head, ``[num_blocks, block_size, D]``
(rows ``Hkv * D`` apart in the token-major pool, a contiguous ``[block_size, D]`` page per
block in the head-major one), is one ref read in place; the program
walks its row's block table one page (``block_size`` keys) per step, loading
``pool[table[i]]``. Pages wholly before the context length need no mask; the few pages from
``ctx // block_size`` on hold the verify block and take their visibility from
:func:`pallas_kernels._common.paged_tail_mask`. The walk stops at ``ceil((ctx + T) /
block_size)``: later table entries are never read. With ``splits > 1`` (flash-decoding) the
context pages are cut into ``splits`` dynamic chunks, the last split also takes the
verify-block pages, and the partial states are merged in XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    SoftmaxState,
    finalize,
    init_state,
    merge_splits,
    next_pow2,
    online_step,
    pack_queries,
    paged_tail_mask,
    pool_dims,
    round_up,
    split_outputs,
    tail_steps,
    unpack_output,
)
from pallas_kernels._tree_attention_gpu import default_num_splits, triton_params


def _kernel(len_ref, table_ref, q_ref, tail_ref, k_ref, v_ref, *out_refs,
            scale: float, block_size: int, t_new: int, num_splits: int):
    split = pl.program_id(3)
    ctx = len_ref[0]
    q = q_ref[...]
    state = init_state(q.shape[0], q.shape[1])

    n_full = ctx // block_size  # pages every query sees whole
    per_split = pl.cdiv(n_full, num_splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_full)

    def page(i):
        block = table_ref[i]
        return k_ref[block], v_ref[block]

    def context_page(i, st: SoftmaxState) -> SoftmaxState:
        k, v = page(i)
        return online_step(st, q, k, v, None, scale=scale)

    state = lax.fori_loop(lo, hi, context_page, state)

    def verify_pages(st: SoftmaxState) -> SoftmaxState:
        end = ctx + t_new
        slots = lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)

        def tail_page(s, st: SoftmaxState) -> SoftmaxState:
            i = n_full + s
            k, v = page(i)
            v = jnp.where(i * block_size + slots < end, v, jnp.zeros_like(v))  # stale slots
            return online_step(st, q, k, v, tail_ref[s] != 0, scale=scale)

        return lax.fori_loop(0, pl.cdiv(end, block_size) - n_full, tail_page, st)

    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = finalize(verify_pages(state)).astype(o_ref.dtype)
    else:
        state = lax.cond(split == num_splits - 1, verify_pages, lambda st: st, state)
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = state.acc
        m_ref[...] = state.m
        l_ref[...] = state.l


def paged_attention_gpu(q, k_pool, v_pool, block_tables, context_lengths, mask, *,
                        scale: float, interpret: bool, num_splits: int | None,
                        pool_layout: str) -> jax.Array:
    """Pallas/Triton paged attention; shapes as in :func:`pallas_kernels.paged_attention`
    (context_lengths already clipped to the table's span less T, tables to the pool)."""
    batch, t_new, n_q_heads, head_dim = q.shape
    num_blocks, block_size, n_kv_heads = pool_dims(k_pool.shape, pool_layout)
    max_blocks = block_tables.shape[1]
    group = n_q_heads // n_kv_heads
    rows = t_new * group

    d_pad = max(16, next_pow2(head_dim))  # Triton tensors need power-of-two sizes
    if d_pad != head_dim:  # costs a padded copy of the pool: prefer power-of-two head dims
        def pad(x):
            return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, d_pad - head_dim),))

        q, k_pool, v_pool = map(pad, (q, k_pool, v_pool))

    block_m = min(128, max(16, next_pow2(rows)))
    m_pad = round_up(rows, block_m)
    row_blocks = m_pad // block_m
    n_tail = tail_steps(t_new, block_size)
    if num_splits is None:
        num_splits = default_num_splits(batch, n_kv_heads, row_blocks, max_blocks * block_size,
                                        block_size, block_m, jnp.dtype(k_pool.dtype).itemsize)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    queries = pack_queries(q, n_kv_heads, jnp.result_type(q.dtype, k_pool.dtype), m_pad)
    tail = paged_tail_mask(mask, context_lengths, group=group, m_pad=m_pad, block=block_size)
    kernel = functools.partial(_kernel, scale=scale, block_size=block_size, t_new=t_new,
                               num_splits=num_splits)
    if pool_layout == "token_major":
        pool_spec = pl.BlockSpec((num_blocks, block_size, None, d_pad),
                                 lambda b, h, r, s: (0, 0, h, 0))
    else:
        pool_spec = pl.BlockSpec((num_blocks, None, block_size, d_pad),
                                 lambda b, h, r, s: (0, h, 0, 0))
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, r, s: (b,)),
        pl.BlockSpec((None, max_blocks), lambda b, h, r, s: (b, 0)),
        pl.BlockSpec((None, None, block_m, d_pad), lambda b, h, r, s: (b, h, r, 0)),
        pl.BlockSpec((None, n_tail, block_m, block_size), lambda b, h, r, s: (b, 0, r, 0)),
        pool_spec,
        pool_spec,
    ]
    out_shape, out_specs = split_outputs(batch, n_kv_heads, m_pad, d_pad, block_m, num_splits,
                                         q.dtype)
    out = pl.pallas_call(
        kernel,
        grid=(batch, n_kv_heads, row_blocks, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(num_warps=4 if block_m <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="paged_attention_gpu",
    )(context_lengths, block_tables, queries, tail, k_pool, v_pool)
    if num_splits > 1:
        out = merge_splits(*out)
    return unpack_output(out, t_new, n_q_heads, q.dtype)[..., :head_dim]
