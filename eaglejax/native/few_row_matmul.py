"""x [..., K] . w[N,K]^T in float32 for a few rows of x (verification blocks, decode steps,
draft-head steps) with the native CPU kernel `few_row_matmul.cc`.

XLA:CPU multiplies 2-16 rows at about half the bandwidth it reaches for one row; the kernel
reads each weight once and does all rows' multiply-adds on it, and sums every output in an
order that does not depend on the number of rows (a verify block reproduces the
single-token step's products bit for bit). Other platforms and larger blocks keep XLA's dot
(`jax.lax.platform_dependent` picks per lowering platform, so exports for GPU/TPU never
contain the kernel). Gradients are XLA dots.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from eaglejax.native import build

MAX_ROWS = 16  # beyond this XLA's matrix-matrix kernels are as fast (BENCHMARKS.md)
TARGET = "eaglejax_few_row_matmul"


@functools.cache
def available() -> bool:
    """True once the kernel is built, loaded and registered with XLA for the CPU."""
    library = build.load("few_row_matmul")
    if library is None:
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.EaglejaxFewRowMatmul),
                                platform="cpu")
    return True


def applies(x: jax.Array, weight: jax.Array) -> bool:
    """Whether `linear(x, weight)` runs the kernel on CPU: float32 operands, a 2-D weight,
    1 to MAX_ROWS rows, and the kernel available."""
    return (x.dtype == jnp.float32 and weight.dtype == jnp.float32 and weight.ndim == 2
            and 1 <= math.prod(x.shape[:-1]) <= MAX_ROWS and available())


def _xla_product(rows: jax.Array, weight: jax.Array) -> jax.Array:
    return jnp.einsum("oi,ri->ro", weight, rows)


@jax.custom_vjp
def _native_product(rows: jax.Array, weight: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((rows.shape[0], weight.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(rows, weight)


def _forward(rows: jax.Array, weight: jax.Array):
    return _native_product(rows, weight), (rows, weight)


def _backward(residuals, grad: jax.Array):
    rows, weight = residuals
    return grad @ weight, grad.T @ rows


_native_product.defvjp(_forward, _backward)


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., K] times weight [N, K] (call only where `applies`)."""
    rows = x.reshape(-1, x.shape[-1])
    y = jax.lax.platform_dependent(rows, weight, cpu=_native_product, default=_xla_product)
    return y.reshape(*x.shape[:-1], weight.shape[0])
