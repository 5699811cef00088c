"""x [..., K] . w[N,K]^T in float32 for a few rows of x (verification blocks, decode steps,
draft-head steps) with the native CPU kernel `few_row_matmul.cc`; w is float32, or
bfloat16 storage (half the bytes read): widened exactly in registers (float32 products), or
on a CPU with AMX tiles x split into two bfloat16 halves (x to 2^-17 relative, as XLA's
`split_precision_linear` splits it) summed in float32 by the tile unit, 8 rows per tile
product.

XLA:CPU multiplies 2-16 rows at about half the bandwidth it reaches for one row; the kernel
reads each weight once and does all rows' multiply-adds on it, and sums every output in an
order that does not depend on the number of rows (a verify block reproduces the
single-token step's products bit for bit). Other platforms and larger blocks keep XLA's dot
(`jax.lax.platform_dependent` picks per lowering platform, so exports for GPU/TPU never
contain the kernel). The small operations around a decoder layer's products ride along in
the same call: the rows may be RMS-normed first or formed as silu(gate) * up, and a
residual may be added to the product (a verify block then pays no XLA operation of its
own for them). Gradients are those of the XLA reference the caller passes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax import native
from eaglejax.native import build

# Decode steps, verification blocks and head steps; measured faster than XLA's dot up to
# here (BENCHMARKS.md). Prefill blocks (hundreds of rows) keep XLA's matrix kernels.
MAX_ROWS = 16
TARGETS = {jnp.dtype(jnp.float32): "eaglejax_few_row_matmul",
           jnp.dtype(jnp.bfloat16): "eaglejax_few_row_matmul_bf16"}


@functools.cache
def available() -> bool:
    """True once the kernel is built, loaded and registered with XLA for the CPU."""
    return build.register("few_row_matmul", {
        TARGETS[jnp.dtype(jnp.float32)]: "EaglejaxFewRowMatmul",
        TARGETS[jnp.dtype(jnp.bfloat16)]: "EaglejaxFewRowMatmulBf16"})


def applies(x: jax.Array, weight: jax.Array) -> bool:
    """Whether `linear(x, weight)` runs the kernel on CPU: float32 x, a 2-D float32 or
    bfloat16 weight, 1 to MAX_ROWS rows, the kernel available, and not inside
    `native.xla_only()`."""
    return (native.kernels_allowed() and x.dtype == jnp.float32 and weight.dtype in TARGETS
            and weight.ndim == 2
            and 1 <= math.prod(x.shape[:-1]) <= MAX_ROWS and available())


PLAIN, RMS_NORM, SILU_GATE = 0, 1, 2  # the kernel's prologues (few_row_matmul.cc)


def _native(eps: float, gated: bool, rows: jax.Array, weight: jax.Array,
            norm: jax.Array | None, residual: jax.Array | None) -> jax.Array:
    prologue = RMS_NORM if norm is not None else SILU_GATE if gated else PLAIN
    empty = jnp.zeros((0,), jnp.float32)
    out = jax.ShapeDtypeStruct((rows.shape[0], weight.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[weight.dtype], out, vmap_method="sequential")(
        rows, weight, empty if norm is None else norm.astype(jnp.float32),
        empty if residual is None else residual, prologue=np.int32(prologue),
        eps=np.float32(eps))


def linear(x: jax.Array, weight: jax.Array, reference: Callable[..., jax.Array], *,
           norm: jax.Array | None = None, eps: float = 0.0, gated: bool = False,
           residual: jax.Array | None = None) -> jax.Array:
    """x [..., K] times weight [N, K] (call only where `applies`) by the kernel on CPU, with
    the rows first RMS-normed (`norm`: the scale [K], `eps`) or taken as silu(gate) * up of
    x = [gate | up] [..., 2K] (`gated`), and `residual` [..., N] added to the product.
    `reference(rows [M,K or 2K], weight, norm, residual [M,N] or None)` computes the same
    with XLA's operations: other platforms run it, and gradients are its gradients."""
    rows = x.reshape(-1, x.shape[-1])
    n = weight.shape[0]
    if residual is not None:
        residual = residual.reshape(-1, n).astype(jnp.float32)
    run = native.on_cpu(functools.partial(_native, float(eps), gated), reference)
    y = run(rows, weight, norm, residual)
    return y.reshape(*x.shape[:-1], n)
