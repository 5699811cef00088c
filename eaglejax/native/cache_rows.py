"""Chosen new K/V rows of every layer written into the cache in one call on CPU, with the
native kernel `cache_rows.cc` (in place: the results alias the cache buffers). A speculative
round's commit of its accepted path otherwise costs XLA:CPU a gather and a scatter per
buffer, 120 small operations for a 30-layer model. `write_paged` writes into pools
[N,H,BS,D] through block tables [B,W] int32. Other platforms and traces over a mesh keep
the caller's reference (`jax.lax.platform_dependent`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from eaglejax import native
from eaglejax.native import build

TARGET = "eaglejax_cache_rows"
PAGED_TARGET = "eaglejax_paged_cache_rows"

Buffers = tuple[jax.Array, ...]


@functools.cache
def available() -> bool:
    """True once the kernel is built, loaded and registered with XLA for the CPU."""
    return build.register("cache_rows", {TARGET: "EaglejaxCacheRows",
                                         PAGED_TARGET: "EaglejaxPagedCacheRows"})


def applies(buffers: Buffers, rows: Buffers) -> bool:
    """Whether `write` (or `write_paged`, given pools) runs the kernel on CPU: 4-D caches
    and new rows of equal dtypes, the kernel available, and not inside `native.xla_only()` or
    over a mesh."""
    return (native.kernels_allowed() and len(buffers) == len(rows) > 0
            and all(b.ndim == 4 and r.ndim == 4 and b.dtype == r.dtype
                    for b, r in zip(buffers, rows))
            and available())


def _kernel(target: str, *operands) -> Buffers:
    """The call of `target` on (*indices, buffers, rows), in place."""
    *indices, buffers, rows = operands
    outs = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers)
    aliases = {len(indices) + i: i for i in range(len(buffers))}
    return tuple(jax.ffi.ffi_call(target, outs, input_output_aliases=aliases,
                                  vmap_method="sequential")(*indices, *buffers, *rows))


def _run(target: str, reference: Callable[..., Buffers], buffers: Buffers, rows: Buffers,
         *indices: jax.Array) -> Buffers:
    """`target` on CPU, `reference(*indices, buffers, rows)` elsewhere (indices as int32)."""
    return jax.lax.platform_dependent(*(index.astype("int32") for index in indices),
                                      tuple(buffers), tuple(rows),
                                      cpu=functools.partial(_kernel, target), default=reference)


def write(buffers: Buffers, rows: Buffers, picks: jax.Array, lengths: jax.Array,
          reference: Callable[[jax.Array, jax.Array, Buffers, Buffers], Buffers]) -> Buffers:
    """Each buffer [B',H,S,D] with rows picks[b, p] of its new rows [B,N,H,D] at slots
    lengths[b] + p (call only where `applies`); `reference(picks, lengths, buffers, rows)`
    computes the same on other platforms."""
    return _run(TARGET, reference, buffers, rows, picks, lengths)


def write_paged(buffers: Buffers, rows: Buffers, picks: jax.Array, lengths: jax.Array,
                tables: jax.Array,
                reference: Callable[[jax.Array, jax.Array, jax.Array, Buffers, Buffers], Buffers]
                ) -> Buffers:
    """`write` into pools [N,H,BS,D] (call only where `applies`): slot lengths[b] + p of row
    b is row slot % BS of block tables[b, slot // BS] ([B,W] int32); slots at W * BS and
    beyond or through an entry outside [0, N) are dropped. `reference(picks, lengths, tables,
    buffers, rows)` computes the same on other platforms."""
    return _run(PAGED_TARGET, reference, buffers, rows, picks, lengths, tables)
