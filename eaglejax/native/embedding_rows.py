"""Rows of a bfloat16 embedding table as float32 on CPU, with the native kernel
`embedding_rows.cc`: XLA:CPU gathers 16-bit floats through a float32 copy of the whole
table, made once per program call (hoisted out of the decoding loop as invariant: 22 ms a
call for SmolLM2's table on a 2-core Xeon, BENCHMARKS.md). Other platforms, other dtypes
and traces over a mesh keep XLA's gather (`jax.lax.platform_dependent`). Ids outside the
table are clamped to it on every platform. Gradients flow to the rows read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from eaglejax import native
from eaglejax.native import build

TARGET = "eaglejax_embedding_rows_bf16"


@functools.cache
def available() -> bool:
    """True once the kernel is built, loaded and registered with XLA for the CPU."""
    return build.register("embedding_rows", {TARGET: "EaglejaxEmbeddingRowsBf16"})


def applies(table: jax.Array, dtype: jnp.dtype) -> bool:
    """Whether `rows(table, tokens)` runs the kernel on CPU: a 2-D bfloat16 table widened to
    float32, the kernel available, and not inside `native.xla_only()` or over a mesh."""
    return (table.dtype == jnp.bfloat16 and table.ndim == 2
            and jnp.dtype(dtype) == jnp.float32 and native.kernels_allowed() and available())


def _gather(table: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(table, ids, axis=0, mode="clip").astype(jnp.float32)  # ids as the kernel


@jax.custom_vjp
def _native_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((ids.shape[0], table.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(table, ids)


def _forward(table: jax.Array, ids: jax.Array):
    return _native_rows(table, ids), (table, ids)


def _backward(residuals, grad: jax.Array):
    table, ids = residuals
    ids = jnp.clip(ids, 0, table.shape[0] - 1)  # the rows the kernel read
    return jnp.zeros(table.shape, grad.dtype).at[ids].add(grad).astype(table.dtype), None


_native_rows.defvjp(_forward, _backward)


def rows(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """table[tokens] in float32 (call only where `applies`): the kernel on CPU, XLA's gather
    on other platforms."""
    ids = tokens.reshape(-1).astype(jnp.int32)
    out = jax.lax.platform_dependent(table, ids, cpu=_native_rows, default=_gather)
    return out.reshape(*tokens.shape, table.shape[1])
