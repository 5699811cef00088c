"""GGUF block storage kept as the file stores it (Q4_0, Q4_1, Q8_0), products on int8
activations as llama.cpp computes them on CPUs.

A GGUF block holds 32 consecutive weights of one row: a float16 scale d, for Q4_1 a float16
minimum m, and 32 stored values q (4 or 8 bits). The weights are exactly

    Q4_0: d * (q - 8)      Q4_1: d * q + m      Q8_0: d * q   (q signed for Q8_0)

and a product never forms them: x is quantized per row and block of 32 as int8 storage's
products do (`models.quantized.quantized_rows`: p = round(x / t), t = max|x| / 127), and

    y[i, n] = sum_b t[i, b] * (d[n, b] * sum_{k in b} (q[n, k] + c) p[i, k]
                               + m[n, b] * sum_{k in b} p[i, k])

with c = -8, 0 or -128 (Q8_0's values are stored offset by 128, unsigned) and the sums over a
block in integers: the file's exact weights times x rounded to int8 blocks of 32 (the native
kernel `native.block_matmul` in registers; `product` with XLA's operations, the values
unpacked to int8 and the block sums an s8 x s8 -> s32 dot: `models.quantized.block_sums`). A step reads 4.5 / 5 / 8.5 bits a weight: the stream of SmolLM2's Q4_1 file.

Layout (the kernel's): tiles of 16 output rows; each 4 consecutive k of the 16 rows form one
64-byte line of unsigned bytes (as AVX-512 VNNI reads them). 8-bit values: packed
[N/16, K/4, 16, 4] (q + 128). 4-bit values: two lines share 64 bytes, group 2j in the low
nibbles and group 2j + 1 in the high ones: packed [N/16, K/8, 16, 4]. Scales and minimums:
float16 [N/16, K/32, 16]; `mins` is empty ([0]) where the kind has none.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.models.quantized import (
    BLOCK, TILE, QuantizedMatrix, block_sums, is_int8, quantized_blocks)


@dataclasses.dataclass(frozen=True)
class BlockKind:
    """One GGUF block type: its name, bits a stored value, the offset c of the formula, and
    whether blocks carry a minimum."""

    name: str
    bits: int
    offset: int
    has_min: bool

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in a GGUF file."""
        return 2 + 2 * self.has_min + BLOCK * self.bits // 8


KINDS: dict[str, BlockKind] = {
    "Q4_0": BlockKind("Q4_0", 4, -8, False),
    "Q4_1": BlockKind("Q4_1", 4, 0, True),
    "Q8_0": BlockKind("Q8_0", 8, -128, False),
}


