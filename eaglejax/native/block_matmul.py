"""x [..., K] . w[N,K]^T for a few rows of float32 x with w in GGUF block storage
(`models.gguf_blocks`: Q4_0, Q4_1, Q8_0, Q4_K or Q6_K blocks as the file stores them, x
quantized to int8 in blocks of 32, integer sub-block sums) by the native CPU kernel
`block_matmul.cc` (AVX-512 VNNI; 4-bit and 6-bit values unpacked once per weight line for a
group of 4 rows, a K-quant's scales formed per block in registers, the next tiles
prefetched, so a verify block of 6 rows costs about 1.2x one row). More than 16 rows go
through the weights 16 at a time; other platforms and traces over a mesh keep XLA's
operations (`models.gguf_blocks.product`, the same values up to float32 rounding); the norm
/ silu(gate) * up prologues and the residual ride along as in `few_row_matmul`. Gradients
are those of the XLA reference the caller passes.
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
from eaglejax.native.few_row_matmul import PLAIN, RMS_NORM, SILU_GATE

TARGET = "eaglejax_block_matmul"


@functools.cache
def available() -> bool:
    """True once the kernel is built, loaded and registered with XLA for the CPU."""
    return build.register("block_matmul", {TARGET: "EaglejaxBlockMatmul"})


def applies(x: jax.Array) -> bool:
    """Whether `linear(x, ...)` runs the kernel on CPU: float32 x with rows, the kernel
    available, and not inside `native.xla_only()` or over a mesh. More than MAX_ROWS rows
    (prefill chunks, large serving batches) go through the weights MAX_ROWS at a time in
    one call, which beats widening every weight to float32 for XLA's product."""
    return (native.kernels_allowed() and x.dtype == jnp.float32
            and math.prod(x.shape[:-1]) >= 1 and available())


def _native(eps: float, gated: bool, offset: int, bits: int, rows: jax.Array,
            packed: jax.Array, scales: jax.Array, mins: jax.Array, supers: jax.Array,
            norm: jax.Array | None, residual: jax.Array | None) -> jax.Array:
    prologue = RMS_NORM if norm is not None else SILU_GATE if gated else PLAIN
    empty = jnp.zeros((0,), jnp.float32)
    out = jax.ShapeDtypeStruct((rows.shape[0], packed.shape[0] * packed.shape[2]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        rows, packed, scales, mins, supers, empty if norm is None else norm.astype(jnp.float32),
        empty if residual is None else residual, prologue=np.int32(prologue),
        eps=np.float32(eps), offset=np.int32(offset), bits=np.int32(bits))


def linear(x: jax.Array, packed: jax.Array, scales: jax.Array, mins: jax.Array,
           supers: jax.Array, reference: Callable[..., jax.Array], *, offset: int, bits: int,
           norm: jax.Array | None = None, eps: float = 0.0, gated: bool = False,
           residual: jax.Array | None = None) -> jax.Array:
    """As `few_row_matmul.linear` for a block-stored weight given as its flat arrays
    (`gguf_blocks.BlockMatrix.flat`: `packed` uint8 [N/16, K bits/32, 16, 4], its scales,
    minimums and a K-quant's super-scales, [0] where the kind has none) and its kind's
    `offset` and `bits` (`gguf_blocks.BlockKind`; call only where `applies`);
    `reference(rows, packed, scales, mins, supers, norm, residual)` is the XLA path."""
    rows = x.reshape(-1, x.shape[-1])
    n = packed.shape[0] * packed.shape[2]
    if residual is not None:
        residual = residual.reshape(-1, n).astype(jnp.float32)
    kernel = functools.partial(_native, float(eps), gated, int(offset), int(bits))
    run = native.on_cpu(kernel, reference)
    y = run(rows, packed, scales, mins, supers, norm, residual)
    return y.reshape(*x.shape[:-1], n)
