"""GGUF block storage kept as the file stores it (Q4_0, Q4_1, Q8_0 and the K-quants Q4_K,
Q6_K), products on int8 activations as llama.cpp computes them on CPUs.

A GGUF block holds 32 consecutive weights of one row: a float16 scale d, for Q4_1 a float16
minimum m, and 32 stored values q (4 or 8 bits). The weights are exactly

    Q4_0: d * (q - 8)      Q4_1: d * q + m      Q8_0: d * q   (q signed for Q8_0)

A K-quant super-block holds 256 weights of one row (`models.gguf_kquants` reads its bytes):
float16 super-scales and integer scales of sub-blocks of 32 (Q4_K) or 16 (Q6_K), with

    Q4_K: (d * sc) * q - dmin * m  (sc, m 6-bit; q 4-bit)    Q6_K: (d * sc) * (q - 32)
                                                              (sc int8; q 6-bit)

(each product exact in float32: the `gguf` package's float32 dequantization). Every kind is
thus a scale s per sub-block of 16 or 32 (d, or d * sc) and for Q4_1 / Q4_K a minimum mn per
block of 32 (m, or -dmin * m). A product never forms the weights: x is quantized per row and
block of 32 as int8 storage's products do (`models.quantized.quantized_rows`: p = round(x /
t), t = max|x| / 127), and

    y[i, n] = sum_b t[i, b] * (sum_{s in b} s[n, s] * sum_{k in s} (q[n, k] + c) p[i, k]
                               + mn[n, b] * sum_{k in b} p[i, k])

with c = -8, 0, -128 (Q8_0's values are stored offset by 128, unsigned) or -32 and the sums
over a sub-block in integers: the file's exact weights times x rounded to int8 blocks of 32
(the native kernel `native.block_matmul` in registers; `product` with XLA's operations, the
values unpacked to int8 and the sub-block sums an s8 x s8 -> s32 dot:
`models.quantized.block_sums`). A step reads 4.5 / 5 / 8.5 / 4.625 / 6.5625 bits a weight.

Layout (the kernel's): tiles of 16 output rows; each 4 consecutive k of the 16 rows form one
64-byte line of unsigned bytes (as AVX-512 VNNI reads them). 8-bit values: packed
[N/16, K/4, 16, 4] (q + 128). 4-bit values: two lines share 64 bytes, group 2j in the low
nibbles and group 2j + 1 in the high ones: packed [N/16, K/8, 16, 4]. 6-bit values: per
block of 32, its low 4 bits as 4-bit values are packed (4 lines) and then their high 2 bits
in 2 lines, groups 4i..4i + 3 of the block in line i at bits 0, 2, 4, 6: packed
[N/16, 6 K/32, 16, 4]. Scales: float16 [N/16, K/32, 16] (Q4_0, Q4_1, Q8_0), the integer sc
of Q4_K (uint8 [N/16, K/32, 16]) and Q6_K (int8 [N/16, K/16, 16]); minimums: float16
[N/16, K/32, 16] (Q4_1), Q4_K's integer m (uint8, the same shape), else empty ([0]); supers:
a K-quant's float16 [N/16, K/256, 2, 16] (d, dmin: Q4_K) or [N/16, K/256, 1, 16] (d: Q6_K),
else empty.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.models import gguf_kquants
from eaglejax.models.quantized import (
    BLOCK, TILE, QuantizedMatrix, block_sums, in_row_chunks, is_int8, quantized_blocks)

SUPER = gguf_kquants.SUPER


@dataclasses.dataclass(frozen=True)
class BlockKind:
    """One GGUF block type: its name, bits a stored value, the offset c of the formula,
    whether blocks carry a minimum, bytes and weights of one block in a file, weights per
    scale (`sub`), float16 super-scales per super-block (`supers`: 0 for 32-weight kinds)
    and the dtype of its scales (and minimums) as kept."""

    name: str
    bits: int
    offset: int
    has_min: bool
    block_bytes: int
    per_block: int = BLOCK
    sub: int = BLOCK
    supers: int = 0
    scale_dtype: str = "float16"


KINDS: dict[str, BlockKind] = {
    "Q4_0": BlockKind("Q4_0", 4, -8, False, 18),
    "Q4_1": BlockKind("Q4_1", 4, 0, True, 20),
    "Q8_0": BlockKind("Q8_0", 8, -128, False, 34),
    "Q4_K": BlockKind("Q4_K", 4, 0, True, 144, SUPER, BLOCK, 2, "uint8"),
    "Q6_K": BlockKind("Q6_K", 6, -32, False, 210, SUPER, 16, 1, "int8"),
}


def block_scales(kind: BlockKind, scales: Any, mins: Any, supers: Any
                 ) -> tuple[Any, Any]:
    """The float32 scale s of every sub-block [..., K/sub] and minimum mn of every block of
    32 [..., K/32] (None without) from a matrix's kept scales [..., K/sub], minimums
    [..., K/32] and supers [..., K/256, c], rows first (numpy or JAX arrays):
    d * sc and -(dmin * m) for the K-quants, each exact."""
    if not kind.supers:
        return scales.astype(np.float32), mins.astype(np.float32) if kind.has_min else None

    def times(column: int, ints: Any) -> Any:  # a super-scale times its sub-blocks' ints
        per = ints.reshape(*ints.shape[:-1], supers.shape[-2], -1)
        return (supers[..., column:column + 1].astype(np.float32)
                * per.astype(np.float32)).reshape(ints.shape)

    return times(0, scales), -times(1, mins) if kind.has_min else None


def weights(kind: BlockKind, q: Any, scale: Any, minimum: Any) -> Any:
    """Float32 weights [..., K] from values q + c [..., K] (float32) and `block_scales`."""
    w = scale[..., None] * q.reshape(*scale.shape, -1)
    if minimum is not None:
        w = w.reshape(*minimum.shape, -1) + minimum[..., None]
    return w.reshape(q.shape)


def unpacked_lines(packed: Any, bits: int) -> Any:
    """Stored values uint8 [..., K/4, J, 4] from the kernel's lines [..., K bits/32, J, 4]
    (module docstring; J = 16 for a tile's rows)."""
    if bits == 8:
        return packed
    lead, (lines, j, _) = packed.shape[:-3], packed.shape[-3:]
    if bits == 4:
        q = jnp.stack([packed & 0x0F, packed >> 4], axis=-3)  # [..., K/8, 2, J, 4]
        return q.reshape(*lead, 2 * lines, j, 4)
    blocks = packed.reshape(*lead, lines // 6, 6, j, 4)
    nibbles, crumbs = blocks[..., :4, :, :], blocks[..., 4:, :, :]
    low = jnp.stack([nibbles & 0x0F, nibbles >> 4], axis=-3)  # [..., K/32, 4, 2, J, 4]
    high = jnp.stack([(crumbs >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-3)
    q = low.reshape(*lead, -1, 8, j, 4) | (high.reshape(*lead, -1, 8, j, 4) << 4)
    return q.reshape(*lead, lines // 6 * 8, j, 4)


def packed_lines(q: np.ndarray, bits: int) -> np.ndarray:
    """`unpacked_lines`' inverse: values uint8 [T, K/4, 16, 4] in the kernel's lines."""
    t, groups = q.shape[:2]
    if bits == 4:  # groups 2j (low nibble) and 2j + 1 (high) share a line
        q = q.reshape(t, groups // 2, 2, TILE, 4)
        return q[:, :, 0] | (q[:, :, 1] << 4)
    if bits == 6:  # per block of 32: its low nibbles as 4-bit lines, then 2 lines of crumbs
        blocks = q.reshape(t, groups // 8, 8, TILE, 4)
        low = blocks & 0x0F
        nibbles = low[:, :, 0::2] | (low[:, :, 1::2] << 4)
        high = (blocks >> 4).reshape(t, groups // 8, 2, 4, TILE, 4)
        crumbs = sum(high[:, :, :, s] << (2 * s) for s in range(4)).astype(np.uint8)
        return np.concatenate([nibbles, crumbs], axis=2).reshape(t, groups // 8 * 6, TILE, 4)
    return q


@dataclasses.dataclass
class HostBlocks:
    """A GGUF matrix's blocks decoded on the host, rows kept in order: `values` uint8 [N, K]
    (q, or q + 128 for Q8_0), `scales` [N, K/sub] and `mins` [N, K/32] (None where the kind
    has none) in the kind's scale dtype, `supers` float16 [N, K/256, c] (None but for
    K-quants). Leading dims of all may be reshaped together."""

    kind: BlockKind
    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None
    supers: np.ndarray | None = None

    @classmethod
    def from_file(cls, raw: np.ndarray, kind: BlockKind, shape: tuple[int, int]) -> "HostBlocks":
        """A matrix [N, K] from a GGUF tensor's bytes (`raw` uint8, N rows of K/per_block
        blocks)."""
        n, k = shape
        blocks = np.ascontiguousarray(raw, np.uint8).reshape(n, k // kind.per_block,
                                                             kind.block_bytes)
        if kind.name == "Q4_K":
            return cls(kind, *gguf_kquants.q4_k(blocks))
        if kind.name == "Q6_K":
            q, scales, supers = gguf_kquants.q6_k(blocks)
            return cls(kind, q, scales, None, supers)
        scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if kind.has_min else None
        q = blocks[..., 2 + 2 * kind.has_min:]
        if kind.bits == 4:  # value j < 16 in the low nibble of byte j, j >= 16 in the high
            q = np.concatenate([q & 0x0F, q >> 4], axis=-1)
        else:
            q = (q.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return cls(kind, q.reshape(n, k), scales, mins)

    def map(self, fn: Callable[..., np.ndarray], *others: "HostBlocks") -> "HostBlocks":
        """`fn` applied to the values, scales, minimums and supers of this and `others` (of
        one kind) alike: row reshapes, permutations, concatenations."""
        parts = (self, *others)
        if len({p.kind for p in parts}) != 1:
            raise ValueError(f"cannot combine blocks of kinds {[p.kind.name for p in parts]}")

        def mapped(name: str) -> np.ndarray | None:
            arrays = [getattr(p, name) for p in parts]
            return None if arrays[0] is None else fn(*arrays)

        return HostBlocks(self.kind, *map(mapped, ("values", "scales", "mins", "supers")))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def dequantized(self) -> np.ndarray:
        """The weights in float32, as the `gguf` package computes them."""
        q = self.values.astype(np.float32) + np.float32(self.kind.offset)
        return weights(self.kind, q, *block_scales(self.kind, self.scales, self.mins,
                                                    self.supers))


def _empty() -> jax.Array:
    return jnp.zeros((0,), jnp.float16)


@jax.tree_util.register_pytree_node_class
class BlockMatrix(QuantizedMatrix):
    """A matrix [..., K] kept in GGUF blocks (module docstring): `packed` uint8 in the
    kernel's layout, `scales`, `mins` and `supers` per tile (empty [0] where the kind has
    none), N the product of the leading dims of `shape` (the logical shape); `split`: the
    leading [N/16] of each as [*shape[:-2], shape[-2]/16]."""

    def __init__(self, packed: jax.Array, scales: jax.Array, mins: jax.Array,
                 supers: jax.Array, shape: tuple[int, ...], kind: str):
        self.packed, self.scales, self.mins, self.supers = packed, scales, mins, supers
        self.shape, self.kind = tuple(shape), kind

    def tree_flatten(self):
        return (self.packed, self.scales, self.mins, self.supers), (self.shape, self.kind)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def rebuilt(self, arrays: list[jax.Array], shape: tuple[int, ...]) -> "BlockMatrix":
        return BlockMatrix(*arrays, shape, self.kind)

    def arranged(self, rows: tuple[int, ...]) -> "BlockMatrix":
        def rearranged(a: jax.Array, tile_dims: int) -> jax.Array:
            return a if a is None or a.ndim == 1 else a.reshape(*rows, *a.shape[-tile_dims:])

        return BlockMatrix(rearranged(self.packed, 3), rearranged(self.scales, 2),
                           rearranged(self.mins, 2), rearranged(self.supers, 3), self.shape,
                           self.kind)

    @classmethod
    def abstract(cls, shape: tuple[int, ...], kind: str) -> "BlockMatrix":
        """The storage of a matrix of `shape` in blocks of `kind` as shapes and dtypes only,
        as a checkpoint saves it (`savable`: no empty minimums or supers)."""
        n, k, bk = math.prod(shape[:-1]), shape[-1], KINDS[kind]
        tiles_ = n // TILE

        def struct(*dims: int, dtype: Any = bk.scale_dtype) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct((tiles_, *dims), jnp.dtype(dtype))

        return cls(struct(k * bk.bits // 32, TILE, 4, dtype=jnp.uint8), struct(k // bk.sub, TILE),
                   struct(k // BLOCK, TILE) if bk.has_min else None,
                   struct(k // SUPER, bk.supers, TILE, dtype=jnp.float16) if bk.supers
                   else None, shape, kind)

    def savable(self) -> "BlockMatrix":
        """This matrix as a checkpoint saves it: `flat`, the empty minimums and supers of a
        kind without them left out (orbax saves no zero-size array); `restored` puts them
        back."""
        flat, kind = self.flat(), self.block_kind
        return BlockMatrix(flat.packed, flat.scales, flat.mins if kind.has_min else None,
                           flat.supers if kind.supers else None, self.shape, self.kind)

    def restored(self) -> "BlockMatrix":
        """A matrix as `savable` left it, whole again."""
        return BlockMatrix(self.packed, self.scales,
                           _empty() if self.mins is None else self.mins,
                           _empty() if self.supers is None else self.supers, self.shape,
                           self.kind)

    @property
    def block_kind(self) -> BlockKind:
        return KINDS[self.kind]

    @property
    def k_block(self) -> int:
        """Weights along K that the storage's arrays keep together (a mesh splits K only
        between them): 256 for K-quants, else 32."""
        return self.block_kind.per_block

    @property
    def nbytes(self) -> int:
        return sum(math.prod(a.shape) * a.dtype.itemsize
                   for a in (self.packed, self.scales, self.mins, self.supers))

    def reshape(self, *shape: int) -> "BlockMatrix":
        """The same storage (`flat`) under another logical shape with the same last dim."""
        flat = self.flat()
        return BlockMatrix(flat.packed, flat.scales, flat.mins, flat.supers,
                           self.reshaped(*shape), self.kind)

    def tile_values(self) -> jax.Array:
        """The stored values q + c as int8 (c the kind's offset) in the tile layout
        [N/16, K/4, 16, 4]."""
        q = unpacked_lines(self.flat().packed, self.block_kind.bits)
        return (q.astype(jnp.int16) + self.block_kind.offset).astype(jnp.int8)

    def values(self) -> jax.Array:
        """The stored values q + c as int8 [N, K] (c the kind's offset)."""
        q = self.tile_values()
        return q.transpose(0, 2, 1, 3).reshape(q.shape[0] * TILE, -1)

    def row_scales(self) -> tuple[jax.Array, jax.Array | None]:
        """`block_scales` of every row: float32 [N, K/sub] and [N, K/32] (or None)."""
        flat = self.flat()

        def per_row(a: jax.Array) -> jax.Array:  # [N/16, X, ..., 16] -> [N, X, ...]
            return a if a.ndim == 1 else jnp.moveaxis(a, -1, 1).reshape(-1, *a.shape[1:-1])

        return block_scales(self.block_kind, per_row(flat.scales), per_row(flat.mins),
                            per_row(flat.supers))

    def dequantized(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The file's weights in `dtype`, in the logical shape (float32: the values the `gguf`
        package's dequantization gives)."""
        w = weights(self.block_kind, self.values().astype(jnp.float32), *self.row_scales())
        return w.reshape(self.shape).astype(dtype)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Dequantized float32 rows [..., K] for row ids (clamped): an embedding lookup that
        reads only those rows."""
        n = math.prod(self.shape[:-1])
        ids = jnp.clip(ids, 0, n - 1)
        tile, lane = ids // TILE, ids % TILE
        kind, flat = self.block_kind, self.flat()
        q = unpacked_lines(flat.packed[tile, :, lane, :][..., None, :], kind.bits)
        q = q.reshape(*ids.shape, -1).astype(jnp.float32) + kind.offset

        def gathered(a: jax.Array) -> jax.Array:
            return a if a.ndim == 1 else a[tile, ..., lane]

        return weights(kind, q, *block_scales(kind, gathered(flat.scales),
                                               gathered(flat.mins), gathered(flat.supers)))

    def __repr__(self) -> str:
        return f"BlockMatrix({self.kind}, shape={self.shape})"


def tiles(shape: tuple[int, ...], per_block: int = BLOCK) -> bool:
    """Whether a matrix of `shape` fits the kernel's layout (N % 16 == 0, K a multiple of
    `per_block`: 32, or a K-quant's 256)."""
    return len(shape) >= 2 and math.prod(shape[:-1]) % TILE == 0 and shape[-1] % per_block == 0


def pack(blocks: HostBlocks, host: bool = False) -> BlockMatrix:
    """`blocks` (values [..., K], any leading dims; N % 16 == 0) in the kernel's layout, its
    arrays on the default device (`host`: numpy arrays, for placing on a mesh)."""
    shape, kind = blocks.values.shape, blocks.kind
    if not tiles(shape, kind.per_block):
        raise ValueError(f"GGUF block storage needs rows in multiples of {TILE} and a last "
                         f"dim in multiples of {kind.per_block}, got a matrix {shape}")
    n, k = math.prod(shape[:-1]), shape[-1]
    q = blocks.values.reshape(n // TILE, TILE, k // 4, 4).transpose(0, 2, 1, 3)

    def per_tile(a: np.ndarray | None, trailing: int = 1) -> np.ndarray:
        """[*rows, X, ...] (`trailing` dims after the rows) -> [N/16, X, ..., 16]."""
        if a is None:
            return np.zeros((0,), np.float16)
        a = a.reshape(n // TILE, TILE, *a.shape[a.ndim - trailing:])
        return np.ascontiguousarray(np.moveaxis(a, 1, -1))

    mins = None if blocks.mins is None else blocks.mins.astype(kind.scale_dtype)
    matrix = BlockMatrix(np.ascontiguousarray(packed_lines(q, kind.bits), np.uint8),
                         per_tile(blocks.scales.astype(kind.scale_dtype)), per_tile(mins),
                         per_tile(blocks.supers, 2), shape, kind.name)
    return matrix if host else jax.tree.map(jnp.asarray, matrix)


# `weight_dtype` names of 4-bit storage quantized from a float model -> the block kind kept
INT4_KINDS = {"int4": "Q4_1", "int4-sym": "Q4_0"}
# The kind 4-bit storage keeps a vocabulary matrix in (embedding, output head), as llama.cpp's
# 4-bit files keep theirs in 8 bits or more: on SmolLM2 a 4-bit tied embedding alone took
# teacher-forced top-1 agreement with float32 from 97% to 87% (BENCHMARKS.md, session 41).
VOCABULARY_KIND = "Q8_0"


def quantize(weight: Any, kind: str = "Q4_1", host: bool = False) -> BlockMatrix:
    """`weight` [..., K] (`tiles`) in blocks of 32, computed on the host in float32
    (`host`: `pack`'s). Q4_1 (weight_dtype "int4"), a scale and a minimum: per block
    m = min w, d = (max w - m) / 15, both rounded to float16 first, then
    q = round((w - m) / d) in [0, 15]; |w - (d q + m)| <= d / 2 plus float16's rounding of
    m. Q4_0 ("int4-sym"), a scale alone: w = d (q - 8) with q in [0, 15], d of either sign
    (float16) the smaller in size of max(hi / 7, -lo / 8) and -max(-lo / 7, hi / 8) (lo, hi:
    the block's extremes; llama.cpp takes extreme / -8, which may clip the other side by a
    whole step), so |w - d (q - 8)| <= |d| / 2 up to float16's rounding of d. Q8_0 (4-bit
    storage's vocabulary matrices, `VOCABULARY_KIND`): w = d q, d = max |w| / 127 (float16),
    q in [-127, 127]."""
    w = np.asarray(jax.device_get(weight), np.float32)
    if kind not in (*INT4_KINDS.values(), VOCABULARY_KIND):
        raise ValueError(f"block storage of a float matrix is Q4_1, Q4_0 or Q8_0, got {kind!r}")
    if not tiles(w.shape):
        raise ValueError(f"block storage needs rows in multiples of {TILE} and a last dim in "
                         f"multiples of {BLOCK}, got a matrix {w.shape}")
    blocks = w.reshape(*w.shape[:-1], -1, BLOCK)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    mins, top = None, 15
    if kind == "Q4_1":
        mins = low.astype(np.float16)
        scales = ((high - low) / np.float32(15)).astype(np.float16)
        base = mins.astype(np.float32)[..., None]
    elif kind == "Q4_0":
        up, down = np.maximum(high / 7, -low / 8), np.maximum(-low / 7, high / 8)
        scales = np.where(down < up, -down, up).astype(np.float16)
        base = np.float32(-8) * scales.astype(np.float32)[..., None]
    else:  # Q8_0, kept as q + 128
        scales = (np.maximum(high, -low) / np.float32(127)).astype(np.float16)
        base, top = np.float32(-128) * scales.astype(np.float32)[..., None], 255
    step = scales.astype(np.float32)[..., None]
    q = np.rint((blocks - base) / np.where(step == 0, 1, step))
    q = np.clip(q, 0, top).astype(np.uint8).reshape(w.shape)
    return pack(HostBlocks(KINDS[kind], q, scales, mins), host)


@jax.tree_util.register_pytree_node_class
class PartsMatrix(QuantizedMatrix):
    """A fused matrix (`wqkv`, `w_gate_up`) whose HF parts a GGUF file stores in different
    block kinds (a Q4_K_M file: q and k in Q4_K, v in Q6_K), each kept as stored: `parts`,
    `BlockMatrix`es of the fused layout's shape but for their widths along `axis` (parts of
    one kind next to each other merged), side by side along `axis`. A product is the parts'
    products, their outputs put side by side (`joined`). `shape`: the logical shape (a
    reshape keeps the parts as they are; by default the fused layout's)."""

    def __init__(self, parts: tuple[BlockMatrix, ...], axis: int,
                 shape: tuple[int, ...] | None = None):
        self.parts, self.axis = tuple(parts), axis
        self.shape = self.layout if shape is None else tuple(shape)

    def tree_flatten(self):
        return self.parts, (self.axis, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(tuple(children), *aux)

    @classmethod
    def abstract(cls, shape: tuple[int, ...], kind: str) -> "PartsMatrix":
        """The storage of a matrix of `shape` whose `kind` a `PartsMatrix.kind` names, as
        shapes and dtypes only (`BlockMatrix.abstract`)."""
        runs, axis = parts_of(kind)

        def part_shape(width: int) -> tuple[int, ...]:
            return (*shape[:axis], width, *shape[axis + 1:])

        return cls(tuple(BlockMatrix.abstract(part_shape(w), k) for k, w in runs), axis, shape)

    @property
    def kind(self) -> str:
        """The parts' kinds with their widths along `axis`, e.g. "Q4_Kx4+Q6_Kx1@1"."""
        runs = "+".join(f"{p.kind}x{p.shape[self.axis]}" for p in self.parts)
        return f"{runs}@{self.axis}"

    def with_parts(self, parts: list[BlockMatrix]) -> "PartsMatrix":
        return PartsMatrix(tuple(parts), self.axis, self.shape)

    def flat(self) -> "PartsMatrix":
        return self.with_parts([p.flat() for p in self.parts])

    def split(self) -> "PartsMatrix":
        return self.with_parts([p.split() for p in self.parts])

    def savable(self) -> "PartsMatrix":
        return self.with_parts([p.savable() for p in self.parts])

    def restored(self) -> "PartsMatrix":
        return self.with_parts([p.restored() for p in self.parts])

    def reshape(self, *shape: int) -> "PartsMatrix":
        """The same parts under another logical shape with the same last dim."""
        return PartsMatrix(self.parts, self.axis, self.reshaped(*shape))

    def __getitem__(self, index: int) -> QuantizedMatrix:
        """The matrix at `index` of the fused layout's leading dim (`w_gate_up[0]`: the gate
        projection, one part)."""
        layout = self.layout
        if len(layout) < 3 or not isinstance(index, int) or not 0 <= index < layout[0]:
            raise TypeError(f"a quantized matrix {layout} is indexed by one int in "
                            f"[0, {layout[0]}) on its leading dim, got {index!r}")
        if self.axis > 0:
            return PartsMatrix(tuple(p[index] for p in self.parts), self.axis - 1, layout[1:])
        starts = np.cumsum([0] + [p.shape[0] for p in self.parts])
        at = int(np.searchsorted(starts, index, side="right")) - 1
        return self.parts[at][index - int(starts[at])]

    @property
    def layout(self) -> tuple[int, ...]:
        """The fused matrix's shape as its parts lie side by side."""
        shape = list(self.parts[0].shape)
        shape[self.axis] = sum(p.shape[self.axis] for p in self.parts)
        return tuple(shape)

    @property
    def k_block(self) -> int:
        return max(p.k_block for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def joined(self, outputs: list[jax.Array]) -> jax.Array:
        """The parts' products [..., N_part] put side by side along `axis`: [..., N]."""
        lead = outputs[0].shape[:-1]
        y = jnp.concatenate([out.reshape(*lead, *p.shape[:-1])
                             for out, p in zip(outputs, self.parts)], axis=len(lead) + self.axis)
        return y.reshape(*lead, -1)

    def dequantized(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The file's weights in `dtype`, in the logical shape."""
        wide = jnp.concatenate([p.dequantized(dtype) for p in self.parts], axis=self.axis)
        return wide.reshape(self.shape)

    def __repr__(self) -> str:
        return f"PartsMatrix({self.kind}, shape={self.shape})"


def parts_of(kind: str) -> tuple[list[tuple[str, int]], int]:
    """A `PartsMatrix.kind` read back: ([(block kind, width)], axis); ValueError naming it
    where it is not one."""
    try:
        runs, axis = kind.split("@")
        parts = [(name, int(width)) for name, width in
                 (run.rsplit("x", 1) for run in runs.split("+"))]
        axis_ = int(axis)
    except ValueError:
        raise ValueError(f"{kind!r} is not a block kind or kinds of parts "
                         f"(e.g. 'Q4_Kx4+Q6_Kx1@1')") from None
    unknown = [name for name, _ in parts if name not in KINDS]
    if unknown or len(parts) < 2 or axis_ < 0 or min(w for _, w in parts) < 1:
        raise ValueError(f"{kind!r}: parts of block kinds in {sorted(KINDS)} of positive "
                         f"widths along an axis, at least two (e.g. 'Q4_Kx4+Q6_Kx1@1')")
    return parts, axis_


def fits(shape: tuple[int, ...], kind: str) -> bool:
    """Whether a matrix of `shape` can be kept as `kind`: a block kind (`tiles`), or a
    `PartsMatrix`'s whose widths add up along its axis and whose parts tile; ValueError for
    a kind that is neither."""
    if kind in KINDS:
        return tiles(shape, KINDS[kind].per_block)
    runs, axis = parts_of(kind)
    return axis < len(shape) - 1 and sum(w for _, w in runs) == shape[axis] and all(
        tiles((*shape[:axis], w, *shape[axis + 1:]), KINDS[k].per_block) for k, w in runs)


def abstract(shape: tuple[int, ...], kind: str) -> BlockMatrix | PartsMatrix:
    """The storage of a matrix of `shape` kept as `kind` (a block kind, or a `PartsMatrix`'s)
    as shapes and dtypes only."""
    if kind in KINDS:
        return BlockMatrix.abstract(shape, kind)
    return PartsMatrix.abstract(shape, kind)


def kinds_by_path(params: Any) -> dict[str, str]:
    """`jax.tree_util.keystr` path -> block kind of every matrix of `params` kept in blocks
    (a `PartsMatrix`'s kind for one kept in parts)."""
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_int8)[0]
    return {jax.tree_util.keystr(path): leaf.kind for path, leaf in leaves
            if isinstance(leaf, (BlockMatrix, PartsMatrix))}


def kinds(params: Any) -> list[str]:
    """The block kinds the matrices of the pytree `params` keep, sorted (none: [])."""
    return sorted({name for kind in kinds_by_path(params).values()
                   for name in ([kind] if kind in KINDS else [k for k, _ in parts_of(kind)[0]])})


def product(x: jax.Array, weight: BlockMatrix) -> jax.Array:
    """x [..., K] times a block-stored `weight` [N, K]^T with XLA's operations, in x's dtype:
    the file's weights times x rounded to int8 blocks of 32, the sub-block sums in integers
    (`quantized.block_sums`), scaled by s, summed over a block (Q6_K's two sub-blocks of 16),
    the block's mn times sum p added, then scaled by t and summed over the blocks in float32
    (the native kernel's values up to float32 rounding; prefill blocks, meshes and other
    platforms), `quantized.ROWS` rows at a time (`quantized.in_row_chunks`)."""
    kind = weight.block_kind
    values, (scale, minimum) = weight.tile_values(), weight.row_scales()

    def rows_times(rows: jax.Array) -> jax.Array:
        p, t = quantized_blocks(rows)
        sums = block_sums(p, values, kind.sub).astype(jnp.float32)  # [K/sub, M, N]
        block = sums * scale.T[:, None, :]
        if kind.sub != BLOCK:  # the sub-blocks of each block of 32 together
            block = jnp.sum(block.reshape(-1, BLOCK // kind.sub, *block.shape[1:]), axis=1)
        if minimum is not None:  # in the same sum over blocks: one reduction (on a mesh, one
            p_sums = jnp.sum(p, axis=-1, dtype=jnp.int32).T.astype(jnp.float32)  # all-reduce)
            block = block + minimum.T[:, None, :] * p_sums[:, :, None]
        return jnp.sum(block * t.T[:, :, None], axis=0)

    y = in_row_chunks(rows_times, x.reshape(-1, x.shape[-1]))
    return y.reshape(*x.shape[:-1], -1).astype(x.dtype)
