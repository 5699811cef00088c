"""Tree attention as a Pallas GPU kernel lowered through Triton (also runs in interpret mode).

Grid ``(B, Hkv, row_blocks, splits)``. Each program owns ``block_m`` query rows of one
KV head (all its grouped query heads), walks the cache of its batch row in ``block_k``
steps with an online softmax (the ``[S, D]`` cache of one (row, head) is a single ref, in
either cache layout: ``[B, S, Hkv, D]`` gives it row stride ``Hkv * D``, the head-major
``[B, Hkv, S, D]`` a contiguous block), stopping at ``cache_lengths[b]`` (a dynamic loop bound),
and folds in the masked new-token block. With ``splits > 1`` (flash-decoding) the real
prefix is cut into ``splits`` dynamic chunks whose partial states are merged in XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    SoftmaxState,
    cache_seq_axis,
    finalize,
    init_state,
    merge_splits,
    next_pow2,
    online_step,
    pack_inputs,
    round_up,
    split_outputs,
    unpack_output,
)

try:  # Triton compiler params select the Triton lowering (JAX >= 0.7 defaults to Mosaic GPU).
    from jax.experimental.pallas import triton as _pl_triton
except ImportError:  # pragma: no cover - very old JAX
    _pl_triton = None

_TARGET_PROGRAMS = 256  # enough programs to fill the SMs of an H100/H200 about twice
_MAX_SPLITS = 32
_MIN_BLOCKS_PER_SPLIT = 4
# New tokens folded in per step: a whole prefill chunk's K/V (T=1024: 512 KiB in bfloat16)
# would exceed a Hopper SM's 227 KiB of shared memory.
_NEW_TOKEN_TILE = 64


def triton_params(num_warps: int, num_stages: int):
    """Triton compiler params (they select the Triton lowering; None on a JAX without it)."""
    if _pl_triton is None:  # pragma: no cover
        return None
    cls = getattr(_pl_triton, "CompilerParams", None) or getattr(_pl_triton, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, *out_refs,
            scale: float, block_k: int, num_splits: int, s_cache: int):
    split = pl.program_id(3)
    length = len_ref[0]
    q = q_ref[...]
    state = init_state(q.shape[0], q.shape[1])

    n_blocks = pl.cdiv(length, block_k)
    per_split = pl.cdiv(n_blocks, num_splits)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_blocks)
    row_offs = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    col_offs = lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)

    def cache_block(i, st: SoftmaxState) -> SoftmaxState:
        nominal = i * block_k
        if s_cache % block_k:
            # The last block would run past S: read the final full block instead and mask
            # the positions an earlier block already covered. No padding copy of the cache.
            start = jnp.minimum(nominal, s_cache - block_k)
        else:
            start = pl.multiple_of(nominal, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        seen = lambda pos: (pos >= nominal) & (pos < length)  # noqa: E731
        v = jnp.where(seen(start + col_offs), v, jnp.zeros_like(v))  # stale slots may be inf/NaN
        return online_step(st, q, k, v, seen(start + row_offs), scale=scale)

    state = lax.fori_loop(lo, hi, cache_block, state)

    def new_tokens(st: SoftmaxState) -> SoftmaxState:
        t_pad = kn_ref.shape[0]
        if t_pad <= _NEW_TOKEN_TILE:
            return online_step(st, q, kn_ref[...], vn_ref[...], mask_ref[...] != 0,
                               scale=scale)

        def tile(j, st: SoftmaxState) -> SoftmaxState:  # a prefill chunk: tiles, not all T
            start = pl.multiple_of(j * _NEW_TOKEN_TILE, _NEW_TOKEN_TILE)
            cols = pl.ds(start, _NEW_TOKEN_TILE)
            return online_step(st, q, kn_ref[cols, :], vn_ref[cols, :],
                               mask_ref[:, cols] != 0, scale=scale)

        return lax.fori_loop(0, t_pad // _NEW_TOKEN_TILE, tile, st)

    if num_splits == 1:
        state = new_tokens(state)
        (o_ref,) = out_refs
        o_ref[...] = finalize(state).astype(o_ref.dtype)
    else:
        # The last split usually has the least prefix work, so it takes the new tokens.
        state = lax.cond(split == num_splits - 1, new_tokens, lambda st: st, state)
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = state.acc
        m_ref[...] = state.m
        l_ref[...] = state.l


def default_num_splits(batch: int, n_kv_heads: int, row_blocks: int, s_cache: int,
                       block_k: int, block_m: int, itemsize: int) -> int:
    """Flash-decoding split count: enough programs to fill the GPU, while each split keeps
    >= 4 cache blocks and the float32 partial states stay under ~1/4 of the K/V bytes."""
    base = batch * n_kv_heads * row_blocks
    wanted = -(-_TARGET_PROGRAMS // base)
    by_length = -(-s_cache // block_k) // _MIN_BLOCKS_PER_SPLIT
    # per split and row block: block_m * D * 4 bytes written then read back, vs S * D * itemsize
    by_traffic = (s_cache * itemsize) // (8 * block_m * 4)
    return int(max(1, min(wanted, by_length, by_traffic, _MAX_SPLITS)))


def tree_attention_gpu(q, k_cache, v_cache, cache_lengths, k_new, v_new, mask, *,
                       scale: float, interpret: bool, block_k: int | None,
                       num_splits: int | None, kv_layout: str = "bshd") -> jax.Array:
    """Pallas/Triton tree attention; shapes as in :func:`pallas_kernels.tree_attention`
    (k_cache/v_cache [B, S, Hkv, D] for kv_layout="bshd", [B, Hkv, S, D] for "bhsd")."""
    batch, t_new, n_q_heads, head_dim = q.shape
    seq_axis = cache_seq_axis(kv_layout)
    s_cache = k_cache.shape[seq_axis]
    n_kv_heads = k_new.shape[2]
    rows = t_new * (n_q_heads // n_kv_heads)

    # Triton tensors need power-of-two sizes and dots need every dim >= 16.
    d_pad = max(16, next_pow2(head_dim))
    if d_pad != head_dim:  # costs a padded copy of the cache: prefer power-of-two head dims
        def pad(x):
            return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, d_pad - head_dim),))

        q, k_cache, v_cache, k_new, v_new = map(pad, (q, k_cache, v_cache, k_new, v_new))
    if s_cache < 16:  # tiny caches only: pad to one 16-row block
        pad_s = [(0, 0)] * 4
        pad_s[seq_axis] = (0, 16 - s_cache)
        k_cache, v_cache = jnp.pad(k_cache, pad_s), jnp.pad(v_cache, pad_s)
    s_kernel = k_cache.shape[seq_axis]

    block_m = min(128, max(16, next_pow2(rows)))
    m_pad = round_up(rows, block_m)
    t_pad = max(16, next_pow2(t_new))
    if block_k is None:
        block_k = 128 if block_m <= 32 else 64
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16 on GPU, got {block_k}")
    while block_k > s_kernel:
        block_k //= 2
    row_blocks = m_pad // block_m
    if num_splits is None:
        num_splits = default_num_splits(batch, n_kv_heads, row_blocks, s_kernel, block_k,
                                        block_m, jnp.dtype(k_cache.dtype).itemsize)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    packed = pack_inputs(q, cache_lengths, k_new, v_new, mask, s_cache=s_kernel,
                         k_dtype=k_cache.dtype, v_dtype=v_cache.dtype, m_pad=m_pad, t_pad=t_pad)
    kernel = functools.partial(_kernel, scale=scale, block_k=block_k, num_splits=num_splits,
                               s_cache=s_kernel)
    # The whole [S, D] cache of (row b, head h) is one ref, read in place in either layout;
    # the kernel slices the blocks itself (dynamic loop bound: no DMA past the length).
    if kv_layout == "bshd":
        cache_spec = pl.BlockSpec((None, s_kernel, None, d_pad), lambda b, h, r, s: (b, 0, h, 0))
    else:
        cache_spec = pl.BlockSpec((None, None, s_kernel, d_pad), lambda b, h, r, s: (b, h, 0, 0))
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, r, s: (b,)),
        pl.BlockSpec((None, None, block_m, d_pad), lambda b, h, r, s: (b, h, r, 0)),
        cache_spec,
        cache_spec,
        pl.BlockSpec((None, t_pad, None, d_pad), lambda b, h, r, s: (b, 0, h, 0)),
        pl.BlockSpec((None, t_pad, None, d_pad), lambda b, h, r, s: (b, 0, h, 0)),
        pl.BlockSpec((None, block_m, t_pad), lambda b, h, r, s: (b, r, 0)),
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
        name="tree_attention_gpu",
    )(packed.lengths, packed.q, k_cache, v_cache, packed.k_new, packed.v_new, packed.mask)
    if num_splits > 1:
        out = merge_splits(*out)
    out = unpack_output(out, t_new, n_q_heads, q.dtype)
    return out[..., :head_dim]
