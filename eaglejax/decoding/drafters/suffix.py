"""Suffix drafting (method "suffix"): with no model, a tree of what followed the earlier
occurrences of the context's latest tokens (the idea of suffix decoding, arXiv 2411.04975,
over each row's own prompt and output and over the replies decoded before it:
`decoding.suffix_history`).

The drafter keeps each row's context (the shared history of earlier replies, then the
prompt, then every accepted token) and its length. A round finds the `top_k` earlier
positions whose tokens match the longest suffix of the context (`lookup.match_lengths`: up
to 8 tokens, separators matching nothing; among equally long matches, the latest), follows
each for up to `depth` tokens, merges continuations that share a prefix into one trie (a
continuation ends at the history's separators), and keeps the `total_tokens - 1` nodes that
the most matches pass through (a node's count never exceeds its parent's, and a parent comes
first among equals, so every kept node's parent is kept). Unused places in the tree hold the
root's token as extra children of the root. Deterministic: trees verify greedily or by
recursive rejection, exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from eaglejax.decoding.drafters.base import register
from eaglejax.decoding.lookup import match_lengths
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.tree import Tree, select_tree

if TYPE_CHECKING:
    from eaglejax.decoding.spec_config import SpecConfig


class SuffixDrafter:
    """State per row: context [B,H+C] (the history, x_0..x_n, then accepted tokens) and its
    length [B]. Its weights (`head`) are {"history": int32 [H]} or None (no history)."""

    drafts_with = None

    def prefill(self, head: dict[str, jax.Array] | None, spec: "SpecConfig", tokens: jax.Array,
                features: jax.Array, prompt_lengths: jax.Array, capacity: int, chunk: int
                ) -> tuple[jax.Array, jax.Array]:
        batch, width = tokens.shape
        history = jnp.zeros((0,), jnp.int32) if head is None else head["history"]
        context = jnp.zeros((batch, history.shape[0] + max(capacity, width)), jnp.int32)
        context = context.at[:, :history.shape[0]].set(history[None])
        context = context.at[:, history.shape[0]:history.shape[0] + width].set(tokens)
        return context, history.shape[0] + prompt_lengths + 1

    def draft(self, head: None, state: tuple[jax.Array, jax.Array], token: jax.Array,
              spec: "SpecConfig", greedy: bool, sampling: SamplingParams, keys: jax.Array,
              vocab: int) -> tuple[Tree, None]:
        context, length = state
        batch, width = context.shape
        matches, depth = spec.top_k, spec.depth
        rows = jnp.arange(batch)
        last = length - 1  # the root token's place
        # How many tokens ending at each earlier position equal the context's last ones.
        ends = jnp.arange(width)[None, :]
        match_length = match_lengths(context, last)
        found = (ends < last[:, None]) & (match_length > 0)
        best, position = jax.lax.top_k(jnp.where(found, match_length * width + ends, -1),
                                       matches)
        # Continuations [B,M,D] and where they exist.
        index = position[:, :, None] + 1 + jnp.arange(depth)[None, None, :]
        follow = context[rows[:, None, None], jnp.minimum(index, width - 1)]
        exists = ((best >= 0)[:, :, None] & (index <= last[:, None, None])
                  & (jnp.cumsum(follow < 0, axis=-1) == 0))  # up to a history separator
        # shared[b,m,q,d]: continuations m and q agree through depth d (both existing).
        agree = (follow[:, :, None] == follow[:, None]) & exists[:, :, None] & exists[:, None]
        shared = jnp.cumsum(~agree, axis=-1) == 0
        count = shared.sum(axis=2)  # [B,M,D] matches through each node
        first = jnp.argmax(shared, axis=2).astype(jnp.int32)  # the trie node's first match
        node = exists & (first == jnp.arange(matches)[None, :, None])
        parent = jnp.concatenate(
            [jnp.full((batch, matches, 1), -1, jnp.int32),
             (jnp.arange(depth - 1) * matches)[None, None, :] + first[:, :, :-1]], axis=2)
        # Candidates depth-major (a parent precedes its children); unused ones hang from the
        # root, ranked last.
        flat = lambda x: jnp.swapaxes(x, 1, 2).reshape(batch, depth * matches)  # noqa: E731
        node = flat(node)
        cand_tokens = jnp.where(node, flat(follow), token[:, None])
        cand_parents = jnp.where(node, flat(parent), -1)
        cand_scores = jnp.where(node, flat(count).astype(jnp.float32), -1.0)
        short = spec.total_tokens - 1 - depth * matches
        if short > 0:
            cand_tokens = jnp.concatenate(
                [cand_tokens, jnp.broadcast_to(token[:, None], (batch, short))], axis=1)
            cand_parents = jnp.pad(cand_parents, ((0, 0), (0, short)), constant_values=-1)
            cand_scores = jnp.pad(cand_scores, ((0, 0), (0, short)), constant_values=-1.0)
        return select_tree(token, cand_tokens, cand_scores, cand_parents, spec.total_tokens,
                           depth), None

    def longest_match(self, state: tuple[jax.Array, jax.Array]) -> jax.Array:
        """[B] the longest match `draft` ranks its tree by (0: none), for
        `SpecConfig.min_match`'s gate (computed before the gate's branch, where `draft`
        computes the matches again in the rounds that speculate)."""
        context, length = state
        last = length - 1
        earlier = jnp.arange(context.shape[1])[None, :] < last[:, None]
        return jnp.max(jnp.where(earlier, match_lengths(context, last), 0), axis=1)

    def catch_up(self, head: None, spec: "SpecConfig", state: tuple[jax.Array, jax.Array],
                 tokens: jax.Array, features: jax.Array, n_accepted: jax.Array,
                 running: jax.Array) -> tuple[jax.Array, jax.Array]:
        context, length = state
        batch, block = tokens.shape
        kept = running[:, None] & (jnp.arange(block)[None, :] < n_accepted[:, None])
        places = jnp.where(kept, length[:, None] + jnp.arange(block)[None, :],
                           context.shape[1])  # past the end: dropped
        context = context.at[jnp.arange(batch)[:, None], places].set(tokens, mode="drop")
        return context, length + jnp.where(running, n_accepted, 0)


register("suffix", shape="tree")(SuffixDrafter())
