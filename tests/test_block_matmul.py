"""GGUF block storage's native product (`native.block_matmul`): the kernel against the
format's formula in float64 for Q4_0, Q4_1 and Q8_0 blocks made by the `gguf` package and
Q4_K and Q6_K super-blocks of random bytes, each row of a block against that row alone, the
prologues and residual against XLA's path, and a malformed call."""

import re

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eaglejax.models import gguf_blocks, llama
from eaglejax.models.gguf_blocks import KINDS, BlockMatrix, HostBlocks, block_scales
from eaglejax.models import quantized
from eaglejax.models.quantized import BLOCK
from eaglejax.native import block_matmul, int8_matmul
from eaglejax.native.few_row_matmul import MAX_ROWS
from tolerances import FORWARD_UNITS, assert_close_scaled, scaled_error


def kquant_bytes(kind: str, n: int, k: int, rng: np.random.Generator,
                 size: float = 0.05) -> np.ndarray:
    """Random Q4_K, Q5_K or Q6_K super-blocks of a matrix [n, k] as a file stores them:
    uint8 [n, k/256 * bytes], random bytes but for finite float16 super-scales that make
    weights of about `size` (Q6_K's d of either sign)."""
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(n, k // per_block, block_bytes), dtype=np.uint8)

    def halves(scale: float, signs: bool) -> np.ndarray:
        d = scale * rng.uniform(0.5, 1.5, size=raw.shape[:2])
        d = d * rng.choice([-1, 1], size=d.shape) if signs else d
        return d.astype(np.float16)[..., None].view(np.uint8)

    if kind in ("Q4_K", "Q5_K"):  # (d sc) q up to d 63 15 (31), dmin m up to dmin 63
        raw[..., 0:2] = halves(size / (63 * (15 if kind == "Q4_K" else 31)), False)
        raw[..., 2:4] = halves(size / 2 / 63, False)
    else:  # (d sc)(q - 32) up to d 128 32
        raw[..., 208:210] = halves(size / (128 * 32), True)
    return raw.reshape(n, -1)


def blocks_of(kind: str, n: int, k: int, rng: np.random.Generator) -> HostBlocks:
    """Random weights [n, k] quantized to `kind` by the `gguf` package (K-quants: random
    super-blocks, `kquant_bytes`), decoded from its bytes."""
    if KINDS[kind].supers:
        raw = kquant_bytes(kind, n, k, rng)
    else:
        w = rng.normal(size=(n, k)).astype(np.float32) * 0.05
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    return HostBlocks.from_file(raw, KINDS[kind], (n, k))


def formula(x: np.ndarray, blocks: HostBlocks) -> np.ndarray:
    """y[m,n] = sum_b t (sum_s d_s * sum_{k in s} (q + c) p + mn * sum_k p) in float64
    (gguf_blocks' docstring), p and t as the format quantizes x (float32 division, ties to
    even)."""
    xb = x.reshape(x.shape[0], -1, BLOCK)
    t = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)
    p = np.rint(xb / np.where(t == 0, np.float32(1), t)).astype(np.float64)
    kind, (n, k) = blocks.kind, blocks.values.shape
    scale, minimum = block_scales(kind, blocks.scales, blocks.mins, blocks.supers)
    q = blocks.values.astype(np.float64).reshape(n, -1, kind.sub) + kind.offset
    sums = np.einsum("msk,nsk->mns", p.reshape(x.shape[0], -1, kind.sub), q)
    block = (scale.astype(np.float64)[None] * sums).reshape(x.shape[0], n, k // BLOCK, -1)
    block = block.sum(-1)
    if minimum is not None:
        block = block + minimum.astype(np.float64)[None] * p.sum(-1)[:, None, :]
    return np.einsum("mnb,mb->mn", block, t[..., 0].astype(np.float64))


def reference(matrix: BlockMatrix, eps: float = 0.0, gated: bool = False):
    """XLA's path for `block_matmul.linear` (prologue, `gguf_blocks.product`, residual)."""
    def run(rows, packed, scales, mins, supers, norm, residual):
        if norm is not None:
            rows = llama.rms_norm(rows, norm, eps)
        if gated:
            gate, up = jnp.split(rows, 2, axis=-1)
            rows = jax.nn.silu(gate) * up
        y = gguf_blocks.product(rows, BlockMatrix(packed, scales, mins, supers, matrix.shape,
                                                  matrix.kind))
        return y if residual is None else residual + y
    return run


def kernel(matrix: BlockMatrix, *, norm=None, eps: float = 0.0, gated: bool = False,
           residual=None):
    """The native product as a jitted function of x."""
    ref = reference(matrix, eps, gated)
    return jax.jit(lambda x: native_linear(x, matrix, ref, norm=norm, eps=eps, gated=gated,
                                           residual=residual))


def native_linear(x, matrix: BlockMatrix, ref, **options):
    """`block_matmul.linear` of `matrix`'s flat arrays (as `models.llama.linear` calls it)."""
    flat, kind = matrix.flat(), matrix.block_kind
    return block_matmul.linear(x, flat.packed, flat.scales, flat.mins, flat.supers, ref,
                               offset=kind.offset, bits=kind.bits, **options)


@pytest.mark.parametrize("kind", list(KINDS))
def test_kernel_equals_the_formula_and_each_row_alone(kind):
    """Integer block sums are exact, so against the formula in float64 only float32
    rounding of the block scaling remains (noise units of one layer), for 1 to 16 rows
    (4-bit lines unpacked in registers up to 4 rows, once for all rows above); every row
    of a block equals that row multiplied alone, bit for bit. XLA's path is the same
    formula."""
    assert block_matmul.available()
    rng = np.random.default_rng(list(KINDS).index(kind))
    for n, k in [(48, 256), (32, 512)] if KINDS[kind].supers else [(48, 64), (64, 96)]:
        blocks = blocks_of(kind, n, k, rng)
        matrix = gguf_blocks.pack(blocks)
        x = rng.normal(size=(MAX_ROWS, k)).astype(np.float32)
        x[:, 5] *= 60.0  # an outlier: only its block's scale grows
        x[3, 32:64] = 0.0  # a block of zeros: t = 0
        product = kernel(matrix)
        alone = np.concatenate([np.asarray(product(x[i:i + 1])) for i in range(MAX_ROWS)])
        for rows in (1, 2, 3, 4, 5, 8, 12, 16):
            got = np.asarray(product(x[:rows]))
            want = formula(x[:rows], blocks)
            assert_close_scaled(got, want, units=FORWARD_UNITS, what=f"{kind} kernel")
            np.testing.assert_array_equal(got, alone[:rows])
        xla = np.asarray(jax.jit(gguf_blocks.product)(x, matrix))
        assert_close_scaled(xla, formula(x, blocks), units=FORWARD_UNITS, what=f"XLA {kind}")
        # Negative control: the float32 product of the file's weights and x unquantized is
        # far outside the check.
        wide = x.astype(np.float64) @ blocks.dequantized().astype(np.float64).T
        assert scaled_error(wide, formula(x, blocks)) > 100 * FORWARD_UNITS


def test_more_rows_than_a_call_go_in_blocks():
    """37 rows (a prefill chunk, a large serving batch) go through the weights 16 at a time:
    every row, its residual and its norm, as that row alone, bit for bit (GGUF blocks and
    int8 storage alike)."""
    assert block_matmul.available() and int8_matmul.available()
    rng = np.random.default_rng(11)
    matrix = gguf_blocks.pack(blocks_of("Q4_1", 64, 96, rng))
    x = rng.normal(size=(37, 96)).astype(np.float32)
    residual = rng.normal(size=(37, 64)).astype(np.float32)
    norm = jnp.asarray(rng.normal(size=96).astype(np.float32))
    ref = reference(matrix, 1e-5, False)
    product = jax.jit(lambda x, r: native_linear(x, matrix, ref, norm=norm, eps=1e-5,
                                                 residual=r))
    alone = np.concatenate([np.asarray(product(x[i:i + 1], residual[i:i + 1]))
                            for i in range(37)])
    np.testing.assert_array_equal(np.asarray(product(x, residual)), alone)

    int8 = quantized.quantize(rng.normal(size=(64, 96)).astype(np.float32))

    def int8_reference(rows, packed, scales, norm, residual):
        return quantized.product(rows, quantized.Int8Matrix(packed, scales, int8.shape))

    int8_product = jax.jit(lambda x: int8_matmul.linear(x, int8.packed, int8.scales,
                                                        int8_reference))
    alone = np.concatenate([np.asarray(int8_product(x[i:i + 1])) for i in range(37)])
    np.testing.assert_array_equal(np.asarray(int8_product(x)), alone)


@pytest.mark.parametrize("kind", list(KINDS))
def test_kernel_prologues_and_residual(kind):
    """RMS norm first, silu(gate) * up first, a residual after: as XLA computes them."""
    rng = np.random.default_rng(7)
    k = KINDS[kind].per_block * 3
    matrix = gguf_blocks.pack(blocks_of(kind, 64, k, rng))
    x = jnp.asarray(rng.normal(size=(6, k)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(6, 2 * k)), jnp.float32)
    norm = jnp.asarray(1.0 + 0.1 * rng.normal(size=(k,)), jnp.float32)
    residual = jnp.asarray(rng.normal(size=(6, 64)), jnp.float32)
    arrays = (matrix.packed, matrix.scales, matrix.mins, matrix.supers)
    cases = {"norm": (x, dict(norm=norm, eps=1e-5, residual=residual)),
             "gated": (gate_up, dict(gated=True, residual=residual))}
    for name, (rows, options) in cases.items():
        got = np.asarray(kernel(matrix, **options)(rows))
        eps, gated = options.get("eps", 0.0), options.get("gated", False)
        want = np.asarray(jax.jit(reference(matrix, eps, gated))(
            rows, *arrays, options.get("norm"), residual))
        assert_close_scaled(got, want, units=FORWARD_UNITS, what=f"{kind} {name}")


def xla_product_memory(product, x, matrix) -> tuple[str, int]:
    """The compiled HLO of XLA's `product(x, matrix)` and its scratch bytes."""
    compiled = jax.jit(product).lower(x, matrix).compile()
    return compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes


def test_xla_products_multiply_the_stored_int8_values():
    """XLA's products (prefill blocks, meshes, GPU/TPU) multiply the weights' int8 values in
    an s8 x s8 -> s32 dot: no float32 copy of the weight is made (scratch below one; the
    negative control, a product of the widened weight, needs one)."""
    rng = np.random.default_rng(13)
    n, k = 256, 512
    x = jnp.asarray(rng.normal(size=(3, k)), jnp.float32)
    matrices = {"int8": (quantized.product, quantized.quantize(
        rng.normal(size=(n, k)).astype(np.float32)))}
    for kind in KINDS:
        matrices[kind] = (gguf_blocks.product, gguf_blocks.pack(blocks_of(kind, n, k, rng)))
    widened = 4 * n * k
    for name, (product, matrix) in matrices.items():
        hlo, scratch = xla_product_memory(product, x, matrix)
        assert re.search(r"s32\[[0-9,]+\]\{[0-9,]+\} dot\(", hlo), name
        assert f"f32[{n},{k}]" not in hlo and scratch < widened, (name, scratch)
    _, scratch = xla_product_memory(
        lambda x, m: quantized.quantized_rows(x) @ m.dequantized().T, x, matrix)
    assert scratch >= widened


def test_xla_products_of_many_rows_are_each_row_alone():
    """More than `quantized.ROWS` rows (prefill chunks, large verify batches; 37: not a
    multiple of 16) through XLA's products: the formula in float64 (the stored weights
    times x rounded to int8 blocks of 32), as each row multiplied alone is, for int8 storage
    and 4-bit, Q4_K and Q6_K blocks."""
    rng = np.random.default_rng(17)
    rows = 37
    assert rows > quantized.ROWS
    for kind in ("int8", "Q4_1", "Q4_K", "Q6_K"):
        k = 512
        if kind == "int8":
            w = rng.normal(size=(48, k)).astype(np.float32) * 0.05
            matrix, product = quantized.quantize(w), jax.jit(quantized.product)
            oracle = np.asarray(matrix.dequantized(), np.float64)
        else:
            blocks = blocks_of(kind, 48, k, rng)
            matrix, product = gguf_blocks.pack(blocks), jax.jit(gguf_blocks.product)
            oracle = blocks.dequantized().astype(np.float64)
        x = rng.normal(size=(rows, k)).astype(np.float32)
        x[:, 5] *= 60.0  # an outlier: only its block's scale grows
        got = np.asarray(product(x, matrix))
        # the file's (or int8 storage's) weights times x rounded to int8 blocks of 32
        want = np.asarray(quantized.quantized_rows(x), np.float64) @ oracle.T
        assert_close_scaled(got, want, units=FORWARD_UNITS, what=f"XLA {kind}, {rows} rows")
        alone = np.concatenate([np.asarray(product(x[i:i + 1], matrix)) for i in range(rows)])
        assert_close_scaled(alone, want, units=FORWARD_UNITS, what=f"XLA {kind}, 1 row")


def test_xla_products_of_a_prefill_chunk_keep_the_scratch_of_a_few_rows():
    """A prefill chunk (512 rows) times Llama-3.1-8B's fused w_gate_up [28672, 4096]
    (abstract: compiled, never allocated) goes through the weights `quantized.ROWS` rows at
    a time: its scratch stays below an eighth of the block sums one call would make
    (int32 [K/32, 512, N], 7.5 GB; Q6_K's [K/16, ...] twice that). Measured: 0.65 GB for
    int8, 0.70 GB for Q4_1, 1.15 GB for Q6_K; 15 and 30 GB in one call."""
    n, k, rows = 28672, 4096, 512
    x = jax.ShapeDtypeStruct((rows, k), jnp.float32)
    matrices = {"int8": (quantized.product, quantized.Int8Matrix.abstract((n, k)), BLOCK)}
    for kind in ("Q4_1", "Q6_K"):
        matrices[kind] = (gguf_blocks.product,
                          BlockMatrix.abstract((n, k), kind).restored(), KINDS[kind].sub)
    for name, (product, matrix, sub) in matrices.items():
        one_call = 4 * (k // sub) * rows * n
        _, scratch = xla_product_memory(product, x, matrix)
        assert scratch < one_call / 8, (name, scratch, one_call)


def test_malformed_call_is_refused():
    """A 4-bit matrix's arrays called as 8-bit, and a Q6_K matrix's without its supers: the
    scales do not match, and the kernel says what it expects."""
    rng = np.random.default_rng(3)
    q4_1 = gguf_blocks.pack(blocks_of("Q4_1", 48, 64, rng))
    q6_k = gguf_blocks.pack(blocks_of("Q6_K", 48, 256, rng))
    empty = jnp.zeros((0,), jnp.float16)
    for matrix, bits, supers in ((q4_1, 8, q4_1.supers), (q6_k, 6, empty)):
        out = jax.ShapeDtypeStruct((2, 48), jnp.float32)
        call = jax.jit(lambda x: jax.ffi.ffi_call(block_matmul.TARGET, out)(
            x, matrix.packed, matrix.scales, matrix.mins, supers, jnp.zeros((0,), jnp.float32),
            jnp.zeros((0,), jnp.float32), prologue=np.int32(0), eps=np.float32(0),
            offset=np.int32(0), bits=np.int32(bits)))
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"scales float16 \[N/16,K/32,16\]"):
            jax.block_until_ready(call(jnp.ones((2, matrix.shape[-1]), jnp.float32)))
