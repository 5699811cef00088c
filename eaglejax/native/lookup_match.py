"""The lookup branch's search on CPU in one pass per row, with the native kernel
`lookup_match.cc` (`decoding.lookup.continuation`'s answer, which XLA:CPU computes as 8
shifted copies of the searched context). Other platforms and traces over a mesh keep the
caller's reference (`jax.lax.platform_dependent`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from eaglejax import native
from eaglejax.native import build

TARGET = "eaglejax_lookup_continuation"


@functools.cache
def available() -> bool:
    """True once the kernel is built, loaded and registered with XLA for the CPU."""
    return build.register("lookup_match", {TARGET: "EaglejaxLookupContinuation"})


def applies(context: jax.Array) -> bool:
    """Whether `continuation` runs the kernel on CPU: an int32 context [B,W], the kernel
    available, and not inside `native.xla_only()` or over a mesh."""
    return (native.kernels_allowed() and context.dtype == jnp.int32 and context.ndim == 2
            and context.shape[1] > 0 and available())


def continuation(context: jax.Array, last: jax.Array, count: int,
                 reference: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
                 ) -> tuple[jax.Array, jax.Array]:
    """(tokens [B,count], match length [B]) as `reference(context, last)` gives them (call
    only where `applies`)."""
    batch = context.shape[0]

    def kernel(context, last):
        out = (jax.ShapeDtypeStruct((batch, count), jnp.int32),
               jax.ShapeDtypeStruct((batch,), jnp.int32))
        return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(context, last)

    return jax.lax.platform_dependent(context, last.astype(jnp.int32), cpu=kernel,
                                      default=reference)
