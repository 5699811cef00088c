"""The native row argmax (eaglejax.native.row_argmax through `sampling.argmax_last`)
against numpy's argmax: the first maximum, the first NaN where a row has one, ties,
infinities, any leading shape; exports for GPU/TPU keep XLA's reductions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eaglejax.decoding.sampling import argmax_last
from eaglejax.native import build, row_argmax

needs_compiler = pytest.mark.skipif(build.compiler() is None or not build.enabled(),
                                    reason="no C++ compiler here (or EAGLEJAX_NATIVE=0): "
                                           "XLA's reductions are used")


@needs_compiler
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152, 8193])
def test_rows_agree_with_numpy(vocab):
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((3, 4, vocab)).astype(np.float32)
    x[0, 0, :] = 0.0  # all tied: index 0
    x[0, 1, -1] = np.inf  # the last element
    x[1, 0, vocab // 2] = x[1, 0].max() + 1  # middle, then the same value again later
    x[1, 0, -1] = x[1, 0, vocab // 2]
    x[2, 0, :] = -np.inf
    x[2, 1, vocab // 3] = np.nan  # NaN wins, the first one
    x[2, 1, -1] = np.nan
    x[2, 2, -1] = np.nan  # a NaN in the vector tail or the scalar tail
    assert row_argmax.applies(jnp.asarray(x))
    assert row_argmax.TARGET in jax.jit(argmax_last).lower(jnp.asarray(x)).as_text()
    got = np.asarray(jax.jit(argmax_last)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_exports_for_accelerators_keep_xlas_reductions():
    x = jnp.zeros((6, 128))
    for platform in ("cuda", "tpu"):
        text = jax.export.export(jax.jit(argmax_last), platforms=[platform])(x).mlir_module()
        assert row_argmax.TARGET not in text and "reduce" in text
