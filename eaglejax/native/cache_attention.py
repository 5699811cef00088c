"""Attention of a few new queries (decode steps, verification blocks) over a KV cache with
per-row lengths, with the native CPU kernel `cache_attention.cc`: it reads only each row's
valid prefix, once for all queries of a KV head, where XLA:CPU's batched products read the
whole cache capacity at a fraction of the bandwidth. Sums run in key order, so a query's
result does not depend on how many queries came with it (a verify block reproduces the
single-token step). `rope_attention` is a decoder layer's whole attention step in one call
from its projection's output: rotary embedding, the new rows written into the caches in
place, and the attention (XLA:CPU would spend seven small operations around the kernel on
them). `paged_attention` and `paged_rope_attention` do the same over a paged cache: pools
[N,Hkv,BS,D] read and written through block tables [B,W] int32 (position s of row b at row
s % BS of block tables[b, s // BS]). Other platforms keep the reference
(`lax.platform_dependent`); gradients are the reference's.
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
PAGED_TARGET = "eaglejax_paged_cache_attention"
PAGED_ROPE_TARGET = "eaglejax_paged_rope_cache_attention"
_LANES = 16  # the head dimension must be a multiple of the widest vector the kernel uses


@functools.cache
def available() -> bool:
    """True once the kernel is built, loaded and registered with XLA for the CPU."""
    return build.register("cache_attention", {
        TARGET: "EaglejaxCacheAttention", ROPE_TARGET: "EaglejaxRopeCacheAttention",
        PAGED_TARGET: "EaglejaxPagedCacheAttention",
        PAGED_ROPE_TARGET: "EaglejaxPagedRopeCacheAttention"})


def applies(q: jax.Array, k_cache: jax.Array) -> bool:
    """Whether `attention` (or `paged_attention`, given the pool as `k_cache`) runs the
    kernel on CPU: float32 queries and cache, 1 to MAX_QUERIES new tokens, a head dimension
    the kernel handles, the kernel available, and not inside `native.xla_only()`."""
    head_dim = q.shape[-1]
    return (native.kernels_allowed() and q.dtype == jnp.float32
            and k_cache.dtype == jnp.float32 and 1 <= q.shape[1] <= MAX_QUERIES
            and head_dim % _LANES == 0 and head_dim <= 256 and available())


def _int32(*indices: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(index.astype(jnp.int32) for index in indices)


def _kernel(target, q, k_cache, v_cache, lengths, *rest):
    """The call of `target` on `attention`'s operands (rest: k_new, v_new, mask) or on
    `paged_attention`'s (rest: tables, k_new, v_new, mask)."""
    *tables, k_new, v_new, mask = rest
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(
        q, k_cache, v_cache, *_int32(lengths, *tables), k_new, v_new, mask.astype(jnp.uint8))


def rope_applies(qkv: jax.Array, k_cache: jax.Array) -> bool:
    """Whether `rope_attention` (or `paged_rope_attention`, given the pool as `k_cache`)
    runs the kernel on CPU: float32 qkv [B,T,Hkv,G+2,D] and a cache of some capacity (pool
    blocks of some size), with the shapes `applies` takes."""
    return (qkv.ndim == 5 and qkv.dtype == jnp.float32 and k_cache.shape[2] > 0
            and applies(jax.ShapeDtypeStruct(qkv.shape[:3] + qkv.shape[4:], qkv.dtype), k_cache))


def _rope_kernel(target, qkv, cos, sin, k_cache, v_cache, lengths, *rest):
    """The call of `target` on `rope_attention`'s operands (rest: mask) or on
    `paged_rope_attention`'s (rest: tables, mask)."""
    *tables, mask = rest
    batch, t_new, n_kv, width, d = qkv.shape
    heads = jax.ShapeDtypeStruct((batch, t_new, n_kv * (width - 2), d), jnp.float32)
    rows = jax.ShapeDtypeStruct((batch, t_new, n_kv, d), jnp.float32)
    outs = (heads, jax.ShapeDtypeStruct(k_cache.shape, jnp.float32),
            jax.ShapeDtypeStruct(v_cache.shape, jnp.float32), rows, rows)
    return tuple(jax.ffi.ffi_call(target, outs, input_output_aliases={3: 1, 4: 2},
                                  vmap_method="sequential")(
        qkv, cos, sin, k_cache, v_cache, *_int32(lengths, *tables), mask.astype(jnp.uint8)))


def rope_attention(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array,
                   v_cache: jax.Array, lengths: jax.Array, mask: jax.Array,
                   reference: Callable[..., tuple[jax.Array, ...]]) -> tuple[jax.Array, ...]:
    """A layer's attention step from qkv [B,T,Hkv,G+2,D] (call only where `rope_applies`):
    (out [B,T,Hq,D], k_cache, v_cache with the new rows at lengths[b] + t, k_new, v_new
    [B,T,Hkv,D]), the keys and queries rotated by cos/sin [B,T,D]. `reference` takes the
    same arguments and returns the same values with XLA's operations."""
    run = native.on_cpu(functools.partial(_rope_kernel, ROPE_TARGET), reference)
    return run(qkv, cos, sin, k_cache, v_cache, lengths, mask)


def paged_rope_attention(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_pool: jax.Array,
                         v_pool: jax.Array, lengths: jax.Array, tables: jax.Array,
                         mask: jax.Array, reference: Callable[..., tuple[jax.Array, ...]]
                         ) -> tuple[jax.Array, ...]:
    """`rope_attention` over pools [N,Hkv,BS,D] through block tables [B,W] (call only where
    `rope_applies(qkv, k_pool)`): (out, k_pool, v_pool, k_new, v_new), the new rows written
    at positions lengths[b] + t through the tables (dropped at W * BS and beyond or through
    an entry outside [0, N)). `reference` takes the same arguments."""
    run = native.on_cpu(functools.partial(_rope_kernel, PAGED_ROPE_TARGET), reference)
    return run(qkv, cos, sin, k_pool, v_pool, lengths, tables, mask)


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
              k_new: jax.Array, v_new: jax.Array, mask: jax.Array,
              reference: Callable[..., jax.Array]) -> jax.Array:
    """`reference(q, k_cache, v_cache, lengths, k_new, v_new, mask)` (bhsd cache layout),
    computed by the kernel on CPU (call only where `applies`)."""
    run = native.on_cpu(functools.partial(_kernel, TARGET), reference)
    return run(q, k_cache, v_cache, lengths, k_new, v_new, mask)


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, lengths: jax.Array,
                    tables: jax.Array, k_new: jax.Array, v_new: jax.Array, mask: jax.Array,
                    reference: Callable[..., jax.Array]) -> jax.Array:
    """`reference(q, k_pool, v_pool, lengths, tables, k_new, v_new, mask)`: `attention`
    over pools [N,Hkv,BS,D] read through block tables [B,W] int32, computed by the kernel on
    CPU (call only where `applies(q, k_pool)`). A row's cached keys stop at its first table
    entry outside [0, N)."""
    run = native.on_cpu(functools.partial(_kernel, PAGED_TARGET), reference)
    return run(q, k_pool, v_pool, lengths, tables, k_new, v_new, mask)
