"""The native few-row float32 product (eaglejax.native.few_row_matmul) against a float64
oracle, its row independence (a verify block reproduces the decode step bit for bit), its
gradient, its dispatch (CPU only; exports for GPU/TPU keep XLA's dot) and its build."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eaglejax.errors import ConfigError
from eaglejax.models.llama import linear
from eaglejax import native
from eaglejax.native import build, few_row_matmul
from tolerances import SPLIT_PRODUCT, assert_close_scaled, scaled_error

needs_compiler = pytest.mark.skipif(build.compiler() is None or not build.enabled(),
                                    reason="no C++ compiler here (or EAGLEJAX_NATIVE=0): "
                                           "XLA's dot is used, which the other tests cover")

# Error in units of eps32 * max_n sum_k |x_k w_nk| (the size of the summed terms, so
# cancellation does not shrink the unit). Float32 sums of K <= 1536 terms over the shapes
# below: the kernel measured 0.70 units at most (AVX-512), 0.35 through AMX tiles (bfloat16
# weights, Intel Xeon family 6 model 167), XLA's dot 0.50; leaving out the
# last of 576 or 1536 terms: 54,000 units and more; the K tail or a shifted weight row:
# 3 x 10^6. 4 units is 5.7x the noise.
PRODUCT_UNITS = 4.0
# bfloat16 weights: units of 2^-16 * the same scale (`SPLIT_PRODUCT`); x's two halves leave
# at most 2^-17 relative of x, so half a unit, plus float32 summation (measured: 0.031 at most
# through AMX tiles; x rounded to one bfloat16 part: 11.4 and more).
SPLIT_UNITS = 1.0


def _oracle(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float]:
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    return x64 @ w64.T, float((np.abs(x64) @ np.abs(w64).T).max())


def _operands(rows: int, k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, k)).astype(np.float32),
            (0.05 * rng.standard_normal((n, k))).astype(np.float32))


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 12, 16])
@pytest.mark.parametrize("k,n", [(576, 100), (1536, 33), (37, 7), (9, 1)])
def test_product_matches_float64(rows, k, n):
    assert few_row_matmul.available()
    x, w = _operands(rows, k, n)
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), jnp.asarray(w)))
    want, scale = _oracle(x, w)
    assert_close_scaled(got, want, units=PRODUCT_UNITS, scale=scale, what="kernel product")


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 6, 9, 16])
@pytest.mark.parametrize("k,n", [(584, 70), (576, 96), (1536, 64)])
def test_bfloat16_weights_give_split_precision_products(rows, k, n):
    """bfloat16 storage: the products are those of x and the stored weights (the float64
    oracle of the same bfloat16 values) to the precision of XLA's path for 16-bit storage,
    x split into two bfloat16 halves (`split_precision_linear`, bound `SPLIT_PRODUCT`):
    exactly float32 where the vector path widens the weights, x to 2^-17 where (whole tiles
    on an AMX CPU) the tile unit sums the two halves' products."""
    x, w = _operands(rows, k, n, seed=3)
    w16 = jnp.asarray(w, jnp.bfloat16)
    assert few_row_matmul.applies(jnp.asarray(x), w16)
    got = np.asarray(jax.jit(linear)(jnp.asarray(x), w16))
    want, scale = _oracle(x, np.asarray(w16.astype(jnp.float32)))
    assert_close_scaled(got, want, units=SPLIT_UNITS, scale=scale, dtype=SPLIT_PRODUCT,
                        what="bf16-weight product")
    # x rounded to one bfloat16 part, and the weights' own rounding, fail the bound
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    one_part = _oracle(x16, np.asarray(w16.astype(jnp.float32)))[0]
    assert scaled_error(one_part, want, scale=scale, dtype=SPLIT_PRODUCT) > 4 * SPLIT_UNITS
    assert scaled_error(_oracle(x, w)[0], want, scale=scale) > 100 * PRODUCT_UNITS


@needs_compiler
def test_negative_controls_fail_the_bound():
    """The bound rejects a product missing the K tail or one weight row."""
    x, w = _operands(6, 37, 7)
    want, scale = _oracle(x, w)
    no_tail, _ = _oracle(x[:, :32], w[:, :32])
    assert scaled_error(no_tail, want, scale=scale) > 1000 * PRODUCT_UNITS
    shifted, _ = _oracle(x, np.roll(w, 1, axis=0))
    assert scaled_error(shifted, want, scale=scale) > 1000 * PRODUCT_UNITS
    x, w = _operands(6, 1536, 50)
    want, scale = _oracle(x, w)
    one_term_short, _ = _oracle(x[:, :-1], w[:, :-1])
    assert scaled_error(one_term_short, want, scale=scale) > 1000 * PRODUCT_UNITS


