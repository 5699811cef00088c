"""Drafting one speculative round with an EAGLE head: a chain, P-EAGLE's parallel chain or
lattice tree, a dynamic tree or a static tree, plus an optional context-lookup branch
(`draft_round` picks the drafter the `SpecConfig` names).

Every drafter starts from the head's proposal for the token after the root (the last
accepted token x_n): its draft-vocabulary logits and the un-normed hidden state that
produced them. A node at depth d is the candidate for x_{n+d}; the head consumes it at
draft position n + d - 1 together with its parent's output hidden state.
Tree nodes are run through the head with a tree mask over the committed draft cache,
re-feeding the frontier's expanded ancestors each round (their K/V are recomputed, so
the cache is only read and never holds speculative rows).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.decoding import lookup
from eaglejax.decoding.sampling import SamplingParams, argmax_last, draft_sample
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.tree import (
    StaticShape,
    Tree,
    chain_tree,
    select_tree,
    static_shape,
    tree_from_parents,
)
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.head import draft_forward, head_logits
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import Params


class Head(NamedTuple):
    """A draft head bound to its target inside the compiled loop."""

    params: Params
    config: DraftConfig
    target_params: Params
    draft_ids: jax.Array  # [DV] target id of each draft-vocabulary index
    attn_impl: AttentionImpl

    def step(self, tokens: jax.Array, inputs: jax.Array, positions: jax.Array,
             cache: kv_cache.KVCache, mask: jax.Array | None = None):
        """Head outputs for tokens [B,T] fed with the head's own hidden states [B,T,H]."""
        return draft_forward(self.params, self.config, self.target_params, tokens, inputs,
                             positions, cache, from_features=False, mask=mask,
                             attn_impl=self.attn_impl)

    def log_probs(self, hidden: jax.Array) -> jax.Array:
        return jax.nn.log_softmax(head_logits(self.params, self.config, self.target_params,
                                              hidden), axis=-1)


class Root(NamedTuple):
    """Where a round starts, per row: the last accepted token, the head's logits [B,DV]
    (a P-EAGLE head's: [B,K,DV], one per draft position) and hidden state [B,H] proposing
    the next one, and the committed draft cache."""

    token: jax.Array
    logits: jax.Array
    hidden: jax.Array
    cache: kv_cache.KVCache


