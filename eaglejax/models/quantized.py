"""Int8 weight storage whose products run on int8 activations (W8A8), as llama.cpp runs its
quantized types on CPUs.

A matrix w [N, K] is stored as int8 values q with one float32 scale per output row:
s[n] = max|w[n]| / 127, q = round(w / s). A product quantizes each row of x in blocks of
`BLOCK` (32) values, t[m, b] = max|x[m, b]| / 127 and p = round(x / t), and sums

    y[m, n] = s[n] * sum_b t[m, b] * sum_{k in b} p[m, k] q[n, k]

with the block sums in integers (exact). The native CPU kernel (`native.int8_matmul`)
multiplies 4 int8 pairs per 32-bit lane in one instruction (AVX-512 VNNI), so a verify
block of 8-12 rows costs little more than one row: the weight stream, a quarter of
float32's, bounds it. Blocks of 32 are what llama.cpp quantizes activations to (Q8_0);
one scale per row of x instead (a single int8 product) lost 12% top-1 agreement with
float32 on SmolLM2-135M, blocks of 32 5% (per-row weights alone: 4%; BENCHMARKS.md).
Each row is quantized on its own, so a verify block reproduces the single-token step.

XLA's product (`product`: meshes, GPU/TPU, and CPUs without the kernel) multiplies the same
int8 values without widening them: an s8 x s8 -> s32 dot batched over the blocks of 32
(`block_sums`) gives the integer block sums [K/32, M, N], then scaled and summed over the
blocks in float32. Those sums cost 4 N K / 32 bytes a row of x (an eighth of the int8
weights: 14.7 MB for Llama-3.1-8B's w_gate_up), so more than `ROWS` rows (prefill chunks,
large verify batches) go through the weights `ROWS` at a time, as the native kernels do
(`in_row_chunks`): the scratch stays that of `ROWS` rows whatever M (a 512-row prefill
chunk of that matrix compiles to 0.6 GB of scratch on CPU instead of 15 GB), every row's
values stay what it gets alone, and every product stays an integer dot. Where XLA does not
fuse the unpacking into the dot, the int8 values themselves are scratch too.

The values are kept in the kernel's layout: tiles of `TILE` (16) output rows, each 4
consecutive k of the 16 rows in one 64-byte line, offset by 128 (unsigned, as the
instruction reads them): packed[N/16, K/4, 16, 4] = q + 128. Matrices whose shape does not
tile (N % 16 or K % 32 not 0) stay wide. On a mesh the same bytes take their `split` form,
the rows in the matrix's logical leading dims, so that they shard by its logical axes with
their scales (`models.placement.TargetPlacement.place_quantized`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # x values sharing one scale
TILE = 16  # output rows per packed tile (one 512-bit register of int32 sums)
OFFSET = 128  # stored values are q + OFFSET
ROWS = 16  # rows of x that XLA's products multiply at once (`in_row_chunks`)


class QuantizedMatrix:
    """A matrix stored quantized whose products run on int8 activations: `Int8Matrix`, or a
    GGUF file's blocks kept as stored (`models.gguf_blocks.BlockMatrix`). Its storage is
    [N, K] whatever its logical `shape` [..., K] (N the product of the leading dims), its
    arrays' rows either in one dim of N/16 tiles (`flat`: what the products, the native
    kernels and checkpoints read) or in the logical leading dims with the last in tiles
    (`split`: what a mesh shards by the matrix's logical axes); the bytes are the same."""

    shape: tuple[int, ...]

    def rebuilt(self, arrays: list[jax.Array], shape: tuple[int, ...]) -> "QuantizedMatrix":
        """A matrix of this class and kind from storage arrays (`tree_flatten`'s order)."""
        raise NotImplementedError

    def arranged(self, rows: tuple[int, ...]) -> "QuantizedMatrix":
        """The same storage with its arrays' row dims (those before a tile's) as `rows`."""
        raise NotImplementedError

    def flat(self) -> "QuantizedMatrix":
        """The storage with its rows in one dim of N/16 tiles."""
        return self.arranged((math.prod(self.shape[:-1]) // TILE,))

    def split(self) -> "QuantizedMatrix":
        """The storage with its rows in the logical leading dims, the last in tiles (e.g.
        `w_gate_up` [2, I, H]: packed [2, I/16, ...]); ValueError unless shape[-2] is a
        multiple of 16."""
        if self.ndim < 2 or self.shape[-2] % TILE:
            raise ValueError(f"a quantized matrix {self.shape} splits its rows by its leading "
                             f"dims only where the last of them is a multiple of {TILE}")
        return self.arranged((*self.shape[:-2], self.shape[-2] // TILE))

    def savable(self) -> "QuantizedMatrix":
        """This matrix as a checkpoint saves it (`flat`); `restored` undoes what it adds."""
        return self.flat()

    def restored(self) -> "QuantizedMatrix":
        """A matrix as `savable` left it, whole again."""
        return self

    def __getitem__(self, index: int) -> "QuantizedMatrix":
        """The matrix at `index` of the leading dim (`w_gate_up[0]`: the gate projection),
        taken from the `split` storage."""
        if self.ndim < 3 or not isinstance(index, int):
            raise TypeError(f"a quantized matrix {self.shape} is indexed by one int on a "
                            f"leading dim of a 3-D or larger shape, got {index!r}")
        arrays = self.split().tree_flatten()[0]
        return self.rebuilt([a[index] if a.ndim > 1 else a for a in arrays], self.shape[1:])

    @property
    def k_block(self) -> int:
        """Weights along K that the storage's arrays keep together (a mesh splits K only
        between them)."""
        return BLOCK

    @property
    def dtype(self) -> jnp.dtype:
        """int8: what the products multiply."""
        return jnp.dtype(jnp.int8)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshaped(self, *shape: int) -> tuple[int, ...]:
        """Another logical shape of the same storage (`reshape`'s arguments, -1 allowed):
        the same last dim K and the same N."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        rows = math.prod(self.shape[:-1])
        shape = tuple(rows // math.prod(d for d in shape[:-1] if d != -1) if d == -1 else d
                      for d in shape)
        if shape[-1] != self.shape[-1] or math.prod(shape[:-1]) != rows:
            raise ValueError(f"a quantized matrix {self.shape} keeps its last dim: cannot "
                             f"reshape to {shape}")
        return shape


@jax.tree_util.register_pytree_node_class
class Int8Matrix(QuantizedMatrix):
    """A matrix [..., K] in int8 storage (module docstring): `packed` uint8
    [N/16, K/4, 16, 4] and `scales` float32 [N], N the product of the leading dims of
    `shape` (the logical shape; `reshape` may merge or split its leading dims); `split`:
    packed [*shape[:-2], shape[-2]/16, K/4, 16, 4] and scales [*shape[:-1]]."""

    def __init__(self, packed: jax.Array, scales: jax.Array, shape: tuple[int, ...]):
        self.packed, self.scales, self.shape = packed, scales, tuple(shape)

    def tree_flatten(self):
        return (self.packed, self.scales), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children):
        return cls(*children, shape)

    def rebuilt(self, arrays: list[jax.Array], shape: tuple[int, ...]) -> "Int8Matrix":
        return Int8Matrix(*arrays, shape)

    def arranged(self, rows: tuple[int, ...]) -> "Int8Matrix":
        return Int8Matrix(self.packed.reshape(*rows, *self.packed.shape[-3:]),
                          self.scales.reshape(*rows[:-1], rows[-1] * TILE), self.shape)

    @classmethod
    def abstract(cls, shape: tuple[int, ...]) -> "Int8Matrix":
        """The storage of a matrix of `shape` as shapes and dtypes only (what a saved
        checkpoint restores into)."""
        n, k = math.prod(shape[:-1]), shape[-1]
        return cls(jax.ShapeDtypeStruct((n // TILE, k // 4, TILE, 4), jnp.uint8),
                   jax.ShapeDtypeStruct((n,), jnp.float32), shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.packed.shape) + 4 * math.prod(self.scales.shape)

    def reshape(self, *shape: int) -> "Int8Matrix":
        """The same storage (`flat`) under another logical shape with the same last dim."""
        flat = self.flat()
        return Int8Matrix(flat.packed, flat.scales, self.reshaped(*shape))

    def tile_values(self) -> jax.Array:
        """q as int8 in the tile layout [N/16, K/4, 16, 4]."""
        return (self.flat().packed.astype(jnp.int16) - OFFSET).astype(jnp.int8)

    def values(self) -> jax.Array:
        """q as int8 [N, K]."""
        q = self.tile_values()
        return q.transpose(0, 2, 1, 3).reshape(q.shape[0] * TILE, -1)

    def dequantized(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """s * q in `dtype`, in the logical shape."""
        wide = self.values().astype(jnp.float32) * self.flat().scales[:, None]
        return wide.astype(dtype).reshape(self.shape)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Dequantized float32 rows [..., K] for row ids (clamped to the matrix): an
        embedding table's lookup, reading only those rows."""
        flat = self.flat()
        ids = jnp.clip(ids, 0, flat.scales.shape[0] - 1)
        q = flat.packed[ids // TILE, :, ids % TILE, :]  # [..., K/4, 4]
        q = q.reshape(*ids.shape, -1).astype(jnp.float32) - OFFSET
        return q * flat.scales[ids][..., None]

    def __repr__(self) -> str:
        return f"Int8Matrix(shape={self.shape})"


def any_int8(params: Any) -> bool:
    """Whether any leaf of the pytree `params` multiplies int8 activations (a
    `QuantizedMatrix`)."""
    return any(map(is_int8, jax.tree.leaves(params, is_leaf=is_int8)))


def is_int8(leaf: Any) -> bool:
    """Whether a pytree leaf is a `QuantizedMatrix` (`is_leaf` for maps that keep them
    whole)."""
    return isinstance(leaf, QuantizedMatrix)


def tiles(shape: tuple[int, ...]) -> bool:
    """Whether a matrix of `shape` can be stored in int8 (N % 16 == K % 32 == 0)."""
    return len(shape) >= 2 and math.prod(shape[:-1]) % TILE == 0 and shape[-1] % BLOCK == 0


def quantize(weight: Any, host: bool = False) -> Int8Matrix:
    """`weight` [..., K] (N % 16 == K % 32 == 0: `tiles`) in int8 storage, rounded to
    nearest (ties to even) with per-row scales; computed on the host in float32, its arrays
    put on the default device (`host`: kept numpy arrays, for placing on a mesh)."""
    w = np.asarray(jax.device_get(weight), np.float32)
    if not tiles(w.shape):
        raise ValueError(f"int8 storage needs rows in multiples of {TILE} and a last dim "
                         f"in multiples of {BLOCK}, got a matrix {w.shape}")
    rows = w.reshape(-1, w.shape[-1])
    n, k = rows.shape
    scales = np.abs(rows).max(axis=1) / np.float32(127)
    q = np.rint(rows / np.where(scales == 0, 1, scales)[:, None]).astype(np.int16)
    packed = (q + OFFSET).astype(np.uint8).reshape(n // TILE, TILE, k // 4, 4).transpose(0, 2, 1, 3)
    matrix = Int8Matrix(np.ascontiguousarray(packed), scales, w.shape)
    return matrix if host else jax.tree.map(jnp.asarray, matrix)


def quantized_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., K] quantized per block of `BLOCK` values as the products read it: p int8
    [..., K/32, 32] and t float32 [..., K/32], p = round(x / t), t = max|x| / 127."""
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=-1) / 127
    p = jnp.round(blocks / jnp.where(scale == 0, 1, scale)[..., None])
    return p.astype(jnp.int8), scale


def quantized_rows(x: jax.Array) -> jax.Array:
    """x [..., K] as its products read it: p * t per block of `BLOCK` values (float32)."""
    p, t = quantized_blocks(x)
    return (p.astype(jnp.float32) * t[..., None]).reshape(x.shape)


def block_sums(p: jax.Array, values: jax.Array, width: int = BLOCK) -> jax.Array:
    """The integer sums sum_{k in b} p[m, k] q[n, k] of every block b of `width` (a multiple
    of 4 dividing 32) values, int32 [K/width, M, N]: p int8 [M, K/32, 32]
    (`quantized_blocks`) and the weights' values q int8 in the tile layout
    [N/16, K/4, 16, 4], multiplied as they are (an s8 x s8 -> s32 dot, batched over the
    blocks: no float copy of the weights is made)."""
    n_tiles, groups = values.shape[:2]
    blocks = groups * 4 // width
    lhs = p.reshape(p.shape[0], blocks, width // 4, 4)
    rhs = values.reshape(n_tiles, blocks, width // 4, TILE, 4)
    sums = jax.lax.dot_general(lhs, rhs, (((2, 3), (2, 4)), ((1,), (1,))),
                               preferred_element_type=jnp.int32)  # [K/32, M, N/16, 16]
    return sums.reshape(blocks, p.shape[0], n_tiles * TILE)


def in_row_chunks(rows_times: Callable[[jax.Array], jax.Array], rows: jax.Array) -> jax.Array:
    """`rows_times(rows)` [M, N] for rows [M, K], computed at most `ROWS` rows at a time: in
    one call up to `ROWS` rows, else over chunks of `ROWS` (`lax.map`; rows padded with
    zeros), so that the scratch of a product is bounded whatever M. Chunk c holds rows c,
    c + C, c + 2C, ... (C chunks): rows split over a mesh's data axis stay split inside each
    chunk, and the loop runs over an axis no device holds a part of."""
    m, k = rows.shape
    if m <= ROWS:
        return rows_times(rows)
    count = -(-m // ROWS)
    padded = jnp.pad(rows, ((0, ROWS * count - m), (0, 0)))
    chunks = padded.reshape(ROWS, count, k).swapaxes(0, 1)  # [C, ROWS, K]
    y = jax.lax.map(rows_times, chunks)  # [C, ROWS, N]
    return y.swapaxes(0, 1).reshape(ROWS * count, -1)[:m]


def product(x: jax.Array, weight: Int8Matrix) -> jax.Array:
    """x [..., K] times an int8 `weight` [N, K]^T with XLA's operations, in x's dtype: the
    block sums in integers (`block_sums`), scaled by t and s and summed over the blocks in
    float32 (the native kernel's values up to float32 rounding; prefill blocks, meshes and
    other platforms), `ROWS` rows at a time (`in_row_chunks`)."""
    values, scales = weight.tile_values(), weight.flat().scales

    def rows_times(rows: jax.Array) -> jax.Array:
        p, t = quantized_blocks(rows)
        sums = block_sums(p, values)
        return jnp.sum(sums.astype(jnp.float32) * t.T[:, :, None], axis=0) * scales

    y = in_row_chunks(rows_times, x.reshape(-1, x.shape[-1]))
    return y.reshape(*x.shape[:-1], -1).astype(x.dtype)
