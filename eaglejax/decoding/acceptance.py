"""Verification rules: greedy matching and lossless rejection sampling, for a sampled chain
(min(1, p/q)) and for deterministic trees (recursive rejection over siblings); `verify`
picks the rule a round needs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eaglejax.decoding.sampling import SamplingParams, argmax_last, target_log_probs
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.tree import Tree


def _leading_true(flags: jax.Array) -> jax.Array:
    """[B,K] booleans -> [B] length of the all-True prefix."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=1), axis=1)


def sample_accept(drafted: jax.Array, draft_probs: jax.Array, target_logits: jax.Array,
                  sampling: SamplingParams, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling: the output follows the target's warped distribution exactly.

    drafted [B,K] were sampled from draft_probs [B,K,V] (already mapped to the target
    vocabulary); target_logits [B,K+1,V]; keys [B,2] one per row. Draft token i is kept
    with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is
    drawn from norm(max(0, p - q)) there; when all K pass, from p at position K.
    """
    batch, k = drafted.shape
    rows = jnp.arange(batch)
    p = jnp.exp(target_log_probs(target_logits, sampling))  # [B,K+1,V]
    uniform_keys, final_keys = jnp.split(jax.vmap(lambda key: jax.random.split(key, 2))(keys),
                                         2, axis=1)
    uniforms = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(uniform_keys[:, 0])
    p_draft = jnp.take_along_axis(p[:, :k], drafted[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, drafted[..., None], axis=-1)[..., 0]
    n_accepted = _leading_true(uniforms * q_draft < p_draft)
    p_at = p[rows, n_accepted]
    q_at = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)[
        rows, n_accepted]  # zeros after a full acceptance: sample from p itself
    residual = jnp.maximum(p_at - q_at, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_at)
    next_token = jax.vmap(jax.random.categorical)(final_keys[:, 0], jnp.log(residual))
    return n_accepted, next_token.astype(jnp.int32)


def _path_to(tree: Tree, node: jax.Array, max_depth: int) -> jax.Array:
    """[B,D+1] node indices from the root down to `node` [B] (entries past its depth: 0)."""
    ancestors = jnp.take_along_axis(tree.mask, node[:, None, None], axis=1)[:, 0]  # [B,N]
    at_depth = ancestors[:, None, :] & (tree.depths[:, None, :]
                                        == jnp.arange(max_depth + 1)[None, :, None])
    return jnp.argmax(at_depth, axis=-1).astype(jnp.int32)


def greedy_accepted_nodes(tree: Tree, target_logits: jax.Array, max_depth: int) -> jax.Array:
    """[B,N]: nodes whose token and every ancestor's token is the target's argmax at the
    parent (the root counts as accepted)."""
    target_next = argmax_last(target_logits)
    up = jnp.maximum(tree.parents, 0)
    accepted = (tree.tokens == jnp.take_along_axis(target_next, up, axis=1)).at[:, 0].set(True)
    for _ in range(max_depth):
        accepted = accepted & jnp.take_along_axis(accepted, up, axis=1)
    return accepted


def tree_greedy_accept(tree: Tree, target_logits: jax.Array,
                       max_depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy tree verification: target_logits [B,N,V] at the tree's nodes.

    A node is accepted when its token is the target's argmax at its parent and its parent
    is accepted. Returns (path [B,D+1] from the root to the deepest accepted node, its
    depth a [B] = accepted draft tokens, the target's argmax there as bonus token [B])."""
    target_next = argmax_last(target_logits)  # [B,N]
    accepted = greedy_accepted_nodes(tree, target_logits, max_depth)
    # Siblings hold distinct tokens, so at most one accepted node per depth.
    best = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1)
    rows = jnp.arange(tree.tokens.shape[0])
    return _path_to(tree, best, max_depth), tree.depths[rows, best], target_next[rows, best]


