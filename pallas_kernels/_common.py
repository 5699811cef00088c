"""Shared pieces of the attention kernels: query packing, masks and the online-softmax step.

Both backends see the queries of one KV head as a single matrix of ``M = T * G`` rows
(``G = Hq // Hkv``), ordered token-major (row ``r`` is token ``r // G``, query head
``h * G + r % G``), so one program computes every query head that shares a K/V block.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Initial running max. Finite, so a row that has seen only masked (-inf) scores keeps
# exp(-inf - M_INIT) == 0 and exp(M_INIT - M_INIT) == 1 instead of NaN.
M_INIT = -1e30


KV_LAYOUTS = ("bshd", "bhsd")
POOL_LAYOUTS = ("token_major", "head_major")
_GPU_NAMES = {"gpu", "cuda", "rocm", "triton"}
_TPU_NAMES = {"tpu", "mosaic"}


def resolve_backend(backend: str | None, interpret: bool, entry: str) -> str:
    """Kernel family ("gpu" or "tpu") for ``entry`` (the public function, named in errors).
    An explicit backend is trusted even on a CPU host (AOT lowering)."""
    platform = jax.default_backend()
    if backend is None:
        backend = platform
    backend = backend.lower()
    if backend == "cpu":
        if not interpret:
            raise ValueError(
                f"{entry} has no compiled CPU kernel: pass interpret=True to run a Pallas "
                f"kernel in interpret mode, or use pallas_kernels.{entry}_reference on CPU."
            )
        return "gpu"  # the GPU kernel body is the portable one; interpret mode runs it anywhere
    if backend in _GPU_NAMES:
        return "gpu"
    if backend in _TPU_NAMES:
        return "tpu"
    raise ValueError(f"unknown backend {backend!r}; expected 'gpu', 'tpu' or None")


def check_kv_layout(kv_layout: str) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be 'bshd' or 'bhsd', got {kv_layout!r}")


def check_pool_layout(pool_layout: str) -> None:
    if pool_layout not in POOL_LAYOUTS:
        raise ValueError(f"pool_layout must be 'token_major' or 'head_major', got {pool_layout!r}")


def pool_dims(shape: tuple[int, ...], pool_layout: str) -> tuple[int, int, int]:
    """(num_blocks, block_size, Hkv) of a paged pool [num_blocks, block_size, Hkv, D]
    ("token_major") or [num_blocks, Hkv, block_size, D] ("head_major")."""
    num_blocks, second, third, _ = shape
    return (num_blocks, second, third) if pool_layout == "token_major" else (
        num_blocks, third, second)


def cache_seq_axis(kv_layout: str) -> int:
    """Axis of S in a k_cache/v_cache: [B, S, Hkv, D] ("bshd") or [B, Hkv, S, D] ("bhsd")."""
    check_kv_layout(kv_layout)
    return 1 if kv_layout == "bshd" else 2


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of ``multiple``."""
    return -(-int(n) // multiple) * multiple


def dot_precision(dtype: jnp.dtype) -> lax.Precision:
    """Full-precision matmuls for float32 inputs (Triton and TPU default to TF32/bf16 passes)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


class Packed(NamedTuple):
    """Kernel-side operands shared by both backends."""

    q: jax.Array  # [B, Hkv, M_pad, D] queries (promoted with k_cache's dtype), token-major rows
    k_new: jax.Array  # [B, T_pad, Hkv, D] in k_cache's dtype, zero padded
    v_new: jax.Array  # [B, T_pad, Hkv, D] in v_cache's dtype, zero padded
    mask: jax.Array  # [B, M_pad, T_pad] int32, 1 where row r sees new token j
    lengths: jax.Array  # [B] int32, clipped to [0, S]


def pack_queries(q: jax.Array, n_kv_heads: int, dtype: jnp.dtype, m_pad: int) -> jax.Array:
    """q [B, T, Hq, D] as [B, Hkv, M_pad, D] in ``dtype``: each KV head's query heads as
    token-major rows, zero padded to ``m_pad`` rows."""
    batch, t_new, n_q_heads, head_dim = q.shape
    group = n_q_heads // n_kv_heads
    qp = q.astype(dtype).reshape(batch, t_new, n_kv_heads, group, head_dim)
    qp = qp.transpose(0, 2, 1, 3, 4).reshape(batch, n_kv_heads, t_new * group, head_dim)
    return jnp.pad(qp, ((0, 0), (0, 0), (0, m_pad - t_new * group), (0, 0)))


def pack_inputs(
    q: jax.Array,
    cache_lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    mask: jax.Array,
    *,
    s_cache: int,
    k_dtype: jnp.dtype,
    v_dtype: jnp.dtype,
    m_pad: int,
    t_pad: int,
) -> Packed:
    """Regroup queries per KV head, pad rows/new tokens and expand the mask per row.

    Independent of the cache layout: only the cache's length ``s_cache`` (to clip the
    lengths) and its dtypes (the new K/V are cast to them) are needed.
    """
    t_new, n_q_heads = q.shape[1:3]
    n_kv_heads = k_new.shape[2]
    group = n_q_heads // n_kv_heads
    rows = t_new * group
    qp = pack_queries(q, n_kv_heads, jnp.result_type(q.dtype, k_dtype), m_pad)
    pad_t = ((0, 0), (0, t_pad - t_new), (0, 0), (0, 0))
    kn = jnp.pad(k_new.astype(k_dtype), pad_t)
    vn = jnp.pad(v_new.astype(v_dtype), pad_t)
    row_mask = jnp.repeat(mask.astype(jnp.int32), group, axis=1)  # [B, M, T]
    row_mask = jnp.pad(row_mask, ((0, 0), (0, m_pad - rows), (0, t_pad - t_new)))
    lengths = jnp.clip(cache_lengths.astype(jnp.int32), 0, s_cache)
    return Packed(qp, kn, vn, row_mask, lengths)


def unpack_output(out: jax.Array, t_new: int, n_q_heads: int, dtype: jnp.dtype) -> jax.Array:
    """[B, Hkv, M_pad, D] kernel output back to [B, T, Hq, D]."""
    batch, n_kv_heads, _, head_dim = out.shape
    group = n_q_heads // n_kv_heads
    out = out[:, :, : t_new * group].reshape(batch, n_kv_heads, t_new, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, t_new, n_q_heads, head_dim).astype(dtype)


def tail_steps(t_new: int, block: int) -> int:
    """Most key blocks of ``block`` positions that T new tokens starting anywhere can span."""
    return -(-(t_new + block - 1) // block)


def paged_tail_mask(mask: jax.Array, context_lengths: jax.Array, *, group: int, m_pad: int,
                    block: int) -> jax.Array:
    """The verify block's mask in key-position space, per key block, for paged attention.

    mask [B, T, T] (query t sees new token j); context_lengths [B]. Returns int32
    [B, n, M_pad, block] with ``n = tail_steps(T, block)``: entry [b, s, r, c] is the
    visibility, for query row r (token r // group), of position
    ``(ctx // block + s) * block + c``: 1 for a context position (< ctx), the mask's
    entry for a new token (ctx + j), 0 past ctx + T. A kernel walks the keys in blocks of
    ``block``; the blocks before ctx // block see everything, the rest read these slices.
    """
    batch, t_new, _ = mask.shape
    n_tail = tail_steps(t_new, block)
    ctx = context_lengths.astype(jnp.int32)
    rel = (ctx // block * block - ctx)[:, None] + jnp.arange(n_tail * block)  # [B, W]: pos - ctx
    picked = jnp.take_along_axis(
        mask.astype(jnp.int32),
        jnp.broadcast_to(jnp.clip(rel, 0, t_new - 1)[:, None, :], (batch, t_new, rel.shape[1])),
        axis=2)  # [B, T, W]
    rel = rel[:, None, :]
    visible = jnp.where(rel < 0, 1, jnp.where(rel < t_new, picked, 0))
    rows = jnp.repeat(visible, group, axis=1)  # token-major query rows
    rows = jnp.pad(rows, ((0, 0), (0, m_pad - t_new * group), (0, 0)))
    return rows.reshape(batch, m_pad, n_tail, block).transpose(0, 2, 1, 3)



def split_outputs(batch: int, n_kv_heads: int, m_pad: int, d_pad: int, block_m: int,
                  num_splits: int, dtype: jnp.dtype) -> tuple[object, object]:
    """A GPU kernel's (out_shape, out_specs) over the grid (batch, kv head, row block, split):
    the output itself in `dtype` with one split, else each split's float32 partial sums, max
    and normaliser for `merge_splits`."""
    if num_splits == 1:
        return (jax.ShapeDtypeStruct((batch, n_kv_heads, m_pad, d_pad), dtype),
                pl.BlockSpec((None, None, block_m, d_pad), lambda b, h, r, s: (b, h, r, 0)))
    part = (batch, n_kv_heads, num_splits, m_pad)
    shapes = tuple(jax.ShapeDtypeStruct((*part, width), jnp.float32) for width in (d_pad, 1, 1))
    specs = tuple(pl.BlockSpec((None, None, None, block_m, width),
                               lambda b, h, r, s: (b, h, s, r, 0)) for width in (d_pad, 1, 1))
    return shapes, specs

def merge_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Combine per-split states [B, H, splits, M, *] into normalised [B, H, M, D] (float32)."""
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_max)
    denom = jnp.sum(l * w, axis=2)
    num = jnp.sum(acc * w, axis=2)
    return num * jnp.where(denom > 0.0, 1.0 / jnp.where(denom > 0.0, denom, 1.0), 0.0)


class SoftmaxState(NamedTuple):
    """Running flash-attention state for one block of rows (all float32)."""

    acc: jax.Array  # [bm, D] un-normalised output
    m: jax.Array  # [bm, 1] running max of the scaled scores
    l: jax.Array  # [bm, 1] running sum of exp(score - m)


def init_state(block_m: int, head_dim: int) -> SoftmaxState:
    """Empty state: nothing seen yet."""
    return SoftmaxState(
        jnp.zeros((block_m, head_dim), jnp.float32),
        jnp.full((block_m, 1), M_INIT, jnp.float32),
        jnp.zeros((block_m, 1), jnp.float32),
    )


def online_step(
    state: SoftmaxState,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array | None,
    *,
    scale: float,
) -> SoftmaxState:
    """Fold one key block into the state.

    q [bm, D]; k, v [bk, D]; visible bool, broadcastable to [bm, bk], or None when every
    row sees every key. Rows whose whole block is invisible are left unchanged (their
    scores are -inf, never NaN).
    """
    if k.dtype != q.dtype:
        k = k.astype(q.dtype)
    s = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())),
        precision=dot_precision(q.dtype), preferred_element_type=jnp.float32,
    )
    s = s * scale if visible is None else jnp.where(visible, s * scale, -jnp.inf)
    m_new = jnp.maximum(state.m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(state.m - m_new)
    p = jnp.exp(s - m_new)
    l_new = alpha * state.l + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
        precision=dot_precision(v.dtype), preferred_element_type=jnp.float32,
    )
    return SoftmaxState(alpha * state.acc + pv, m_new, l_new)


def finalize(state: SoftmaxState) -> jax.Array:
    """Normalised output; rows that saw nothing give zeros."""
    inv = jnp.where(state.l > 0.0, 1.0 / jnp.where(state.l > 0.0, state.l, 1.0), 0.0)
    return state.acc * inv
