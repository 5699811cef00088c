"""Tolerances of the numerical parity tests, scaled to the values compared.

Two correct float implementations of the same function (XLA:CPU and PyTorch, a Pallas kernel
and its XLA reference, float32 and a float64 oracle) differ by rounding: each operation errs
by up to eps/2 of its result, and the summation order of every reduction depends on the CPU
(SSE, AVX2 or AVX-512 vector widths, MKL's per-vendor code paths, thread count). Through a
stack of layers these errors add up like a random walk, so the tests measure differences in
noise units

    unit = eps(dtype) * scale * sqrt(depth)

with ``scale`` the largest finite magnitude of the reference (by default) and ``depth`` the
number of decoder layers the values went through (1 for one layer, one attention call, one
draft-head step). Each family of tests allows a number of units picked between the largest
noise measured and the smallest error of a real bug. Noise was measured on an AMD EPYC
(AVX-512) under emulated other CPUs: XLA limited to SSE4.2 or to single-threaded Eigen,
PyTorch's ATen at its scalar and AVX2 kernels, MKL in compatibility mode, 16 PyTorch threads;
plus the Intel Xeon (AVX-512) CI failure that opened issue 12 (SmolLM2 logits off by 1.60e-4,
6.1 units). Real bugs were injected as negative controls, which the tests keep: a wrong RMSNorm
epsilon, a wrong RoPE base, a wrong softmax scale, a cached key dropped, packed sequences that
see each other, a sampling temperature 0.1% off.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

# A target model's forward (logits, residual streams, features) or any piece of it (an
# attention call, a training unroll of the same layers), float32, vs PyTorch, a float64
# oracle or another eaglejax path. Largest noise: 6.7 units (the residual stream after one
# Qwen3 layer); SmolLM2 logits 5.0 here, 6.1 on the Xeon; a Pallas tree-attention kernel vs
# the XLA reference 2.6, that reference vs a float64 loop 5.3. Smallest real error: 309 units
# (rms_norm_eps 1e-7 instead of the random models' 1e-6, two layers deep); SmolLM2 with
# rms_norm_eps 1e-6 instead of 1e-5: 1270; rope_theta 10% off: 12,900 (SmolLM2) to 16,800;
# a softmax scale 1% off: 18,900. 40 units is 6x the noise and 7.7x below the smallest error.
FORWARD_UNITS = 40.0

# One EAGLE draft-head step vs the float64 PyTorch oracle of test_draft_formats (depth 1).
# The head's activations are large (mean square ~1), so a wrong epsilon barely shows: noise
# at most 6.4 units; rms_norm_eps 1e-6 instead of the config's 1e-5 36 to 6,600 units (x10:
# 376 and up; rope_theta 10% off: 4,600 and up). 16 units: 2.5x the noise, 2.3x below that.
HEAD_UNITS = 16.0

# Probabilities of sampling warpers (temperature, top-k, top-p) vs transformers' warpers, in
# units of eps * max|logits / temperature| (the log-domain magnitude whose rounding moves a
# probability): noise at most 0.1 units; a temperature 0.1% off 53 units or more.
SOFTMAX_UNITS = 2.0

# bfloat16 values (eps = 2**-7) vs a float32 reference: a bf16 tree-attention kernel 0.67
# units, a bf16-weight model 0.91 units (three layers). A key dropped from the cache: 13
# units and up; the softmax scale of a padded head dim: 20 and up. In bfloat16 a wrong
# epsilon or RoPE base (0.001 to 0.03 absolute) hides below rounding: the float32 tests
# catch those.
BF16_UNITS = 4.0

# A float32 activation times a 16-bit stored weight, as `split_precision_linear` computes it
# (x split into two bfloat16 halves): float32-accurate up to 2^-16 relative, so its noise
# unit takes that precision in place of eps(float32). Pass ``dtype=SPLIT_PRODUCT``.
SPLIT_PRODUCT = "split-product"

# Values that went through the same operations on the same inputs, where at most the last
# rounding of each differs (a parameter after an update of lr 1e-12, a mean of counts taken
# in float32 against the same mean in float64): 1 unit.
ONE_ROUNDING_UNITS = 1.0


# The mean acceptance length of a shipped head over its model card's MT-bench prompts, against
# the card's own figure. Greedy output is identical everywhere (tested); what rounding can move
# is a draft token whose top two head logits are tied within float32 noise, which changes
# that round's accepted length and the alignment of the rounds after it in that prompt.
# An untrained head scores 1.0, the shipped heads 1.37 (P-EAGLE) and 1.43 (EAGLE-3).
ACCEPTANCE_LENGTH_NEAR_TIES = 0.03


def eps(dtype=np.float32) -> float:
    """Machine epsilon of ``dtype`` (float32, float64, bfloat16 or SPLIT_PRODUCT)."""
    if isinstance(dtype, str) and dtype == SPLIT_PRODUCT:
        return 2.0**-16
    return float(ml_dtypes.finfo(np.dtype(dtype)).eps)


def frequency_bound(count: int, false_alarm: float = 1e-6) -> float:
    """How far an observed frequency of ``count`` independent draws may stray from its
    probability: Hoeffding's bound sqrt(ln(2 / false_alarm) / (2 count)), exceeded by a
    correct sampler with probability below ``false_alarm`` on any machine."""
    return math.sqrt(math.log(2.0 / false_alarm) / (2.0 * count))


def noise_unit(want, *, depth: int = 1, scale: float | None = None, dtype=np.float32) -> float:
    """One unit of rounding noise: eps(dtype) * scale * sqrt(depth); ``scale`` defaults to
    the largest finite |want|."""
    if scale is None:
        finite = np.asarray(want, np.float64)
        finite = finite[np.isfinite(finite)]
        scale = float(np.abs(finite).max()) if finite.size else 0.0
    return eps(dtype) * float(scale) * math.sqrt(depth)


def scaled_error(got, want, *, depth: int = 1, scale: float | None = None,
                 dtype=np.float32) -> float:
    """max|got - want| in noise units (see `noise_unit`). Non-finite entries (-inf outside
    a draft vocabulary, say) must be equal in both and are not counted."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"shapes differ: {got.shape} vs {want.shape}"
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite], want[~finite], "non-finite entries differ")
    assert np.isfinite(got[finite]).all(), "got non-finite values where want is finite"
    err = float(np.abs(got[finite] - want[finite]).max()) if finite.any() else 0.0
    unit = noise_unit(want, depth=depth, scale=scale, dtype=dtype)
    return err / unit if unit > 0 else (0.0 if err == 0 else math.inf)


def assert_close_scaled(got, want, *, units: float, depth: int = 1, scale: float | None = None,
                        dtype=np.float32, what: str = "values") -> float:
    """Assert max|got - want| <= units noise units; return the error in units."""
    err = scaled_error(got, want, depth=depth, scale=scale, dtype=dtype)
    unit = noise_unit(want, depth=depth, scale=scale, dtype=dtype)
    assert err <= units, (f"{what}: max |got - want| = {err * unit:.3g} is {err:.1f} noise "
                          f"units > {units:g} (1 unit = {unit:.3g})")
    return err
