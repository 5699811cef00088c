"""Drafting one speculative round: the drafter the `SpecConfig` names (`decoding.drafters`:
a chain, P-EAGLE's parallel chain or lattice tree, a dynamic tree, a static tree), plus an
optional context-lookup branch.

Every drafter here starts from the head's proposal for the token after the root (the last
accepted token x_n): its draft-vocabulary logits and the un-normed hidden state that
produced them (`drafters.head_state`). A node at depth d is the candidate for x_{n+d}; the
head consumes it at draft position n + d - 1 together with its parent's output hidden state.
Tree nodes are run through the head with a tree mask over the committed draft cache,
re-feeding the frontier's expanded ancestors each round (their K/V are recomputed, so
the cache is only read and never holds speculative rows).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from eaglejax.decoding import lookup
from eaglejax.decoding.drafters import Head, drafter
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.tree import Tree


class Drafted(NamedTuple):
    """One round's draft: the tree to verify, the draft distributions [B,K,V] of a sampled
    chain (None otherwise), and the lookup branch (None without one): the copied tokens
    [B,L], the rows [B] where their match held `lookup_ngram` tokens or more, and each row's
    match length [B]."""

    tree: Tree
    probs: jax.Array | None
    branch: tuple[jax.Array, jax.Array, jax.Array] | None


def draft_round(head: Head, state: Any, token: jax.Array, spec: SpecConfig, greedy: bool,
                sampling: SamplingParams, keys: jax.Array, vocab: int, context: jax.Array,
                context_lengths: jax.Array, history: jax.Array | None = None,
                searched: tuple[jax.Array, jax.Array] | None = None) -> Drafted:
    """The draft `spec` asks for, from its drafter's `state`, rooted at `token` [B] (the last
    accepted one); with `spec.lookup`, a branch copied from each row's context [B,C]
    (x_0..x_n, n = `context_lengths`), after the `history` of earlier replies [H] with
    `spec.lookup_history` (None: no history), grafted on or fitted in; `searched`: that
    search's result (`context_match`) when the round already made it."""
    tree, probs = drafter(spec.method).draft(head, state, token, spec, greedy, sampling, keys,
                                             vocab)
    if not spec.lookup:
        return Drafted(tree, probs, None)
    copied, length = searched or context_match(spec, context, context_lengths, history)
    matched = length >= spec.lookup_ngram
    if spec.lookup_replaces:
        tree = lookup.fit(tree, copied, matched, spec.draft_depth, spec.lookup)
    else:
        tree = lookup.graft(tree, copied, spec.draft_depth, spec.lookup)
    return Drafted(tree, probs, (copied[:, :spec.draft_depth + spec.lookup], matched, length))


def context_match(spec: SpecConfig, context: jax.Array, context_lengths: jax.Array,
                  history: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The lookup branch's search (`lookup.continuation`, over the history of earlier replies
    too with `spec.lookup_history`): the tokens any of the shape's rounds may copy [B,T]
    and each row's match length [B]."""
    if spec.lookup_history and history is not None:
        context, context_lengths = lookup.with_history(history, context, context_lengths)
    count = max(spec.draft_depth + spec.lookup, spec.long_lookup)
    return lookup.continuation(context, context_lengths, count)
