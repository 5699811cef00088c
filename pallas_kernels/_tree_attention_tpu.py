"""Tree attention as a Pallas TPU (Mosaic) kernel with scalar-prefetched cache lengths.

Grid ``(B, Hkv // hb, row_blocks, kv_steps)``; the last axis walks the cache in
``block_k`` blocks and carries the online-softmax state in VMEM scratch. ``hb`` heads
per program (more than one only when ``D < 128``). The cache is read in place in either
layout: ``[B, S, Hkv, D]`` ("bshd") is viewed as ``[B, S, Hkv * D]`` (a free reshape) and
each block is ``[block_k, hb * D]``, so its lane dim is a multiple of 128; the head-major
``[B, Hkv, S, D]`` ("bhsd") is blocked as ``[hb, block_k, D]`` (D is the full lane dim,
each head's block one contiguous DMA). The prefetched lengths clamp the block index map,
so steps past ``cache_lengths[b]`` revisit the last real block (no new DMA) and skip
their compute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    SoftmaxState,
    cache_seq_axis,
    finalize,
    init_state,
    online_step,
    pack_inputs,
    round_up,
    unpack_output,
)

_DEFAULT_BLOCK_K = 512
_MAX_BLOCK_M = 256


def mosaic_params(*dimension_semantics: str):
    """Mosaic compiler params with the grid's dimension semantics (either class name)."""
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(dimension_semantics=dimension_semantics)


def heads_per_block(n_kv_heads: int, head_dim: int) -> int:
    """Fewest KV heads whose concatenated head dims fill whole 128-lane tiles."""
    for hb in range(1, n_kv_heads + 1):
        if n_kv_heads % hb == 0 and (hb * head_dim) % 128 == 0:
            return hb
    return n_kv_heads  # a full-width block is always a legal TPU block


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, o_ref,
            acc_sc, m_sc, l_sc, *, scale: float, block_k: int, n_steps: int,
            heads_major: bool):
    heads, block_m, head_dim = q_ref.shape
    i = pl.program_id(3)
    length = len_ref[pl.program_id(0)]

    def cols(ref, j):  # head j's [rows, D] slice of a [rows, hb * D] block
        return ref[...] if heads == 1 else ref[:, j * head_dim:(j + 1) * head_dim]

    def cache_cols(ref, j):  # head j's [block_k, D] cache block
        return ref[j] if heads_major else cols(ref, j)

    def load(j):
        return SoftmaxState(acc_sc[j], m_sc[j], l_sc[j])

    def store(j, st):
        acc_sc[j], m_sc[j], l_sc[j] = st.acc, st.m, st.l

    @pl.when(i == 0)
    def _new_tokens():
        visible = mask_ref[...] != 0
        for j in range(heads):
            st = online_step(init_state(block_m, head_dim), q_ref[j], cols(kn_ref, j),
                             cols(vn_ref, j), visible, scale=scale)
            store(j, st)

    @pl.when(i * block_k < length)
    def _cache_block():
        start = i * block_k
        row_seen = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1) < length
        col_seen = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0) < length
        for j in range(heads):
            v = cache_cols(v_ref, j)
            v = jnp.where(col_seen, v, jnp.zeros_like(v))  # ragged edge block / stale slots
            store(j, online_step(load(j), q_ref[j], cache_cols(k_ref, j), v, row_seen,
                                 scale=scale))

    @pl.when(i == n_steps - 1)
    def _write():
        for j in range(heads):
            o_ref[j] = finalize(load(j)).astype(o_ref.dtype)


def tree_attention_tpu(q, k_cache, v_cache, cache_lengths, k_new, v_new, mask, *,
                       scale: float, interpret: bool, block_k: int | None,
                       kv_layout: str = "bshd") -> jax.Array:
    """Pallas/Mosaic tree attention; shapes as in :func:`pallas_kernels.tree_attention`
    (k_cache/v_cache [B, S, Hkv, D] for kv_layout="bshd", [B, Hkv, S, D] for "bhsd")."""
    batch, t_new, n_q_heads, head_dim = q.shape
    s_cache = k_cache.shape[cache_seq_axis(kv_layout)]
    n_kv_heads = k_new.shape[2]
    rows = t_new * (n_q_heads // n_kv_heads)
    hb = heads_per_block(n_kv_heads, head_dim)

    block_m = min(round_up(rows, 16), _MAX_BLOCK_M)
    m_pad = round_up(rows, block_m)
    t_pad = round_up(t_new, 16)
    if block_k is None:
        block_k = _DEFAULT_BLOCK_K
    if block_k < 1:
        raise ValueError(f"block_k must be positive, got {block_k}")
    if block_k >= s_cache:
        block_k = s_cache  # one full-extent block is always legal
    elif block_k % 16:
        raise ValueError(f"block_k must be a multiple of 16 on TPU, got {block_k}")
    n_steps = pl.cdiv(s_cache, block_k)

    packed = pack_inputs(q, cache_lengths, k_new, v_new, mask, s_cache=s_cache,
                         k_dtype=k_cache.dtype, v_dtype=v_cache.dtype, m_pad=m_pad, t_pad=t_pad)
    width = n_kv_heads * head_dim
    kn_flat = packed.k_new.reshape(batch, t_pad, width)
    vn_flat = packed.v_new.reshape(batch, t_pad, width)

    def kv_block(b, i, lens):
        last = jnp.maximum(pl.cdiv(lens[b], block_k) - 1, 0)
        return jnp.minimum(i, last)

    if kv_layout == "bshd":
        k_kernel = k_cache.reshape(batch, s_cache, width)  # free: merges the two minor dims
        v_kernel = v_cache.reshape(batch, s_cache, width)
        kv_spec = pl.BlockSpec((None, block_k, hb * head_dim),
                               lambda b, h, r, i, lens: (b, kv_block(b, i, lens), h))
    else:
        k_kernel, v_kernel = k_cache, v_cache
        kv_spec = pl.BlockSpec((None, hb, block_k, head_dim),
                               lambda b, h, r, i, lens: (b, h, kv_block(b, i, lens), 0))
    q_spec = pl.BlockSpec((None, hb, block_m, head_dim), lambda b, h, r, i, *_: (b, h, r, 0))
    new_spec = pl.BlockSpec((None, t_pad, hb * head_dim), lambda b, h, r, i, *_: (b, 0, h))
    mask_spec = pl.BlockSpec((None, block_m, t_pad), lambda b, h, r, i, *_: (b, r, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, n_kv_heads // hb, m_pad // block_m, n_steps),
        in_specs=[q_spec, kv_spec, kv_spec, new_spec, new_spec, mask_spec],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((hb, block_m, head_dim), jnp.float32),
            pltpu.VMEM((hb, block_m, 1), jnp.float32),
            pltpu.VMEM((hb, block_m, 1), jnp.float32),
        ],
    )
    kernel = functools.partial(_kernel, scale=scale, block_k=block_k, n_steps=n_steps,
                               heads_major=kv_layout == "bhsd")
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, n_kv_heads, m_pad, head_dim), q.dtype),
        compiler_params=mosaic_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
        name="tree_attention_tpu",
    )(packed.lengths, packed.q, k_kernel, v_kernel, kn_flat, vn_flat, packed.mask)
    return unpack_output(out, t_new, n_q_heads, q.dtype)