def top_k_last(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis of x [..., N], computed on x as a 2-D [M,N] array:
    XLA:CPU can turn a 3-D top-k into a full sort of all N entries (about 8 ms for
    [1,3,8192] on a 2-core CPU), where the 2-D call keeps its top-k kernel (<0.1 ms)."""
    values, index = jax.lax.top_k(x.reshape(-1, x.shape[-1]), k)
    return values.reshape(*x.shape[:-1], k), index.reshape(*x.shape[:-1], k)


def draft_chain(head: Head, root: Root, k: int, greedy: bool, sampling: SamplingParams,
                keys: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array | None]:
    """K tokens one after another [B,K] (argmax, or sampled from the warped draft with
    their distributions [B,K,V] returned for the min(1, p/q) rule). Single-token steps
    extend a scratch copy of the cache."""

    def propose(logits: jax.Array, key: jax.Array):
        if greedy:
            return head.draft_ids[argmax_last(logits)].astype(jnp.int32), None
        return draft_sample(logits, sampling, key, head.draft_ids, vocab)

    token, probs = propose(root.logits, keys[:, 0])
    drafted, dists, hidden, cache = [token], [probs], root.hidden, root.cache
    for i in range(1, k):
        out = head.step(token[:, None], hidden[:, None], cache.lengths[:, None], cache)
        cache = out.cache._replace(lengths=cache.lengths + 1)
        hidden = out.hidden[:, 0]
        token, probs = propose(head_logits(head.params, head.config, head.target_params, hidden),
                               keys[:, i])
        drafted.append(token)
        dists.append(probs)
    return jnp.stack(drafted, axis=1), None if greedy else jnp.stack(dists, axis=1)


def draft_parallel(head: Head, root: Root, greedy: bool, sampling: SamplingParams,
                   keys: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array | None]:
    """P-EAGLE: the K tokens [B,K] of the K proposals `root.logits` [B,K,DV] one forward
    made (argmax, or sampled with their distributions [B,K,V] returned for the min(1, p/q)
    rule: a slot's distribution does not depend on the tokens drafted before it)."""
    if greedy:
        return head.draft_ids[argmax_last(root.logits)].astype(jnp.int32), None
    drawn = [draft_sample(root.logits[:, i], sampling, keys[:, i], head.draft_ids, vocab)
             for i in range(root.logits.shape[1])]
    return (jnp.stack([token for token, _ in drawn], axis=1),
            jnp.stack([probs for _, probs in drawn], axis=1))


def draft_parallel_tree(root: Root, draft_ids: jax.Array, top_k: int, depth: int,
                        total_tokens: int) -> Tree:
    """A tree from one P-EAGLE forward's proposals `root.logits` [B,depth,DV]: EAGLE-2's
    expansion (`draft_dynamic_tree`) over the lattice of each slot's `top_k` tokens. A
    mask slot never sees the tokens drafted before it, so slot d's children are the same
    for every parent: no head call, only their scores (summed log-probabilities) differ."""
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


def draft_dynamic_tree(head: Head, root: Root, top_k: int, depth: int,
                       total_tokens: int) -> Tree:
    """EAGLE-2: expand the best `top_k` frontier nodes for `depth` rounds (one head call per
    round after the first), score candidates by cumulative log-probability and keep the
    best `total_tokens - 1` (see `tree.select_tree`)."""
    batch = root.token.shape[0]
    rows = jnp.arange(batch)[:, None]
    k = top_k
    scores, index = jax.lax.top_k(jax.nn.log_softmax(root.logits, axis=-1), k)
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
                           slot_mask[:, :hi, :hi]).hidden[:, lo:hi]  # [B,k,H]
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
                           mask).hidden
        picked = hidden[:, np.asarray(expanding) - 1]  # [B,E,H]
        logits = head_logits(head.params, head.config, head.target_params, picked)
        top = head.draft_ids[top_k_last(logits, width)[1]]  # [B,E,width]
        for j, i in enumerate(expanding):
            hidden_of[i], choices[i] = picked[:, j], top[:, j]
    return tree_from_parents(tokens, jnp.broadcast_to(jnp.asarray(parents), (batch, n_nodes)),
                             shape.max_depth)


class Drafted(NamedTuple):
    """One round's draft: the tree to verify, the draft distributions [B,K,V] of a sampled
    chain (None otherwise), and the lookup branch (None without one): the copied tokens
    [B,L] and the rows [B] where their whole n-gram matched."""

    tree: Tree
    probs: jax.Array | None
    branch: tuple[jax.Array, jax.Array] | None


def draft_round(head: Head, root: Root, spec: SpecConfig, greedy: bool,
                sampling: SamplingParams, keys: jax.Array, vocab: int, context: jax.Array,
                context_lengths: jax.Array) -> Drafted:
    """The draft `spec` asks for, rooted at `root`; with `spec.lookup`, a branch copied from
    each row's context [B,C] (x_0..x_n, n = `context_lengths`) grafted on or fitted in."""
    probs = None
    if spec.method == "chain":
        drafted, probs = draft_chain(head, root, spec.num_draft_tokens, greedy, sampling, keys,
                                     vocab)
        tree = chain_tree(root.token, drafted)
    elif spec.method == "parallel":
        drafted, probs = draft_parallel(head, root, greedy, sampling, keys, vocab)
        tree = chain_tree(root.token, drafted)
    elif spec.method == "parallel_tree":
        tree = draft_parallel_tree(root, head.draft_ids, spec.top_k, spec.depth,
                                   spec.total_tokens)
    elif spec.method == "tree":
        tree = draft_dynamic_tree(head, root, spec.top_k, spec.depth, spec.total_tokens)
    else:
        tree = draft_static_tree(head, root, static_shape(spec.paths))
    if not spec.lookup:
        return Drafted(tree, probs, None)
    copied, matched = lookup.continuation(context, context_lengths, spec.lookup_ngram,
                                          spec.draft_depth + spec.lookup)
    matched = matched >= spec.lookup_ngram
    if spec.lookup_replaces:
        tree = lookup.fit(tree, copied, matched, spec.draft_depth, spec.lookup)
    else:
        tree = lookup.graft(tree, copied, spec.draft_depth, spec.lookup)
    return Drafted(tree, probs, (copied, matched))
