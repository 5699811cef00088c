"""Public entry point for tree attention: dispatches to the Pallas GPU (Triton) or TPU kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._tree_attention_gpu import tree_attention_gpu
from pallas_kernels._tree_attention_tpu import tree_attention_tpu

_GPU_NAMES = {"gpu", "cuda", "rocm", "triton"}
_TPU_NAMES = {"tpu", "mosaic"}


def _resolve_backend(backend: str | None, interpret: bool) -> str:
    """Kernel family to use. An explicit backend is trusted even on a CPU host (AOT lowering)."""
    platform = jax.default_backend()
    if backend is None:
        backend = platform
    backend = backend.lower()
    if backend == "cpu":
        if not interpret:
            raise ValueError(
                "tree_attention has no compiled CPU kernel: pass interpret=True to run a Pallas "
                "kernel in interpret mode, or use pallas_kernels.tree_attention_reference on CPU."
            )
        return "gpu"  # the GPU kernel body is the portable one; interpret mode runs it anywhere
    if backend in _GPU_NAMES:
        return "gpu"
    if backend in _TPU_NAMES:
        return "tpu"
    raise ValueError(f"unknown backend {backend!r}; expected 'gpu', 'tpu' or None")


def _check_shapes(q, k_cache, v_cache, cache_lengths, k_new, v_new, mask, stacked) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    batch, t_new, n_q_heads, head_dim = q.shape
    want = "[L, B, S, Hkv, D] (layer is given)" if stacked else "[B, S, Hkv, D]"
    if k_cache.ndim != 4 + stacked or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be {want}, got {k_cache.shape} "
                         f"and {v_cache.shape}")
    batch_kv, s_cache, n_kv_heads, head_dim_kv = k_cache.shape[-4:]
    if batch_kv != batch or head_dim_kv != head_dim:
        raise ValueError(f"k_cache {k_cache.shape} does not match q {q.shape} in B or D")
    if n_q_heads % n_kv_heads:
        raise ValueError(f"Hq={n_q_heads} is not a multiple of Hkv={n_kv_heads}")
    expected_new = (batch, t_new, n_kv_heads, head_dim)
    if k_new.shape != expected_new or v_new.shape != expected_new:
        raise ValueError(f"k_new/v_new must be {expected_new}, got {k_new.shape}, {v_new.shape}")
    if cache_lengths.shape != (batch,):
        raise ValueError(f"cache_lengths must be [B]={batch}, got {cache_lengths.shape}")
    if mask.shape != (batch, t_new, t_new):
        raise ValueError(f"mask must be [B, T, T]={(batch, t_new, t_new)}, got {mask.shape}")
    if s_cache < 1:
        raise ValueError("the cache needs at least one slot (S >= 1)")


@functools.partial(
    jax.jit, static_argnames=("scale", "interpret", "block_k", "backend", "num_splits")
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
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Pallas tree attention; same contract as :func:`tree_attention_reference`.

    q [B,T,Hq,D]; k_cache/v_cache [B,S,Hkv,D]; cache_lengths [B] int32; k_new/v_new
    [B,T,Hkv,D]; mask [B,T,T] bool. Query t of row b attends to cache positions
    < cache_lengths[b] and to new position j iff mask[b,t,j]; a query that sees nothing
    returns zeros. Returns [B,T,Hq,D] in q's dtype, softmax accumulated in float32.

    backend: "gpu" (Pallas Triton), "tpu" (Pallas Mosaic) or None for jax.default_backend().
    interpret: run the chosen kernel in Pallas interpret mode (any platform, e.g. CPU tests).
    block_k: cache positions per step (GPU: power of two >= 16; TPU: multiple of 16).
    num_splits: GPU only, flash-decoding splits of the prefix (None: from the grid size).
    layer: optional int32 scalar (may be traced). When given, k_cache/v_cache are the
        layer-stacked caches [L,B,S,Hkv,D] and the kernel reads layer ``layer`` in place,
        saving the copy XLA makes when a sliced cache is passed to a custom call.
    """
    stacked = layer is not None
    _check_shapes(q, k_cache, v_cache, cache_lengths, k_new, v_new, mask, stacked)
    kind = _resolve_backend(backend, interpret)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if stacked:
        layer = jnp.clip(jnp.asarray(layer, jnp.int32).reshape(1), 0, k_cache.shape[0] - 1)
    else:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], jnp.zeros((1,), jnp.int32)
    args = (q, k_cache, v_cache, cache_lengths, k_new, v_new, mask, layer)
    if kind == "tpu":
        return tree_attention_tpu(*args, scale=scale, interpret=interpret, block_k=block_k)
    return tree_attention_gpu(*args, scale=scale, interpret=interpret, block_k=block_k,
                              num_splits=num_splits)
