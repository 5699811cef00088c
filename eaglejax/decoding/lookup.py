"""Draft tokens copied from the context (prompt lookup), grafted onto the head's tree.

Text often repeats itself: a name, a code identifier, a list format, a phrase from the
prompt, and (with small greedy models) whole loops. Per row, the context x_0..x_n is
searched for the earlier position whose last tokens match the context's last ones longest
(up to `MAX_MATCH` tokens, as suffix drafting ranks them), the latest among equally long
matches; the tokens that followed it are the continuation. Past x_n the continuation
repeats with the match's period, so a loop is followed as far as it goes. No head forward
is needed.

With history (`SpecConfig.lookup_history`), the search runs over the replies decoded before
(`decoding.suffix_history`: each followed by a separator, -1) placed before x_0, by the
same rule, as suffix drafting searches them: a longer match in an earlier reply wins, an
equally long one in the row's own context (the latest) wins over it. A continuation stops
at a separator (what follows is the root token again), and a match right before one is
none.

The continuation is grafted onto the round's draft tree: it walks down the tree while a
child holds its next token, and the rest hangs as a chain under the deepest such node, so
it never duplicates a sibling (greedy acceptance and recursive rejection both stay exact:
the grafted tree is one more deterministic draft tree). `fit` keeps the node count instead:
where the match holds at least `SpecConfig.lookup_ngram` tokens, the branch takes the place
of the head's lowest-ranked nodes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eaglejax.decoding.suffix_history import SEPARATOR
from eaglejax.decoding.tree import Tree, tree_from_parents
from eaglejax.native import lookup_match

MAX_MATCH = 8  # the longest suffix a match is ranked by (with history, requests repeating an
# earlier one accepted 4.80 tokens a round where ranking by 3 gave 4.36; BENCHMARKS.md, session 43)


def with_history(history: jax.Array, context: jax.Array, last: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """The history of earlier replies [H] (ending with a separator) before each row's
    context [B,C], and the index of each row's last token there ([B,H+C], last + H)."""
    batch = context.shape[0]
    searched = jnp.concatenate(
        [jnp.broadcast_to(history[None].astype(context.dtype), (batch, history.shape[0])),
         context], axis=1)
    return searched, last + history.shape[0]


def match_lengths(context: jax.Array, last: jax.Array) -> jax.Array:
    """[B,W]: how many of the tokens ending at each position of context [B,W] equal the
    tokens ending at index last [B] (up to `MAX_MATCH`; separators match nothing)."""
    batch, width = context.shape
    ends = jnp.arange(width)[None, :]
    matched = jnp.ones((batch, width), bool)
    length = jnp.zeros((batch, width), jnp.int32)
    for j in range(MAX_MATCH):
        suffix = context[jnp.arange(batch), jnp.maximum(last - j, 0)]
        earlier = jnp.roll(context, j, axis=1)  # earlier[:, i] = context[:, i - j]
        matched = (matched & (ends >= j) & (last[:, None] >= j) & (earlier == suffix[:, None])
                   & (suffix != SEPARATOR)[:, None])
        length = length + matched
    return length


def continuation(context: jax.Array, last: jax.Array, count: int
                 ) -> tuple[jax.Array, jax.Array]:
    """([B,count] tokens following the latest earlier occurrence of the longest suffix of
    context [B,C] (valid through index last [B]; `match_lengths`), that match's length
    [B]); a row with no match at all proposes its last token again. The context may hold
    separators (`with_history`): they match nothing, no match ends right before one, and a
    continuation reaching one proposes the last token from there on. On CPU one native pass
    per row (`native.lookup_match`)."""
    if lookup_match.applies(context):
        return lookup_match.continuation(context, last, count,
                                         lambda c, n: _continuation(c, n, count))
    return _continuation(context, last, count)


