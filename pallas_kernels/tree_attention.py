"""Public entry point for tree attention: dispatches to the Pallas GPU (Triton) or TPU kernel."""

from __future__ import annotations

import functools

import jax

from pallas_kernels._common import check_kv_layout, resolve_backend
from pallas_kernels._tree_attention_gpu import tree_attention_gpu
from pallas_kernels._tree_attention_tpu import tree_attention_tpu
from pallas_kernels.reference import KVLayout


def _check_shapes(q, k_cache, v_cache, cache_lengths, k_new, v_new, mask, kv_layout) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    batch, t_new, n_q_heads, head_dim = q.shape
    want = "[B, S, Hkv, D]" if kv_layout == "bshd" else "[B, Hkv, S, D]"
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be {want} (kv_layout={kv_layout!r}), "
                         f"got {k_cache.shape} and {v_cache.shape}")
    if kv_layout == "bshd":
        batch_kv, s_cache, n_kv_heads, head_dim_kv = k_cache.shape
    else:
        batch_kv, n_kv_heads, s_cache, head_dim_kv = k_cache.shape
    if batch_kv != batch or head_dim_kv != head_dim:
        raise ValueError(f"k_cache {k_cache.shape} does not match q {q.shape} in B or D")
    if n_kv_heads < 1 or n_q_heads % n_kv_heads:
        raise ValueError(f"Hq={n_q_heads} is not a multiple of Hkv={n_kv_heads} "
                         f"(k_cache {want} with kv_layout={kv_layout!r})")
    expected_new = (batch, t_new, n_kv_heads, head_dim)
    if k_new.shape != expected_new or v_new.shape != expected_new:
        raise ValueError(f"k_new/v_new must be {expected_new} (Hkv from k_cache {want}), "
                         f"got {k_new.shape}, {v_new.shape}")
    if cache_lengths.shape != (batch,):
        raise ValueError(f"cache_lengths must be [B]={batch}, got {cache_lengths.shape}")
    if mask.shape != (batch, t_new, t_new):
        raise ValueError(f"mask must be [B, T, T]={(batch, t_new, t_new)}, got {mask.shape}")
    if s_cache < 1:
        raise ValueError("the cache needs at least one slot (S >= 1)")


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "block_k", "backend", "num_splits", "kv_layout"),
)
def tree_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool = False,
    block_k: int | None = None,
    backend: str | None = None,
    num_splits: int | None = None,
    kv_layout: KVLayout = "bshd",
) -> jax.Array:
    """Pallas tree attention; same contract as :func:`tree_attention_reference`.

    q [B,T,Hq,D]; k_cache/v_cache [B,S,Hkv,D] (kv_layout="bshd", the default) or
    [B,Hkv,S,D] (kv_layout="bhsd", head-major); cache_lengths [B] int32; k_new/v_new
    [B,T,Hkv,D]; mask [B,T,T] bool. Query t of row b attends to cache positions
    < cache_lengths[b] and to new position j iff mask[b,t,j]; a query that sees nothing
    returns zeros. Returns [B,T,Hq,D] in q's dtype, softmax accumulated in float32.

    backend: "gpu" (Pallas Triton), "tpu" (Pallas Mosaic) or None for jax.default_backend().
    interpret: run the chosen kernel in Pallas interpret mode (any platform, e.g. CPU tests).
    block_k: cache positions per step (GPU: power of two >= 16; TPU: multiple of 16).
    num_splits: GPU only, flash-decoding splits of the prefix (None: from the grid size).
    kv_layout: static; both layouts are read in place by the kernels (the cache is never
        transposed or copied).
    """
    check_kv_layout(kv_layout)
    _check_shapes(q, k_cache, v_cache, cache_lengths, k_new, v_new, mask, kv_layout)
    kind = resolve_backend(backend, interpret, "tree_attention")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    args = (q, k_cache, v_cache, cache_lengths, k_new, v_new, mask)
    if kind == "tpu":
        return tree_attention_tpu(*args, scale=scale, interpret=interpret, block_k=block_k,
                                  kv_layout=kv_layout)
    return tree_attention_gpu(*args, scale=scale, interpret=interpret, block_k=block_k,
                              num_splits=num_splits, kv_layout=kv_layout)
