"""Attention of a few new queries (decode steps, verification blocks) over a KV cache with
per-row lengths, with the native CPU kernel `cache_attention.cc`: it reads only each row's
valid prefix, once for all queries of a KV head, where XLA:CPU's batched products read the
whole cache capacity at a fraction of the bandwidth. Sums run in key order, so a query's
result does not depend on how many queries came with it (a verify block reproduces the
single-token step). `rope_attention` is a decoder layer's whole attention step in one call
from its projection's output: rotary embedding, the new rows written into the caches in
place, and the attention (XLA:CPU would spend seven small operations around the kernel on
them). Other platforms keep the reference (`lax.platform_dependent`); gradients are the
reference's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from eaglejax import native
from eaglejax.native import build

MAX_QUERIES = 16  # new tokens per row; prefill blocks keep XLA's blocked attention
TARGET = "eaglejax_cache_attention"
ROPE_TARGET = "eaglejax_rope_cache_attention"
_LANES = 16  # the head dimension must be a multiple of the widest vector the kernel uses


@functools.cache
def available() -> bool:
    """True once the kernel is built, loaded and registered with XLA for the CPU."""
    return build.register("cache_attention", {TARGET: "EaglejaxCacheAttention",
                                               ROPE_TARGET: "EaglejaxRopeCacheAttention"})


def applies(q: jax.Array, k_cache: jax.Array) -> bool:
    """Whether `attention` runs the kernel on CPU: float32 queries and cache, 1 to
    MAX_QUERIES new tokens, a head dimension the kernel handles, the kernel available, and
    not inside `native.xla_only()`."""
    head_dim = q.shape[-1]
    return (native.kernels_allowed() and q.dtype == jnp.float32
            and k_cache.dtype == jnp.float32 and 1 <= q.shape[1] <= MAX_QUERIES
            and head_dim % _LANES == 0 and head_dim <= 256 and available())


def _kernel(q, k_cache, v_cache, lengths, k_new, v_new, mask):
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        q, k_cache, v_cache, lengths.astype(jnp.int32), k_new, v_new, mask.astype(jnp.uint8))


def rope_applies(qkv: jax.Array, k_cache: jax.Array) -> bool:
    """Whether `rope_attention` runs the kernel on CPU: float32 qkv [B,T,Hkv,G+2,D] and a
    cache of some capacity, with the shapes `applies` takes."""
    return (qkv.ndim == 5 and qkv.dtype == jnp.float32 and k_cache.shape[2] > 0
            and applies(jax.ShapeDtypeStruct(qkv.shape[:3] + qkv.shape[4:], qkv.dtype), k_cache))


def _rope_kernel(qkv, cos, sin, k_cache, v_cache, lengths, mask):
    batch, t_new, n_kv, width, d = qkv.shape
    heads = jax.ShapeDtypeStruct((batch, t_new, n_kv * (width - 2), d), jnp.float32)
    rows = jax.ShapeDtypeStruct((batch, t_new, n_kv, d), jnp.float32)
    outs = (heads, jax.ShapeDtypeStruct(k_cache.shape, jnp.float32),
            jax.ShapeDtypeStruct(v_cache.shape, jnp.float32), rows, rows)
    return tuple(jax.ffi.ffi_call(ROPE_TARGET, outs, input_output_aliases={3: 1, 4: 2},
                                  vmap_method="sequential")(
        qkv, cos, sin, k_cache, v_cache, lengths.astype(jnp.int32), mask.astype(jnp.uint8)))


def rope_attention(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array,
                   v_cache: jax.Array, lengths: jax.Array, mask: jax.Array,
                   reference: Callable[..., tuple[jax.Array, ...]]) -> tuple[jax.Array, ...]:
    """A layer's attention step from qkv [B,T,Hkv,G+2,D] (call only where `rope_applies`):
    (out [B,T,Hq,D], k_cache, v_cache with the new rows at lengths[b] + t, k_new, v_new
    [B,T,Hkv,D]), the keys and queries rotated by cos/sin [B,T,D]. `reference` takes the
    same arguments and returns the same values with XLA's operations."""
    run = native.on_cpu(_rope_kernel, reference)
    return run(qkv, cos, sin, k_cache, v_cache, lengths, mask)


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
              k_new: jax.Array, v_new: jax.Array, mask: jax.Array,
              reference: Callable[..., jax.Array]) -> jax.Array:
    """`reference(q, k_cache, v_cache, lengths, k_new, v_new, mask)` (bhsd cache layout),
    computed by the kernel on CPU (call only where `applies`)."""
    run = native.on_cpu(_kernel, reference)
    return run(q, k_cache, v_cache, lengths, k_new, v_new, mask)