def _continuation(context: jax.Array, last: jax.Array, count: int
                  ) -> tuple[jax.Array, jax.Array]:
    """`continuation` with XLA's operations."""
    width = context.shape[1]
    rows = jnp.arange(context.shape[0])[:, None]
    ends = jnp.arange(width)[None, :]  # candidate position i of the occurrence's last token
    followed = jnp.roll(context, -1, axis=1) != SEPARATOR  # by a token, not a separator
    score = jnp.where((ends < last[:, None]) & followed,
                      match_lengths(context, last) * width + ends, -1)
    start = jnp.argmax(score, axis=1)[:, None]  # ties never happen: positions differ
    period = jnp.maximum(last[:, None] - start, 1)
    index = start + 1 + jnp.arange(count)[None, :] % period
    found = jnp.maximum(jnp.max(score, axis=1) // width, 0)
    copied = context[rows, jnp.minimum(index, last[:, None])]
    ended = jnp.cumsum(copied == SEPARATOR, axis=1) > 0
    return jnp.where(ended, context[rows, last[:, None]], copied), found


def graft(tree: Tree, tokens: jax.Array, draft_depth: int, count: int) -> Tree:
    """Append `count` nodes to `tree` (of depth <= draft_depth): the continuation tokens
    [B, draft_depth + count] after the prefix the tree already holds, as a chain under the
    node holding that prefix. The result has depth <= draft_depth + count."""
    node_tokens, parents, ranks = _grafted(tree.tokens, tree.parents, tree.ranks, tokens,
                                           draft_depth, count)
    return tree_from_parents(node_tokens, parents, draft_depth + count, ranks)


def _grafted(node_tokens: jax.Array, parents: jax.Array, ranks: jax.Array, tokens: jax.Array,
             draft_depth: int, count: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`graft` on a tree's node arrays (tokens, parents, ranks [B,N]), before the tree's
    masks and paths are built."""
    batch, n_nodes = node_tokens.shape
    rows = jnp.arange(batch)
    node = jnp.zeros((batch,), jnp.int32)
    held = jnp.zeros((batch,), jnp.int32)
    walking = jnp.ones((batch,), bool)
    for d in range(draft_depth):
        child = (parents == node[:, None]) & (node_tokens == tokens[:, d][:, None])
        found = walking & jnp.any(child, axis=1)
        node = jnp.where(found, jnp.argmax(child, axis=1), node).astype(jnp.int32)
        held = held + found
        walking = found
    chain = tokens[rows[:, None], held[:, None] + jnp.arange(count)[None, :]]
    chain_parents = jnp.concatenate(
        [node[:, None], jnp.broadcast_to(jnp.arange(n_nodes, n_nodes + count - 1, dtype=jnp.int32),
                                         (batch, count - 1))], axis=1)
    new_ranks = jnp.broadcast_to(jnp.arange(n_nodes, n_nodes + count, dtype=jnp.int32),
                                 (batch, count))
    return (jnp.concatenate([node_tokens, chain], axis=1),
            jnp.concatenate([parents, chain_parents], axis=1),
            jnp.concatenate([ranks, new_ranks], axis=1))


def _pruned(tree: Tree, keep: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Node arrays (tokens, parents, ranks) of the subtree of the `keep` best-ranked nodes
    (ranks make such a set closed under parents: a dynamic tree's draft scores, a chain's or
    static tree's node order)."""
    batch, n_nodes = tree.tokens.shape
    rows = jnp.arange(batch)[:, None]
    order = jnp.argsort(tree.ranks >= keep, axis=1, stable=True)[:, :keep]  # node order
    new_index = jnp.full((batch, n_nodes), -1, jnp.int32).at[rows, order].set(
        jnp.arange(keep, dtype=jnp.int32)[None, :])
    old_parents = jnp.take_along_axis(tree.parents, order, axis=1)
    parents = jnp.where(old_parents < 0, -1,
                        jnp.take_along_axis(new_index, jnp.maximum(old_parents, 0), axis=1))
    return (jnp.take_along_axis(tree.tokens, order, axis=1), parents,
            jnp.take_along_axis(tree.ranks, order, axis=1))


def fit(tree: Tree, tokens: jax.Array, use: jax.Array, draft_depth: int, count: int) -> Tree:
    """Rows where `use` [B]: the tree's best `N - count` nodes with the continuation grafted
    (`graft`); other rows: the tree as it is. Either way N nodes, depth <= draft_depth + count."""
    n_nodes = tree.tokens.shape[1]
    grafted = _grafted(*_pruned(tree, n_nodes - count), tokens, draft_depth, count)
    whole = (tree.tokens, tree.parents, tree.ranks)
    node_tokens, parents, ranks = (jnp.where(use[:, None], a, b) for a, b in zip(grafted, whole))
    return tree_from_parents(node_tokens, parents, draft_depth + count, ranks)


def write_context(context: jax.Array, tokens: jax.Array, start: jax.Array) -> jax.Array:
    """Write tokens [B,T] into context [B,C] at each row's index start [B] (past C: dropped)."""
    index = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
    return context.at[jnp.arange(context.shape[0])[:, None], index].set(tokens, mode="drop")
