"""The native commit of chosen K/V rows (eaglejax.native.cache_rows through
`kv_cache.write_rows`) against an oracle written with numpy, in place, and its dispatch (CPU
only; exports for GPU/TPU keep XLA's gather and scatter)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eaglejax import native
from eaglejax.models import kv_cache
from eaglejax.native import build, cache_rows

needs_compiler = pytest.mark.skipif(build.compiler() is None or not build.enabled(),
                                    reason="no C++ compiler here (or EAGLEJAX_NATIVE=0): "
                                           "XLA's gather and scatter are used")

LAYERS, SLOTS, BATCH, HEADS, CAPACITY, HEAD_DIM, NEW = 3, 4, 2, 2, 16, 8, 6


def _inputs(dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (SLOTS, HEADS, CAPACITY, HEAD_DIM)
    cache = kv_cache.KVCache(
        tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(LAYERS)),
        tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(LAYERS)),
        jnp.asarray([5, 12, 0, 0][:BATCH], jnp.int32))
    new = lambda: tuple(jnp.asarray(rng.standard_normal((BATCH, NEW, HEADS, HEAD_DIM)), dtype)  # noqa: E731
                        for _ in range(LAYERS))
    picks = jnp.asarray([[0, 2, 3, 5], [0, 1, 4, 5]], jnp.int32)  # row 1 runs past the capacity
    return cache, new(), new(), picks


def _oracle(buffer: np.ndarray, rows: np.ndarray, picks: np.ndarray, lengths: np.ndarray):
    out = buffer.copy()
    for b in range(rows.shape[0]):
        for p, pick in enumerate(picks[b]):
            if lengths[b] + p < out.shape[2]:
                out[b, :, lengths[b] + p] = rows[b, pick]
    return out


@needs_compiler
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_land_after_each_prefix_and_nothing_else_moves(dtype):
    """Every layer's K and V get rows picks[b, p] at lengths[b] + p; slots past the capacity,
    the other slots of the batch (rows 2-3) and every other position keep their values."""
    cache, k_new, v_new, picks = _inputs(dtype)
    assert cache_rows.applies(cache.k + cache.v, k_new + v_new)
    written = jax.jit(kv_cache.write_rows)(cache, k_new, v_new, picks)
    assert cache_rows.TARGET in jax.jit(kv_cache.write_rows).lower(
        cache, k_new, v_new, picks).as_text()
    lengths = np.asarray(cache.lengths)
    for got, buf, rows in zip(written.k + written.v, cache.k + cache.v, k_new + v_new):
        want = _oracle(np.asarray(buf), np.asarray(rows), np.asarray(picks), lengths)
        np.testing.assert_array_equal(np.asarray(got), want)
    with native.xla_only():
        reference = jax.jit(kv_cache.write_rows)(cache, k_new, v_new, picks)
    for got, ref in zip(written.k + written.v, reference.k + reference.v):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(written.lengths), lengths)


@needs_compiler
def test_the_commit_updates_donated_buffers_in_place():
    """Donated caches are written where they lie: no copy of a cache buffer in the compiled
    program (a copy per buffer per round would cost more than the scatters it replaces)."""
    cache, k_new, v_new, picks = _inputs(jnp.float32, seed=1)
    commit = jax.jit(kv_cache.write_rows, donate_argnums=(0,))
    text = commit.lower(cache, k_new, v_new, picks).compile().as_text()
    cache_shape = f"f32[{SLOTS},{HEADS},{CAPACITY},{HEAD_DIM}]"
    copies = [line for line in text.splitlines() if f"{cache_shape}" in line and " copy(" in line]
    assert not copies, copies


def test_exports_for_accelerators_keep_xlas_scatter():
    cache, k_new, v_new, picks = _inputs(jnp.float32)
    for platform in ("cuda", "tpu"):
        text = jax.export.export(jax.jit(kv_cache.write_rows), platforms=[platform])(
            cache, k_new, v_new, picks).mlir_module()
        assert cache_rows.TARGET not in text and "scatter" in text
