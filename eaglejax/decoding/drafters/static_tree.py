"""A static tree (method "static"): fixed child-rank paths, a node of rank j holding its
parent's j-th most likely draft token (`SpecConfig.paths`, `decoding.tree.static_shape`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.decoding.drafters.base import Head, Root, register, top_k_last
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.tree import StaticShape, Tree, static_shape, tree_from_parents

if TYPE_CHECKING:
    from eaglejax.decoding.spec_config import SpecConfig


@register("static", shape="paths")
def static_tree(head: Head, root: Root, spec: "SpecConfig", greedy: bool,
                sampling: SamplingParams, keys: jax.Array, vocab: int) -> tuple[Tree, None]:
    return draft_static_tree(head, root, static_shape(spec.paths)), None


def draft_static_tree(head: Head, root: Root, shape: StaticShape) -> Tree:
    """Fill a fixed tree: a node of child rank j holds its parent's j-th most likely draft
    token. One head call per level that has children, over all nodes above it."""
    batch = root.token.shape[0]
    parents, depths = shape.parents, shape.depths
    n_nodes = len(parents)
    width = int(shape.child_rank.max()) + 1
    ancestors = np.eye(n_nodes, dtype=bool)
    for i in range(1, n_nodes):
        ancestors[i] |= ancestors[parents[i]]
    tokens = jnp.zeros((batch, n_nodes), jnp.int32).at[:, 0].set(root.token)
    inputs = jnp.zeros((batch, n_nodes, root.hidden.shape[-1]), root.hidden.dtype)
    choices = {0: head.draft_ids[jax.lax.top_k(root.logits, width)[1]]}  # node -> [B,width]
    hidden_of = {0: root.hidden}  # expanded node -> its head output [B,H]
    for level in range(1, shape.max_depth + 1):
        nodes = np.flatnonzero(depths == level)
        for i in nodes:
            tokens = tokens.at[:, i].set(choices[int(parents[i])][:, shape.child_rank[i]])
            inputs = inputs.at[:, i].set(hidden_of[int(parents[i])])
        expanding = [int(i) for i in nodes if np.any(parents == i)]
        if not expanding:
            continue
        fed = int(nodes[-1]) + 1  # nodes 1..fed-1 have depth <= level
        positions = root.cache.lengths[:, None] + jnp.asarray(depths[1:fed])[None] - 1
        mask = jnp.broadcast_to(jnp.asarray(ancestors[1:fed, 1:fed]), (batch, fed - 1, fed - 1))
        hidden = head.step(tokens[:, 1:fed], inputs[:, 1:fed], positions, root.cache,
                           mask, stage=False).hidden
        picked = hidden[:, np.asarray(expanding) - 1]  # [B,E,H]
        logits = head.logits(picked)
        top = head.draft_ids[top_k_last(logits, width)[1]]  # [B,E,width]
        for j, i in enumerate(expanding):
            hidden_of[i], choices[i] = picked[:, j], top[:, j]
    return tree_from_parents(tokens, jnp.broadcast_to(jnp.asarray(parents), (batch, n_nodes)),
                             shape.max_depth)
