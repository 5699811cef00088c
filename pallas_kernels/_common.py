"""Shared pieces of the tree-attention kernels: query packing and the online-softmax step.

Both backends see the queries of one KV head as a single matrix of ``M = T * G`` rows
(``G = Hq // Hkv``), ordered token-major (row ``r`` is token ``r // G``, query head
``h * G + r % G``), so one program computes every query head that shares a K/V block.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# Initial running max. Finite, so a row that has seen only masked (-inf) scores keeps
# exp(-inf - M_INIT) == 0 and exp(M_INIT - M_INIT) == 1 instead of NaN.
M_INIT = -1e30


KV_LAYOUTS = ("bshd", "bhsd")


def check_kv_layout(kv_layout: str) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be 'bshd' or 'bhsd', got {kv_layout!r}")


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
    batch, t_new, n_q_heads, head_dim = q.shape
    n_kv_heads = k_new.shape[2]
    group = n_q_heads // n_kv_heads
    rows = t_new * group
    qk_dtype = jnp.result_type(q.dtype, k_dtype)
    qp = q.astype(qk_dtype).reshape(batch, t_new, n_kv_heads, group, head_dim)
    qp = qp.transpose(0, 2, 1, 3, 4)
    qp = qp.reshape(batch, n_kv_heads, rows, head_dim)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, m_pad - rows), (0, 0)))
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
    visible: jax.Array,
    *,
    scale: float,
) -> SoftmaxState:
    """Fold one key block into the state.

    q [bm, D]; k, v [bk, D]; visible bool, broadcastable to [bm, bk]. Rows whose whole
    block is invisible are left unchanged (their scores are -inf, never NaN).
    """
    if k.dtype != q.dtype:
        k = k.astype(q.dtype)
    s = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())),
        precision=dot_precision(q.dtype), preferred_element_type=jnp.float32,
    )
    s = jnp.where(visible, s * scale, -jnp.inf)
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