def _children(tree: Tree, width: int) -> jax.Array:
    """[B,N,width]: each node's children in node order (= the draft's rank order), -1 pad."""
    n_nodes = tree.tokens.shape[1]
    is_child = tree.parents[:, None, :] == jnp.arange(n_nodes)[None, :, None]  # [B,parent,child]
    order = jnp.cumsum(is_child, axis=-1) - 1
    slot = is_child[..., None] & (order[..., None] == jnp.arange(width))  # [B,N,N,width]
    found = jnp.any(slot, axis=2)
    return jnp.where(found, jnp.argmax(slot, axis=2), -1).astype(jnp.int32)


def tree_sample_accept(tree: Tree, target_logits: jax.Array, sampling: SamplingParams,
                       keys: jax.Array, max_depth: int,
                       width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Lossless verification of a deterministic draft tree (recursive rejection).

    From the root, try the current node's children in draft-rank order: child x is accepted
    with probability r(x) / sum(r), where r starts as the target's warped distribution p
    at the node and loses each rejected child's mass (one-hot draft per try). An accepted
    child becomes the current node; when all are rejected the next token is drawn from
    r renormalised, and at a leaf from p. keys [B,2]; width: most children per node.
    Returns (path [B,D+1], accepted draft tokens [B], next token [B]), as the greedy rule.
    """
    batch = tree.tokens.shape[0]
    rows = jnp.arange(batch)
    p = jnp.exp(target_log_probs(target_logits, sampling))  # [B,N,V]
    children = _children(tree, width)
    uniform_keys, final_keys = jnp.split(jax.vmap(lambda key: jax.random.split(key, 2))(keys),
                                         2, axis=1)
    uniforms = jax.vmap(lambda key: jax.random.uniform(key, (max_depth, width)))(
        uniform_keys[:, 0])
    current = jnp.zeros((batch,), jnp.int32)
    stopped = jnp.zeros((batch,), bool)
    residual = p[:, 0]
    for d in range(max_depth):
        residual = jnp.where(stopped[:, None], residual, p[rows, current])
        moved_to = jnp.full((batch,), -1, jnp.int32)
        for j in range(width):
            child = children[rows, current, j]
            trying = ~stopped & (moved_to < 0) & (child >= 0)
            token = tree.tokens[rows, jnp.maximum(child, 0)]
            mass = jnp.sum(residual, axis=-1)
            accept = trying & (uniforms[:, d, j] * mass < residual[rows, token])
            moved_to = jnp.where(accept, child, moved_to)
            rejected = trying & ~accept
            residual = residual.at[rows, token].set(
                jnp.where(rejected, 0.0, residual[rows, token]))
        stopped = stopped | (moved_to < 0)
        current = jnp.where(moved_to >= 0, moved_to, current)
    # Rows that never stopped sit at a leaf (or at max depth): sample from p there.
    residual = jnp.where(stopped[:, None], residual, p[rows, current])
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual, p[rows, current])
    next_token = jax.vmap(jax.random.categorical)(final_keys[:, 0], jnp.log(residual))
    return (_path_to(tree, current, max_depth), tree.depths[rows, current],
            next_token.astype(jnp.int32))


def verify(tree: Tree, target_logits: jax.Array, draft_probs: jax.Array | None,
           spec: SpecConfig, greedy: bool, sampling: SamplingParams,
           keys: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(path [B,D+1], accepted draft tokens [B], next token [B]) of a round drafted as
    `spec` says: greedy matching, min(1, p/q) for a sampled chain (`draft_probs` [B,K,V]),
    recursive rejection for a tree. keys [B,2] one per row."""
    depth = spec.max_depth
    if greedy:
        return tree_greedy_accept(tree, target_logits, depth)
    if spec.is_chain:
        n_accepted, bonus = sample_accept(tree.tokens[:, 1:], draft_probs, target_logits,
                                          sampling, keys)
        path = jnp.broadcast_to(jnp.arange(depth + 1, dtype=jnp.int32), tree.tokens.shape)
        return path, n_accepted, bonus
    return tree_sample_accept(tree, target_logits, sampling, keys, depth, spec.max_children)
