"""The rule table from logical axis names to mesh axes, applied with Flax's logical
partitioning (`flax.linen.logical_to_mesh_axes`, the MaxText convention).

| logical axis | mesh axis | where |
| --- | --- | --- |
| batch | dp | rows of prompts, caches and loop state |
| vocab | tp | embedding and output head rows (logits split over the vocabulary) |
| kv_heads | tp | `wqkv`'s KV-head groups (each with its query heads) and the KV cache |
| heads | tp | `wo`'s input (the query heads, in the same groups) |
| mlp | tp | `w_gate_up`'s output, `w_down`'s input |
| everything else | (replicated) | embed, head_dim, norms, cache positions and blocks, draft heads |

A dimension the mesh axis does not divide is replicated along that axis instead (e.g. a
batch of 3 on dp=2, or 3 KV heads on tp=2); `eaglejax.models.placement` first widens
models with fewer KV heads than `tp` so that their attention still splits.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from flax import linen as nn
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "dp"),
    ("vocab", "tp"),
    ("kv_heads", "tp"),
    ("heads", "tp"),
    ("mlp", "tp"),
)

LogicalAxes = Sequence[str | None]


def logical_spec(axes: LogicalAxes, shape: Sequence[int], mesh: Mesh | AbstractMesh,
                 rules: Sequence[tuple[str, str | None]] = RULES) -> PartitionSpec:
    """The mesh PartitionSpec of an array with these logical axes and shape: the rule
    table's mesh axis per dimension, replicated where that axis does not divide it."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    spec = nn.logical_to_mesh_axes(tuple(axes), rules)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    dims = []
    for size, mesh_axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        dims.append(mesh_axis if mesh_axis is not None and size % sizes[mesh_axis] == 0
                    else None)
    return PartitionSpec(*dims)


def shardings(mesh: Mesh, axes_tree: Any, arrays: Any) -> Any:
    """NamedShardings for a tree of arrays (or shape structs) from the matching tree of
    logical axis tuples."""
    return jax.tree.map(
        lambda axes, x: NamedSharding(mesh, logical_spec(axes, x.shape, mesh)),
        axes_tree, arrays, is_leaf=lambda x: isinstance(x, tuple))


def over_mesh() -> bool:
    """Whether the code being traced runs over a mesh of several devices (`jax.set_mesh`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """`x` constrained to its logical axes on the mesh being traced over (`jax.set_mesh`);
    unchanged outside one."""
    if not over_mesh():
        return x
    mesh = jax.sharding.get_abstract_mesh()
    return jax.lax.with_sharding_constraint(x, logical_spec(axes, x.shape, mesh))
