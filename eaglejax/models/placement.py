"""Putting weights onto a mesh: every array goes from host memory straight into its
sharding (`jax.make_array_from_callback`: each device receives only its slice, and each
process of a multi-host run reads only the slices of its own devices).

Models with fewer KV heads than `tp` (e.g. 2 KV heads on tp=4) are widened first: each KV
head is repeated `tp / num_kv_heads` times, each copy serving its share of the query
heads, so attention still splits over `tp` (the same function; the K/V projections and
the KV cache grow by that factor, as in vLLM and sglang-jax). Where neither count divides
the other, attention stays replicated and only the MLP and vocabulary split.

Quantized matrices (`models.quantized`, `models.gguf_blocks`) split as their float matrices
do: by tiles of 16 rows (column-parallel) or by blocks of 32 along K (row-parallel; a
K-quant's super-blocks of 256), each scale (and minimum) with its values
(`TargetPlacement.place_quantized`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eaglejax.config import ModelConfig
from eaglejax.errors import ConfigError
from eaglejax.models.gguf_blocks import PartsMatrix
from eaglejax.models.llama import logical_axes
from eaglejax.models.quantized import TILE, QuantizedMatrix, is_int8
from eaglejax.sharding.rules import logical_spec

GROUPED_BY_KV_HEAD = ("kv_heads", "qkv")  # the leading axes of [kv_heads, kv_group + 2, ...]


def kv_widening(config: ModelConfig, tp: int) -> int:
    """How many times to repeat each KV head on a `tp`-wide mesh: 1 when tp divides the KV
    heads (or the attention cannot split anyway), tp / num_kv_heads when that splits it."""
    kv = config.num_kv_heads
    if kv % tp == 0 or tp % kv or config.num_heads % tp:
        return 1
    return tp // kv


def widen_kv_heads(grouped: np.ndarray, factor: int, start: int = 0,
                   width: int | None = None) -> np.ndarray:
    """[kv, group + 2, ...] -> [kv * factor, group / factor + 2, ...]: copy j of KV head g
    carries query heads j * group / factor ... of g's group, then g's key and value. With
    `start` and `width`, `grouped` is the slice [start, start + n) along dim 1 of such a
    matrix [kv, width, ...] (a part of a `gguf_blocks.PartsMatrix`), widened to the rows of
    the widened matrix that come from it."""
    if factor == 1:
        return grouped
    kv, n = grouped.shape[:2]
    width = n if width is None else width
    share = (width - 2) // factor
    picks = [[i - start for i in (*range(j * share, (j + 1) * share), width - 2, width - 1)
              if start <= i < start + n] for j in range(factor)]
    copies = [grouped[:, pick] for pick in picks]
    return np.stack(copies, axis=1).reshape(kv * factor, len(picks[0]), *grouped.shape[2:])


def on_mesh(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array (the same on every process), each device given
    only its own slice."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def committed(tree: Any) -> Any:
    """`tree` with every array committed to the device(s) it is on. A program's outputs are
    committed when one of its inputs is, and JAX compiles a program again for committed inputs
    where it ran on uncommitted ones: state that a long-lived driver (the serving engine) feeds
    back into its programs is committed from the start, so each program compiles once."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding)
                        if isinstance(x, jax.Array) and not x.committed else x, tree)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Every array leaf of `tree` (host or device) as a global array replicated on `mesh`."""
    sharding = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: on_mesh(np.asarray(x), sharding), tree)


def split_rows(tree: Any, mesh: Mesh) -> Any:
    """Every host array of `tree` as a global array whose leading (row) dimension is split
    over "dp" (replicated where dp does not divide it)."""
    def one(x: Any) -> jax.Array:
        x = np.asarray(x)
        axes = ("batch",) + (None,) * (x.ndim - 1)
        return on_mesh(x, NamedSharding(mesh, logical_spec(axes, x.shape, mesh)))

    return jax.tree.map(one, tree)


@dataclasses.dataclass(frozen=True)
class TargetPlacement:
    """Where each parameter of a target goes on `mesh`. `config` is the model as placed
    (KV heads widened by `factor`); `place(path, host)` puts one parameter there."""

    mesh: Mesh
    source_config: ModelConfig
    config: ModelConfig
    factor: int

    @staticmethod
    def plan(config: ModelConfig, mesh: Mesh) -> "TargetPlacement":
        if set(mesh.axis_names) != {"dp", "tp"}:
            raise ConfigError(f"the mesh must have the axes ('dp', 'tp') of "
                              f"eaglejax.make_mesh, got {mesh.axis_names}")
        factor = kv_widening(config, mesh.shape["tp"])
        placed = dataclasses.replace(config, num_kv_heads=config.num_kv_heads * factor)
        return TargetPlacement(mesh, config, placed, factor)

    def axes(self, path: tuple[str | int, ...]) -> tuple[str, ...]:
        axes: Any = logical_axes(self.config)
        for key in path:
            axes = axes[key]
        return axes

    def place(self, path: tuple[str | int, ...], host: Any) -> Any:
        """Parameter `path` (e.g. ("layers", 3, "wqkv")) from its host array, or a quantized
        matrix (`place_quantized`)."""
        if is_int8(host):
            return self.place_quantized(path, host)
        if self.axes(path)[:2] == GROUPED_BY_KV_HEAD:
            host = widen_kv_heads(np.asarray(host), self.factor)
        return on_mesh(host, self.sharding(path, np.shape(host)))

    def place_quantized(self, path: tuple[str | int, ...], matrix: QuantizedMatrix,
                        start: int = 0, width: int | None = None) -> QuantizedMatrix:
        """A quantized matrix with its arrays in their `split` form, each split as the float
        matrix's logical axes split it: a column-parallel matrix by its tiles of 16 rows
        (their scales with them), a row-parallel one by its blocks of 32 along K (the blocks'
        scales and minimums with them); replicated along a mesh axis that does not divide
        the tiles or the blocks; a matrix kept in parts (`gguf_blocks.PartsMatrix`) part by
        part (`start`, `width`: a part's place along dim 1 of a `wqkv` of that width, for
        widening its KV heads). ConfigError for a matrix whose rows do not split."""
        if isinstance(matrix, PartsMatrix):
            starts = np.cumsum([0] + [p.shape[matrix.axis] for p in matrix.parts])
            return PartsMatrix(tuple(
                self.place_quantized(path, part, int(at), matrix.layout[matrix.axis])
                for part, at in zip(matrix.parts, starts)), matrix.axis)
        try:
            host = jax.tree.map(np.asarray, matrix.split())
        except ValueError as err:
            name = "".join(f"[{key!r}]" for key in path)
            raise ConfigError(f"{name}: {err}, so it cannot be placed on a mesh; store it in "
                              f"a float dtype") from None
        if self.axes(path)[:2] == GROUPED_BY_KV_HEAD and self.factor > 1:
            kv, n = host.shape[:2]
            widened = [widen_kv_heads(a, self.factor, start, width or n) if a.ndim > 1 else a
                       for a in host.tree_flatten()[0]]
            host = host.rebuilt(widened, (kv * self.factor, widened[0].shape[1],
                                          *host.shape[2:]))
        arrays = host.tree_flatten()[0]
        return host.rebuilt([on_mesh(a, where) for a, where in
                             zip(arrays, self.quantized_shardings(path, host))], host.shape)

    def quantized_shardings(self, path: tuple[str | int, ...],
                            matrix: QuantizedMatrix) -> list[NamedSharding]:
        """Where each storage array of parameter `path`, a quantized matrix in its `split`
        form as placed (KV heads widened), goes (`place_quantized`); arrays or shape
        structs."""
        blocks = (*matrix.shape[:-2], matrix.shape[-2] // TILE,
                  matrix.shape[-1] // matrix.k_block)
        spec = tuple(logical_spec(self.axes(path), blocks, self.mesh))
        spec += (None,) * (len(blocks) - len(spec))

        def sharding(a: Any) -> NamedSharding:
            # by rank: packed (*blocks, 16, 4), block scales (*blocks, 16) and K-quant
            # supers (*blocks, 16, c) extend the blocks' dims (K split between super-blocks),
            # int8 scales (*tiles' rows) end before K; empty minimums and supers
            rank = len(a.shape)
            dims = spec[:rank] + (None,) * (rank - len(spec)) if math.prod(a.shape) else ()
            return NamedSharding(self.mesh, PartitionSpec(*dims))

        return [sharding(a) for a in matrix.tree_flatten()[0]]

    def sharding(self, path: tuple[str | int, ...], shape: tuple[int, ...]) -> NamedSharding:
        """Where parameter `path` of this (placed) shape lives."""
        return NamedSharding(self.mesh, logical_spec(self.axes(path), shape, self.mesh))

    def place_tree(self, params: Any) -> Any:
        """Every parameter of a tree placed (from host, or from where it is); one already in
        its sharding stays as it is."""
        def leaf(path, x):
            keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
            if (self.factor == 1 and isinstance(x, jax.Array)
                    and x.sharding.is_equivalent_to(self.sharding(keys, x.shape), x.ndim)):
                return x
            return self.place(keys, x if is_int8(x) else np.asarray(x))

        return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=is_int8)
