"""Chosen new K/V rows of every layer written into the cache in one call on CPU, with the
native kernel `cache_rows.cc` (in place: the results alias the cache buffers). A speculative
round's commit of its accepted path otherwise costs XLA:CPU a gather and a scatter per
buffer, 120 small operations for a 30-layer model. Other platforms and traces over a mesh
keep the caller's reference (`jax.lax.platform_dependent`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from eaglejax import native
from eaglejax.native import build

TARGET = "eaglejax_cache_rows"

Buffers = tuple[jax.Array, ...]


@functools.cache
def available() -> bool:
    """True once the kernel is built, loaded and registered with XLA for the CPU."""
    return build.register("cache_rows", {TARGET: "EaglejaxCacheRows"})


def applies(buffers: Buffers, rows: Buffers) -> bool:
    """Whether `write` runs the kernel on CPU: 4-D caches and new rows of equal dtypes, the
    kernel available, and not inside `native.xla_only()` or over a mesh."""
    return (native.kernels_allowed() and len(buffers) == len(rows) > 0
            and all(b.ndim == 4 and r.ndim == 4 and b.dtype == r.dtype
                    for b, r in zip(buffers, rows))
            and available())


def _kernel(picks: jax.Array, lengths: jax.Array, buffers: Buffers, rows: Buffers) -> Buffers:
    outs = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers)
    aliases = {2 + i: i for i in range(len(buffers))}
    return tuple(jax.ffi.ffi_call(TARGET, outs, input_output_aliases=aliases,
                                  vmap_method="sequential")(picks, lengths, *buffers, *rows))


def write(buffers: Buffers, rows: Buffers, picks: jax.Array, lengths: jax.Array,
          reference: Callable[[jax.Array, jax.Array, Buffers, Buffers], Buffers]) -> Buffers:
    """Each buffer [B',H,S,D] with rows picks[b, p] of its new rows [B,N,H,D] at slots
    lengths[b] + p (call only where `applies`); `reference(picks, lengths, buffers, rows)`
    computes the same on other platforms."""
    return jax.lax.platform_dependent(picks.astype("int32"), lengths.astype("int32"),
                                      tuple(buffers), tuple(rows), cpu=_kernel,
                                      default=reference)