@dataclasses.dataclass
class HostBlocks:
    """A GGUF matrix's blocks decoded on the host, rows kept in order: `values` uint8 [N, K]
    (q, or q + 128 for Q8_0), `scales` and `mins` float16 [N, K/32] (mins zero where the
    kind has none). Leading dims of `values` and the scales may be reshaped together."""

    kind: BlockKind
    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray

    @classmethod
    def from_file(cls, raw: np.ndarray, kind: BlockKind, shape: tuple[int, int]) -> "HostBlocks":
        """A matrix [N, K] from a GGUF tensor's bytes (`raw` uint8, N rows of K/32 blocks)."""
        n, k = shape
        blocks = np.ascontiguousarray(raw, np.uint8).reshape(n, k // BLOCK, kind.block_bytes)
        scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if kind.has_min \
            else np.zeros_like(scales)
        q = blocks[..., 2 + 2 * kind.has_min:]
        if kind.bits == 4:  # value j < 16 in the low nibble of byte j, j >= 16 in the high
            q = np.concatenate([q & 0x0F, q >> 4], axis=-1)
        else:
            q = (q.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return cls(kind, q.reshape(n, k), scales, mins)

    def map(self, fn: Callable[..., np.ndarray], *others: "HostBlocks") -> "HostBlocks":
        """`fn` applied to the values, scales and minimums of this and `others` (of one
        kind) alike: row reshapes, permutations, concatenations."""
        parts = (self, *others)
        if len({p.kind for p in parts}) != 1:
            raise ValueError(f"cannot combine blocks of kinds {[p.kind.name for p in parts]}")
        return HostBlocks(self.kind, *(fn(*(getattr(p, a) for p in parts))
                                       for a in ("values", "scales", "mins")))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def dequantized(self) -> np.ndarray:
        """The weights in float32, as the `gguf` package computes them (scale times value,
        then the minimum added)."""
        q = self.values.astype(np.float32) + np.float32(self.kind.offset)
        q = q.reshape(*self.scales.shape, BLOCK)
        w = self.scales.astype(np.float32)[..., None] * q
        if self.kind.has_min:
            w = w + self.mins.astype(np.float32)[..., None]
        return w.reshape(self.values.shape)


@jax.tree_util.register_pytree_node_class
class BlockMatrix(QuantizedMatrix):
    """A matrix [..., K] kept in GGUF blocks (module docstring): `packed` uint8 in the
    kernel's layout, `scales` and `mins` float16 [N/16, K/32, 16] (`mins` [0] without a
    minimum), N the product of the leading dims of `shape` (the logical shape); `split`:
    the leading [N/16] of each as [*shape[:-2], shape[-2]/16]."""

    def __init__(self, packed: jax.Array, scales: jax.Array, mins: jax.Array,
                 shape: tuple[int, ...], kind: str):
        self.packed, self.scales, self.mins = packed, scales, mins
        self.shape, self.kind = tuple(shape), kind

    def tree_flatten(self):
        return (self.packed, self.scales, self.mins), (self.shape, self.kind)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def rebuilt(self, arrays: list[jax.Array], shape: tuple[int, ...]) -> "BlockMatrix":
        return BlockMatrix(*arrays, shape, self.kind)

    def arranged(self, rows: tuple[int, ...]) -> "BlockMatrix":
        def rearranged(a: jax.Array, tile_dims: int) -> jax.Array:
            return a.reshape(*rows, *a.shape[-tile_dims:])

        mins = self.mins if self.mins.ndim == 1 else rearranged(self.mins, 2)
        return BlockMatrix(rearranged(self.packed, 3), rearranged(self.scales, 2), mins,
                           self.shape, self.kind)

    @classmethod
    def abstract(cls, shape: tuple[int, ...], kind: str) -> "BlockMatrix":
        """The storage of a matrix of `shape` in blocks of `kind` as shapes and dtypes only,
        as a checkpoint saves it (`savable`: no minimums saved where the kind has none)."""
        n, k, block_kind = math.prod(shape[:-1]), shape[-1], KINDS[kind]
        per_tile = jax.ShapeDtypeStruct((n // TILE, k // BLOCK, TILE), jnp.float16)
        return cls(jax.ShapeDtypeStruct((n // TILE, k * block_kind.bits // 32, TILE, 4),
                                        jnp.uint8), per_tile,
                   per_tile if block_kind.has_min else None, shape, kind)

    def savable(self) -> "BlockMatrix":
        """This matrix as a checkpoint saves it: `flat`, the empty minimums of a kind without
        them left out (orbax saves no zero-size array); `restored` puts them back."""
        flat = self.flat()
        return flat if self.block_kind.has_min else \
            BlockMatrix(flat.packed, flat.scales, None, self.shape, self.kind)

    def restored(self) -> "BlockMatrix":
        """A matrix as `savable` left it, whole again."""
        return self if self.mins is not None else \
            BlockMatrix(self.packed, self.scales, jnp.zeros((0,), jnp.float16), self.shape,
                        self.kind)

    @property
    def block_kind(self) -> BlockKind:
        return KINDS[self.kind]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(a.shape) * a.dtype.itemsize
                   for a in (self.packed, self.scales, self.mins))

    def reshape(self, *shape: int) -> "BlockMatrix":
        """The same storage (`flat`) under another logical shape with the same last dim."""
        flat = self.flat()
        return BlockMatrix(flat.packed, flat.scales, flat.mins, self.reshaped(*shape),
                           self.kind)

    def tile_values(self) -> jax.Array:
        """The stored values q + c (c the kind's offset) as int8 in the tile layout
        [N/16, K/4, 16, 4]."""
        kind, packed = self.block_kind, self.flat().packed
        tiles, lines = packed.shape[:2]
        if kind.bits == 4:  # [T, K/8, 16, 4] -> [T, K/8, 2, 16, 4]: low nibbles first
            q = jnp.stack([packed & 0x0F, packed >> 4], axis=2)
            q = q.reshape(tiles, 2 * lines, TILE, 4)
        else:
            q = packed
        return (q.astype(jnp.int16) + kind.offset).astype(jnp.int8)

    def values(self) -> jax.Array:
        """The stored values q + c as int8 [N, K] (c the kind's offset)."""
        q = self.tile_values()
        return q.transpose(0, 2, 1, 3).reshape(q.shape[0] * TILE, -1)

    def _per_row(self, a: jax.Array) -> jax.Array:
        """[N/16, K/32, 16] -> float32 [N, K/32]."""
        return a.transpose(0, 2, 1).reshape(-1, a.shape[1]).astype(jnp.float32)

    def dequantized(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The file's weights in `dtype`, in the logical shape (float32: the values the `gguf`
        package's dequantization gives)."""
        q, flat = self.values().astype(jnp.float32), self.flat()
        n, k = q.shape
        w = self._per_row(flat.scales)[..., None] * q.reshape(n, k // BLOCK, BLOCK)
        if self.block_kind.has_min:
            w = w + self._per_row(flat.mins)[..., None]
        return w.reshape(self.shape).astype(dtype)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Dequantized float32 rows [..., K] for row ids (clamped): an embedding lookup that
        reads only those rows."""
        n = math.prod(self.shape[:-1])
        ids = jnp.clip(ids, 0, n - 1)
        tile, lane = ids // TILE, ids % TILE
        kind, flat = self.block_kind, self.flat()
        q = flat.packed[tile, :, lane, :]  # [..., lines, 4]
        if kind.bits == 4:
            q = jnp.stack([q & 0x0F, q >> 4], axis=-2)  # [..., lines, 2, 4]
        q = q.reshape(*ids.shape, -1, BLOCK).astype(jnp.float32) + kind.offset
        w = flat.scales[tile, :, lane].astype(jnp.float32)[..., None] * q
        if kind.has_min:
            w = w + flat.mins[tile, :, lane].astype(jnp.float32)[..., None]
        return w.reshape(*ids.shape, -1)

    def __repr__(self) -> str:
        return f"BlockMatrix({self.kind}, shape={self.shape})"


def tiles(shape: tuple[int, ...]) -> bool:
    """Whether a matrix of `shape` fits the kernel's layout (N % 16 == K % 32 == 0)."""
    return len(shape) >= 2 and math.prod(shape[:-1]) % TILE == 0 and shape[-1] % BLOCK == 0


def pack(blocks: HostBlocks) -> BlockMatrix:
    """`blocks` (values [..., K], any leading dims; N % 16 == 0) in the kernel's layout."""
    shape = blocks.values.shape
    if not tiles(shape):
        raise ValueError(f"GGUF block storage needs rows in multiples of {TILE} and a last "
                         f"dim in multiples of {BLOCK}, got a matrix {shape}")
    n, k = math.prod(shape[:-1]), shape[-1]
    q = blocks.values.reshape(n // TILE, TILE, k // 4, 4).transpose(0, 2, 1, 3)
    if blocks.kind.bits == 4:  # groups 2j (low nibble) and 2j + 1 (high) share a line
        q = q.reshape(n // TILE, k // 8, 2, TILE, 4)
        q = q[:, :, 0] | (q[:, :, 1] << 4)

    def per_tile(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(n // TILE, TILE, k // BLOCK).transpose(0, 2, 1),
                                    np.float16)

    mins = per_tile(blocks.mins) if blocks.kind.has_min else np.zeros((0,), np.float16)
    return BlockMatrix(jnp.asarray(np.ascontiguousarray(q, np.uint8)),
                       jnp.asarray(per_tile(blocks.scales)), jnp.asarray(mins), shape,
                       blocks.kind.name)


def quantize(weight: jax.Array) -> BlockMatrix:
    """`weight` [..., K] (`tiles`) in 4-bit blocks of 32 with a scale and a minimum (Q4_1's
    layout, what `weight_dtype="int4"` stores): per block m = min w, d = (max w - m) / 15,
    both rounded to float16 first, then q = round((w - m) / d) in [0, 15]; computed on the
    host in float32. |w - (d q + m)| <= d / 2 plus float16's rounding of m."""
    w = np.asarray(jax.device_get(weight), np.float32)
    if not tiles(w.shape):
        raise ValueError(f"4-bit storage needs rows in multiples of {TILE} and a last dim in "
                         f"multiples of {BLOCK}, got a matrix {w.shape}")
    blocks = w.reshape(*w.shape[:-1], -1, BLOCK)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    mins = low.astype(np.float16)
    scales = ((high - low) / np.float32(15)).astype(np.float16)
    step = scales.astype(np.float32)[..., None]
    q = np.rint((blocks - mins.astype(np.float32)[..., None]) / np.where(step == 0, 1, step))
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(w.shape)
    return pack(HostBlocks(KINDS["Q4_1"], q, scales, mins))


def kinds_by_path(params: Any) -> dict[str, str]:
    """`jax.tree_util.keystr` path -> block kind of every matrix of `params` kept in blocks."""
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_int8)[0]
    return {jax.tree_util.keystr(path): leaf.kind for path, leaf in leaves
            if isinstance(leaf, BlockMatrix)}


def kinds(params: Any) -> list[str]:
    """The block kinds the matrices of the pytree `params` keep, sorted (none: [])."""
    return sorted(set(kinds_by_path(params).values()))


def product(x: jax.Array, weight: BlockMatrix) -> jax.Array:
    """x [..., K] times a block-stored `weight` [N, K]^T with XLA's operations, in x's dtype:
    the file's weights times x rounded to int8 blocks of 32, the block sums in integers
    (`quantized.block_sums`), scaled by t, d (and m times sum p) and summed over the blocks
    in float32 (the native kernel's values up to float32 rounding; prefill blocks, meshes
    and other platforms)."""
    weight = weight.flat()
    p, t = quantized_blocks(x.reshape(-1, x.shape[-1]))
    sums = block_sums(p, weight.tile_values()).astype(jnp.float32)  # [K/32, M, N]

    def per_block(a: jax.Array) -> jax.Array:  # [N/16, K/32, 16] -> float32 [K/32, 1, N]
        return a.transpose(1, 0, 2).reshape(sums.shape[0], 1, -1).astype(jnp.float32)

    block = sums * per_block(weight.scales)
    if weight.block_kind.has_min:  # in the same sum over blocks: one reduction (on a mesh,
        p_sums = jnp.sum(p, axis=-1, dtype=jnp.int32).T.astype(jnp.float32)  # one all-reduce)
        block = block + per_block(weight.mins) * p_sums[:, :, None]
    y = jnp.sum(block * t.T[:, :, None], axis=0)
    return y.reshape(*x.shape[:-1], -1).astype(x.dtype)
