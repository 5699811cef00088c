"""EAGLE's chain: K draft tokens, one head step each (method "chain")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from eaglejax.decoding.drafters.base import Head, Root, register
from eaglejax.decoding.sampling import SamplingParams, argmax_last, draft_sample
from eaglejax.decoding.tree import Tree, chain_tree

if TYPE_CHECKING:
    from eaglejax.decoding.spec_config import SpecConfig


def propose(head: Head, logits: jax.Array, greedy: bool, sampling: SamplingParams,
            key: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array | None]:
    """The draft token [B] of draft logits [B,DV] (argmax, or sampled from the warped draft
    with its distribution [B,V])."""
    if greedy:
        return head.draft_ids[argmax_last(logits)].astype(jnp.int32), None
    return draft_sample(logits, sampling, key, head.draft_ids, vocab)


def draft_chain(head: Head, root: Root, k: int, greedy: bool, sampling: SamplingParams,
                keys: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array | None]:
    """K tokens one after another [B,K] (argmax, or sampled from the warped draft with
    their distributions [B,K,V] returned for the min(1, p/q) rule). Single-token steps
    extend a scratch copy of the cache."""
    token, probs = propose(head, root.logits, greedy, sampling, keys[:, 0], vocab)
    drafted, dists, hidden, cache = [token], [probs], root.hidden, root.cache
    for i in range(1, k):
        out = head.step(token[:, None], hidden[:, None], cache.lengths[:, None], cache)
        cache = out.cache._replace(lengths=cache.lengths + 1)
        hidden = out.hidden[:, 0]
        token, probs = propose(head, head.logits(hidden), greedy, sampling, keys[:, i], vocab)
        drafted.append(token)
        dists.append(probs)
    return jnp.stack(drafted, axis=1), None if greedy else jnp.stack(dists, axis=1)


@register("chain")
def chain(head: Head, root: Root, spec: "SpecConfig", greedy: bool, sampling: SamplingParams,
          keys: jax.Array, vocab: int) -> tuple[Tree, jax.Array | None]:
    drafted, probs = draft_chain(head, root, spec.num_draft_tokens, greedy, sampling, keys,
                                 vocab)
    return chain_tree(root.token, drafted), probs
