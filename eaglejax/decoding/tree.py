"""Draft trees: their description (tokens, parents, depths, mask), EAGLE-2's choice of the
nodes to verify, chains and static shapes as trees.

Candidates are numbered in the order the expansion rounds create them: round 0 scores
the root's `top_k` children, every later round the `top_k` children of each of the
`top_k` frontier nodes, so there are `top_k + (depth - 1) * top_k**2` candidates, each
with a cumulative log-probability and the index of its parent candidate (-1: the root).
`select_tree` keeps the best `total_tokens - 1` of them. Because log-probabilities are
<= 0 a parent always scores at least as high as its children and is created earlier, so
the kept set (ties broken toward earlier candidates) is closed under parents.
Shapes are static; everything is batched over rows and runs under `jit`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Tree(NamedTuple):
    """A verification tree per row; node 0 is the root (the last accepted token).

    tokens [B,N]: node tokens (root: given); parents [B,N]: parent node (-1 for the root);
    depths [B,N]: 0 for the root; mask [B,N,N]: node i sees node j iff j is i or an
    ancestor of i; paths [B,N,D+1]: for each leaf, its root-to-leaf node list padded with
    -1 (non-leaf rows are all -1); is_leaf [B,N]; ranks [B,N]: a dynamic tree's nodes by
    draft score (root 0, best candidate 1, ...), so the best n nodes form a subtree.
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    mask: jax.Array
    paths: jax.Array
    is_leaf: jax.Array
    ranks: jax.Array


def num_candidates(top_k: int, depth: int) -> int:
    """Draft tokens an EAGLE-2 tree of this top_k and depth chooses its nodes from."""
    return top_k + (depth - 1) * top_k * top_k


def max_nodes(top_k: int, depth: int) -> int:
    """The largest EAGLE-2 tree of this top_k and depth: every candidate plus the root."""
    return num_candidates(top_k, depth) + 1


def select_tree(root_tokens: jax.Array, cand_tokens: jax.Array, cand_scores: jax.Array,
                cand_parents: jax.Array, total_tokens: int, max_depth: int) -> Tree:
    """Keep the best `total_tokens - 1` candidates per row and build their tree.

    root_tokens [B]; cand_tokens, cand_scores, cand_parents [B,C] (parents index earlier
    candidates, -1 for the root's children); max_depth: the number of expansion rounds.
    """
    batch, n_cand = cand_tokens.shape
    n_keep = total_tokens - 1
    if not 1 <= n_keep <= n_cand:
        raise ValueError(f"total_tokens must be in [2, {n_cand + 1}], got {total_tokens}")
    _, best = jax.lax.top_k(cand_scores, n_keep)  # ties: the earlier candidate wins
    kept = jnp.sort(best, axis=1)  # creation order: parents before children
    # Node index of each kept candidate (+1 for the root), -1 for candidates not kept.
    node_of = jnp.full((batch, n_cand), -1, jnp.int32)
    node_of = node_of.at[jnp.arange(batch)[:, None], kept].set(
        jnp.arange(1, total_tokens, dtype=jnp.int32)[None, :])
    kept_parents = jnp.take_along_axis(cand_parents, kept, axis=1)
    parent_nodes = jnp.where(kept_parents < 0, 0,
                             jnp.take_along_axis(node_of, jnp.maximum(kept_parents, 0), axis=1))
    parents = jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), parent_nodes], axis=1)
    tokens = jnp.concatenate([root_tokens[:, None],
                              jnp.take_along_axis(cand_tokens, kept, axis=1)], axis=1)
    rank_of = jnp.zeros((batch, n_cand), jnp.int32).at[jnp.arange(batch)[:, None], best].set(
        jnp.arange(1, total_tokens, dtype=jnp.int32)[None, :])
    ranks = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32),
                             jnp.take_along_axis(rank_of, kept, axis=1)], axis=1)
    return tree_from_parents(tokens, parents, max_depth, ranks)


def tree_from_parents(tokens: jax.Array, parents: jax.Array, max_depth: int,
                      ranks: jax.Array | None = None) -> Tree:
    """Build depths, ancestor masks, leaves and paths of trees given by tokens [B,N] and
    parents [B,N] (node 0 the root with parent -1; parents precede their children)."""
    batch, n_nodes = tokens.shape
    # Ancestor sets by walking up max_depth times (the root is its own parent here).
    up = jnp.maximum(parents, 0)
    mask = jnp.broadcast_to(jnp.eye(n_nodes, dtype=bool), (batch, n_nodes, n_nodes))
    depths = jnp.zeros((batch, n_nodes), jnp.int32)
    current = jnp.broadcast_to(jnp.arange(n_nodes), (batch, n_nodes))
    for _ in range(max_depth):
        above = jnp.take_along_axis(up, current, axis=1)
        moved = above != current
        depths = depths + moved
        mask = mask | (jax.nn.one_hot(above, n_nodes, dtype=bool) & moved[..., None])
        current = above

    has_child = jnp.zeros((batch, n_nodes), bool).at[
        jnp.arange(batch)[:, None], up[:, 1:]].set(True)
    is_leaf = ~has_child
    # A leaf's path: its ancestors (mask row) ordered by depth, padded with -1.
    order = jnp.where(mask, depths[:, None, :], max_depth + 1)  # [B,N,N]
    ranked = jnp.argsort(order, axis=-1, stable=True)[..., :max_depth + 1]
    valid = jnp.take_along_axis(order, ranked, axis=-1) <= max_depth
    paths = jnp.where(valid & is_leaf[..., None], ranked, -1).astype(jnp.int32)
    if ranks is None:
        ranks = jnp.broadcast_to(jnp.arange(n_nodes, dtype=jnp.int32), (batch, n_nodes))
    return Tree(tokens.astype(jnp.int32), parents.astype(jnp.int32), depths, mask, paths,
                is_leaf, ranks)


def chain_tree(root_tokens: jax.Array, drafted: jax.Array) -> Tree:
    """A chain [root, d_1..d_K] as the degenerate tree (drafted [B,K])."""
    batch, k = drafted.shape
    parents = jnp.broadcast_to(jnp.arange(-1, k, dtype=jnp.int32), (batch, k + 1))
    return tree_from_parents(jnp.concatenate([root_tokens[:, None], drafted], axis=1),
                             parents, k)


class StaticShape(NamedTuple):
    """A static tree's structure (host numpy): node 0 is the root; nodes are ordered by
    depth then path. parents [N], depths [N], child_rank [N] (the rank among the parent's
    draft top-k that picks the node; 0 for the root)."""

    parents: np.ndarray
    depths: np.ndarray
    child_rank: np.ndarray

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())


def static_shape(paths: tuple[tuple[int, ...], ...]) -> StaticShape:
    """The structure of a validated, sorted path list (see `spec_config.normalize_paths`)."""
    index = {(): 0}
    parents, depths, ranks = [-1], [0], [0]
    for i, path in enumerate(paths, start=1):
        index[path] = i
        parents.append(index[path[:-1]])
        depths.append(len(path))
        ranks.append(path[-1])
    return StaticShape(np.array(parents, np.int32), np.array(depths, np.int32),
                       np.array(ranks, np.int32))