@needs_compiler
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_do_not_depend_on_the_block(dtype):
    """Each row of a block equals the same row multiplied alone, bit for bit."""
    x, w = _operands(16, 576, 208, seed=1)
    w = jnp.asarray(w, dtype)
    product = jax.jit(linear)
    block = np.asarray(product(jnp.asarray(x), w))
    for i in range(16):
        np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x[i:i + 1]), w))[0],
                                      block[i])
    np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x[3:9]), w)), block[3:9])


@needs_compiler
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_nan_or_infinity_reaches_only_its_own_row(dtype):
    """Non-finite inputs stay what they are (bfloat16 parts of a NaN whose payload is all
    ones would carry into the sign; inf minus its bfloat16 part is NaN): a NaN makes its row
    NaN, an infinity makes it infinite with the weights' signs, and the other rows are the
    same bits as without them."""
    x, w = _operands(6, 576, 96, seed=4)
    w = jnp.asarray(w, dtype)
    product = jax.jit(linear)
    clean = np.asarray(product(jnp.asarray(x), w))
    x[1, 7] = np.frombuffer(np.uint32(0xFFFFFFFF).tobytes(), np.float32)[0]  # NaN, all ones
    x[4, 100] = np.inf
    got = np.asarray(product(jnp.asarray(x), w))
    assert np.isnan(got[1]).all()
    np.testing.assert_array_equal(got[4], np.inf * np.sign(np.asarray(w, np.float32)[:, 100]))
    keep = [0, 2, 3, 5]
    np.testing.assert_array_equal(got[keep], clean[keep])  # bit identity: rows independent


@needs_compiler
def test_batched_shapes_and_gradient():
    x, w = _operands(6, 64, 40, seed=2)
    x3 = jnp.asarray(x.reshape(2, 3, 64))
    assert few_row_matmul.applies(x3, jnp.asarray(w))
    got = np.asarray(jax.jit(linear)(x3, jnp.asarray(w)))
    assert got.shape == (2, 3, 40)
    want, scale = _oracle(x, w)
    assert_close_scaled(got.reshape(6, 40), want, units=PRODUCT_UNITS, scale=scale)

    def loss(fn, a, b):
        return jnp.sum(jnp.sin(fn(a, b)))

    grads = jax.grad(lambda a, b: loss(linear, a, b), argnums=(0, 1))(x3, jnp.asarray(w))
    ref = jax.grad(lambda a, b: loss(lambda p, q: jnp.einsum("oi,...i->...o", q, p), a, b),
                   argnums=(0, 1))(x3, jnp.asarray(w))
    for g, r in zip(grads, ref):
        assert_close_scaled(g, r, units=PRODUCT_UNITS, scale=float(np.abs(r).max()) * 64)


