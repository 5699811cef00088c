"""EAGLE-2's dynamic tree (method "tree"): `depth` expansion rounds of the best `top_k`
frontier nodes, then the best `total_tokens - 1` candidates by cumulative draft
log-probability."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from eaglejax.decoding.drafters.base import Head, Root, register, top_k_last
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.tree import Tree, select_tree

if TYPE_CHECKING:
    from eaglejax.decoding.spec_config import SpecConfig


@register("tree", shape="tree")
def dynamic_tree(head: Head, root: Root, spec: "SpecConfig", greedy: bool,
                 sampling: SamplingParams, keys: jax.Array, vocab: int) -> tuple[Tree, None]:
    return draft_dynamic_tree(head, root, spec.top_k, spec.depth, spec.total_tokens), None


def draft_dynamic_tree(head: Head, root: Root, top_k: int, depth: int,
                       total_tokens: int) -> Tree:
    """EAGLE-2: expand the best `top_k` frontier nodes for `depth` rounds (one head call per
    round after the first), score candidates by cumulative log-probability and keep the
    best `total_tokens - 1` (see `tree.select_tree`)."""
    batch = root.token.shape[0]
    rows = jnp.arange(batch)[:, None]
    k = top_k
    # At depth 1 the scores only rank the root's children, which their logits rank as their
    # log-probabilities do: no pass over the draft vocabulary (~40 us of a 5 ms round on a
    # 2-core Zen 4, BENCHMARKS.md, session 52).
    root_scores = root.logits if depth == 1 else jax.nn.log_softmax(root.logits, axis=-1)
    scores, index = jax.lax.top_k(root_scores, k)
    cand_tokens = [head.draft_ids[index]]
    cand_scores = [scores]
    cand_parents = [jnp.full((batch, k), -1, jnp.int32)]
    n_slots = k * (depth - 1)  # head-fed nodes: the frontier of every round but the last
    slot_tokens = jnp.zeros((batch, n_slots), jnp.int32)
    slot_inputs = jnp.zeros((batch, n_slots, root.hidden.shape[-1]), root.hidden.dtype)
    slot_mask = jnp.zeros((batch, n_slots, n_slots), bool)
    frontier = dict(tokens=cand_tokens[0], inputs=jnp.broadcast_to(
        root.hidden[:, None], (batch, k, root.hidden.shape[-1])), scores=scores,
        cand=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k)),
        mask=jnp.zeros((batch, k, n_slots), bool))
    slot_depths = jnp.repeat(jnp.arange(1, depth, dtype=jnp.int32), k)
    for r in range(1, depth):
        lo, hi = (r - 1) * k, r * k
        slot_tokens = slot_tokens.at[:, lo:hi].set(frontier["tokens"])
        slot_inputs = slot_inputs.at[:, lo:hi].set(frontier["inputs"])
        own = jax.nn.one_hot(jnp.arange(lo, hi), n_slots, dtype=bool)[None]
        slot_mask = slot_mask.at[:, lo:hi].set(frontier["mask"] | own)
        positions = root.cache.lengths[:, None] + slot_depths[None, :hi] - 1
        hidden = head.step(slot_tokens[:, :hi], slot_inputs[:, :hi], positions, root.cache,
                           slot_mask[:, :hi, :hi], stage=False).hidden[:, lo:hi]  # [B,k,H]
        child_scores, child_index = top_k_last(head.log_probs(hidden), k)  # [B,k,k]
        cum = (frontier["scores"][:, :, None] + child_scores).reshape(batch, k * k)
        tokens = head.draft_ids[child_index].reshape(batch, k * k)
        base = k + (r - 1) * k * k
        cand_tokens.append(tokens)
        cand_scores.append(cum)
        cand_parents.append(jnp.repeat(frontier["cand"], k, axis=1))
        if r == depth - 1:
            break
        best_scores, best = jax.lax.top_k(cum, k)
        parent = best // k
        frontier = dict(tokens=tokens[rows, best], inputs=hidden[rows, parent],
                        scores=best_scores, cand=(base + best).astype(jnp.int32),
                        mask=slot_mask[rows, lo + parent])
    return select_tree(root.token, jnp.concatenate(cand_tokens, axis=1),
                       jnp.concatenate(cand_scores, axis=1),
                       jnp.concatenate(cand_parents, axis=1), total_tokens, depth)
