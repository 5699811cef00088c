"""Native CPU kernels that XLA:CPU lacks, built from C++ on first use and called through
the XLA FFI (`few_row_matmul`, `int8_matmul`, `block_matmul`, `cache_attention`,
`cache_rows`, `row_argmax`, `embedding_rows`, `lookup_match`). Without a C++ compiler, with
`EAGLEJAX_NATIVE=0`, or inside `xla_only()` the XLA paths are used; `on_cpu` pairs a kernel
with its XLA reference."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax

from eaglejax.sharding.rules import over_mesh

_xla_only = False


@contextlib.contextmanager
def xla_only() -> Iterator[None]:
    """Trace with XLA's operations instead of the kernels inside the block (side-by-side
    comparisons; a function keeps the path it was traced with, so jit a fresh one inside)."""
    global _xla_only
    saved, _xla_only = _xla_only, True
    try:
        yield
    finally:
        _xla_only = saved


def kernels_allowed() -> bool:
    """False inside `xla_only()` and while tracing over a device mesh (the partitioner
    cannot split a custom call: it would gather every sharded operand onto each device)."""
    return not _xla_only and not over_mesh()


def on_cpu(kernel: Callable, reference: Callable) -> Callable:
    """`kernel(*args)` where the program is lowered for the CPU, `reference(*args)` (the
    same values with XLA's operations) elsewhere (`jax.lax.platform_dependent`); gradients
    are the reference's everywhere."""
    @jax.custom_vjp
    def run(*args):
        return jax.lax.platform_dependent(*args, cpu=kernel, default=reference)

    def forward(*args):
        return run(*args), args

    def backward(args, grad):
        return jax.vjp(reference, *args)[1](grad)

    run.defvjp(forward, backward)
    return run

