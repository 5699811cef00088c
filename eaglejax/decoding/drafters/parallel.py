"""P-EAGLE: every draft position proposed by one head forward (the next-token slot and the
mask slots, `Root.logits` [B,K,DV]), drafted as a chain (method "parallel") or as a tree
over the lattice of each slot's top tokens (method "parallel_tree")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from eaglejax.decoding.drafters.base import Head, Root, register, top_k_last
from eaglejax.decoding.drafters.chain import propose
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.tree import Tree, chain_tree, select_tree

if TYPE_CHECKING:
    from eaglejax.decoding.spec_config import SpecConfig


@register("parallel")
def parallel(head: Head, root: Root, spec: "SpecConfig", greedy: bool,
             sampling: SamplingParams, keys: jax.Array, vocab: int
             ) -> tuple[Tree, jax.Array | None]:
    """The chain of the K proposals' tokens (argmax, or sampled with their distributions
    [B,K,V] for the min(1, p/q) rule: a slot's distribution does not depend on the tokens
    drafted before it)."""
    if greedy:  # every slot's argmax in one call
        return chain_tree(root.token, propose(head, root.logits, greedy, sampling, keys,
                                              vocab)[0]), None
    drawn = [propose(head, root.logits[:, i], greedy, sampling, keys[:, i], vocab)
             for i in range(root.logits.shape[1])]
    return (chain_tree(root.token, jnp.stack([t for t, _ in drawn], axis=1)),
            jnp.stack([p for _, p in drawn], axis=1))


@register("parallel_tree", shape="tree")
def parallel_tree(head: Head, root: Root, spec: "SpecConfig", greedy: bool,
                  sampling: SamplingParams, keys: jax.Array, vocab: int
                  ) -> tuple[Tree, None]:
    return draft_parallel_tree(root, head.draft_ids, spec.top_k, spec.depth,
                               spec.total_tokens), None


def draft_parallel_tree(root: Root, draft_ids: jax.Array, top_k: int, depth: int,
                        total_tokens: int) -> Tree:
    """A tree from one P-EAGLE forward's proposals `root.logits` [B,depth,DV]: EAGLE-2's
    expansion (`dynamic_tree.draft_dynamic_tree`) over the lattice of each slot's `top_k`
    tokens. A mask slot never sees the tokens drafted before it, so slot d's children are
    the same for every parent: no head call, only their scores (summed log-probabilities)
    differ."""
    batch = root.token.shape[0]
    k = top_k
    slot_scores, slot_index = top_k_last(jax.nn.log_softmax(root.logits, axis=-1), k)
    slot_tokens = draft_ids[slot_index]  # [B,depth,k]
    cand_tokens, cand_scores = [slot_tokens[:, 0]], [slot_scores[:, 0]]
    cand_parents = [jnp.full((batch, k), -1, jnp.int32)]
    frontier_scores = slot_scores[:, 0]
    frontier_cand = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))
    for r in range(1, depth):
        cum = (frontier_scores[:, :, None] + slot_scores[:, r][:, None, :]).reshape(batch, k * k)
        cand_tokens.append(jnp.broadcast_to(slot_tokens[:, r][:, None, :],
                                            (batch, k, k)).reshape(batch, k * k))
        cand_scores.append(cum)
        cand_parents.append(jnp.repeat(frontier_cand, k, axis=1))
        if r == depth - 1:
            break
        frontier_scores, best = jax.lax.top_k(cum, k)
        frontier_cand = (k + (r - 1) * k * k + best).astype(jnp.int32)
    return select_tree(root.token, jnp.concatenate(cand_tokens, axis=1),
                       jnp.concatenate(cand_scores, axis=1),
                       jnp.concatenate(cand_parents, axis=1), total_tokens, depth)