def _prologue64(x: np.ndarray, kind: str, scale: np.ndarray, eps: float) -> np.ndarray:
    """The rows a fused product multiplies, in float64 (written from the definitions)."""
    x = x.astype(np.float64)
    if kind == "norm":
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale
    gate, up = np.split(x, 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


@needs_compiler
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 12])
@pytest.mark.parametrize("kind", ["norm", "gated"])
def test_fused_layer_operations_match_float64(kind, rows, dtype):
    """RMS norm or silu(gate) * up before the product, a residual after it: the kernel's
    result is the float64 oracle's to the same bound as the bare product (float32 weights)
    or the split product (bfloat16), with rows independent bit for bit. Negative controls: a
    norm with eps 10x off, sigmoid(gate) * up, and a dropped residual fail the bound."""
    k, n, eps = 576, 96, 1e-5
    rng = np.random.default_rng(5)
    size = 0.003 if kind == "norm" else 3.0  # a mean square near eps: a wrong eps shows
    x = (size * rng.standard_normal((rows, k if kind == "norm" else 2 * k))).astype(np.float32)
    w = jnp.asarray(0.05 * rng.standard_normal((n, k)), dtype)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    norm = (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    residual = rng.standard_normal((rows, n)).astype(np.float32)
    options = {"norm": jnp.asarray(norm), "eps": eps} if kind == "norm" else {"gated": True}
    assert few_row_matmul.applies(jnp.asarray(x), w)
    fused = jax.jit(lambda a, r: linear(a, w, residual=r, **options))
    got = np.asarray(fused(jnp.asarray(x), jnp.asarray(residual)))
    a64 = _prologue64(x, kind, norm, eps)
    want = residual + a64 @ w64.T
    scale = float((np.abs(a64) @ np.abs(w64).T).max())
    units, unit_dtype = ((PRODUCT_UNITS, np.float32) if dtype == jnp.float32
                         else (SPLIT_UNITS, SPLIT_PRODUCT))
    assert_close_scaled(got, want, units=units, scale=scale, dtype=unit_dtype,
                        what=f"{kind} + product + residual")
    for i in range(rows):
        alone = fused(jnp.asarray(x[i:i + 1]), jnp.asarray(residual[i:i + 1]))
        np.testing.assert_array_equal(np.asarray(alone)[0], got[i])
    if kind == "norm":
        wrong = _prologue64(x, kind, norm, 10 * eps) @ w64.T + residual
    else:
        gate, up = np.split(x.astype(np.float64), 2, axis=-1)
        wrong = (up / (1.0 + np.exp(-gate))) @ w64.T + residual
    assert scaled_error(wrong, want, scale=scale, dtype=unit_dtype) > 10 * units
    assert scaled_error(want - residual, want, scale=scale, dtype=unit_dtype) > 10 * units


@needs_compiler
def test_fused_gradients_are_the_references():
    """Gradients through the fused kernel equal those of XLA's operations."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    w = jnp.asarray(0.1 * rng.standard_normal((40, 64)), jnp.float32)
    norm = jnp.asarray(1.0 + 0.1 * rng.standard_normal(64), jnp.float32)
    r = jnp.asarray(rng.standard_normal((4, 40)), jnp.float32)

    def loss(a, b, c, d, e):
        y = linear(a, c, norm=d, eps=1e-5, residual=e) + linear(b, c, gated=True)
        return jnp.sum(jnp.sin(y))

    grads = jax.grad(loss, argnums=range(5))(x, g, w, norm, r)
    with native.xla_only():
        want = jax.grad(loss, argnums=range(5))(x, g, w, norm, r)
    for got, ref in zip(grads, want):
        assert_close_scaled(got, ref, units=PRODUCT_UNITS, scale=float(np.abs(ref).max()) * 64)


def test_dispatch_rules():
    w = jnp.zeros((8, 16), jnp.float32)
    assert not few_row_matmul.applies(jnp.zeros((17, 16)), w)  # a prefill-sized block: XLA
    assert not few_row_matmul.applies(jnp.zeros((2, 16), jnp.bfloat16), w.astype(jnp.bfloat16))
    assert not few_row_matmul.applies(jnp.zeros((0, 16)), w)
    assert not few_row_matmul.applies(jnp.zeros((2, 16)), w.astype(jnp.float16))


@needs_compiler
def test_exports_for_accelerators_keep_xlas_dot():
    x, w = jnp.zeros((6, 64)), jnp.zeros((40, 64))
    norm, residual = jnp.ones((64,)), jnp.zeros((6, 40))

    def fused(x, w, norm, residual):
        return linear(x, w, norm=norm, eps=1e-5, residual=residual)

    for platform in ("cuda", "tpu"):
        text = jax.export.export(jax.jit(linear), platforms=[platform])(x, w).mlir_module()
        assert "eaglejax_few_row_matmul" not in text and "dot_general" in text
        text = jax.export.export(jax.jit(fused), platforms=[platform])(
            x, w, norm, residual).mlir_module()
        assert "eaglejax_few_row_matmul" not in text and "rsqrt" in text
    assert few_row_matmul.TARGETS[jnp.dtype(jnp.float32)] in jax.jit(linear).lower(x, w).as_text()


def test_switch_is_validated(monkeypatch):
    monkeypatch.setenv(build.SWITCH_ENV, "0")
    assert not build.enabled()
    monkeypatch.setenv(build.SWITCH_ENV, "maybe")
    with pytest.raises(ConfigError, match=build.SWITCH_ENV):
        build.enabled()


@needs_compiler
def test_a_failed_build_names_the_command(tmp_path, monkeypatch):
    """A source that does not compile raises with the compiler's message (load() turns it
    into a warning and XLA's path), and leaves no partial library behind."""
    monkeypatch.setenv("EAGLEJAX_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="broken.cc"):
        build._build(broken, build.compiler())
    assert not list((tmp_path / "cache").rglob("*.so"))
    monkeypatch.setattr(build, "_SOURCE_DIR", tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.load("broken") is None
    assert any("broken" in str(c.message) for c in caught)


@needs_compiler
def test_the_first_kernel_asked_for_starts_every_build(tmp_path, monkeypatch):
    """A cold start builds the folder's kernels side by side: loading one has started the
    others' builds, which then load without building again."""
    monkeypatch.setenv("EAGLEJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_SOURCE_DIR", tmp_path)
    for name in ("first", "second"):
        (tmp_path / f"{name}.cc").write_text(f'extern "C" int {name}() {{ return 7; }}\n')
    assert build.load("first").first() == 7
    started = build._builds[tmp_path / "second.cc"]
    assert build.load("second").second() == 7 and started.done()
    assert len(list((tmp_path / "cache").rglob("*.so"))) == 2
