"""What smaller trees would have accepted, counted on one round of the largest tree.

`speculative="auto"` (`eaglejax.decoding.autotune`) drafts the largest dynamic tree and, every
greedy round, counts per candidate size s the draft tokens the tree `total_tokens=s` would
have accepted: its s best-ranked nodes form exactly that tree (EAGLE-2 scores), and the
target's argmax at a node depends only on the node's path, so one verification answers
for every size.

With a context-lookup branch grafted onto the largest tree (`lookup.graft`), the same round
also answers for "size s with the branch in place of its weakest nodes" (`lookup.fit`):
where the match held `lookup_ngram` tokens or more, that tree is the s - n best nodes plus
the copied tokens hung under the deepest of those nodes already holding their prefix; every
node of it has a twin with the same path in the grafted largest tree, so its acceptance is
exact too.
Sizes up to `DEPTH_ONE_SIZES` stand for depth-1 trees, the root and its s - 1 best children
(`auto`'s two-token rounds on a CPU): counted exactly where the largest tree kept
those children (its depth-1 nodes are the root's best), from fewer where it kept fewer (a
lower bound: the largest tree spent its nodes deeper, below a confident first child).
With `long_copy` (a candidate whose rounds verify a long copy where the context matched
long: `SpecConfig.long_lookup`), one more column counts that candidate: in rounds where some
running row matched `long_ngram` tokens or more, the copied tokens the target agrees with
along the grafted branch (at most `long_lookup`: a lower bound where the branch, shorter than
the copy, was agreed to its end), elsewhere its own tree's column.
`calibration_loop` is the speculative loop with these counters beside its state: `auto`
runs it as its probe (`decoding.adaptive`); the loop that decodes a fixed shape
(`loops.decode_loop`) carries none of them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from eaglejax.decoding.acceptance import greedy_accepted_nodes
from eaglejax.decoding.loops import SpecLoop, Weights, goes_on
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.speculative import Round, SpecState
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.decoding.tree import Tree


# Sizes up to this count depth-1 trees; larger ones the best s nodes at any depth (EAGLE-2).
DEPTH_ONE_SIZES = 3


def _deepest(tree: Tree, nodes: jax.Array) -> jax.Array:
    """[B]: the greatest depth among `nodes` [B,N] (0 when none)."""
    return jnp.max(jnp.where(nodes, tree.depths, 0), axis=1)


def kept_nodes(tree: Tree, size: int, count: int, head_nodes: int) -> jax.Array:
    """[B,N]: the nodes of `tree` that the tree of `size` nodes pruned to its best `count`
    holds: the best `count` by rank; for a depth-1 size (<= `DEPTH_ONE_SIZES`), the root and
    its `count - 1` best children among the first `head_nodes` by rank (the head's, not a
    grafted branch's)."""
    if size > DEPTH_ONE_SIZES:
        return tree.ranks < count
    child = (tree.depths == 1) & (tree.ranks < head_nodes)
    better = jnp.sum(child[:, None, :] & (tree.ranks[:, None, :] < tree.ranks[:, :, None]),
                     axis=2)
    return (tree.depths == 0) | (child & (better < count - 1))


def subtree_acceptance(tree: Tree, target_logits: jax.Array, max_depth: int,
                       sizes: tuple[int, ...], head_nodes: int) -> jax.Array:
    """[B,S]: draft tokens the s-node subtree of `tree` accepts greedily, per size s (the
    best s nodes, or a depth-1 tree: `kept_nodes`; `head_nodes`: the head's tree size)."""
    accepted = greedy_accepted_nodes(tree, target_logits, max_depth)
    return jnp.stack([_deepest(tree, accepted & kept_nodes(tree, s, s, head_nodes))
                      for s in sizes], axis=1)


def on_copied_path(tree: Tree, copied: jax.Array, max_depth: int) -> jax.Array:
    """[B,N]: nodes whose root path spells a prefix of the copied tokens [B,L] (the root
    counts; siblings hold distinct tokens, so at most one node per depth)."""
    wanted = jnp.take_along_axis(copied, jnp.clip(tree.depths - 1, 0, copied.shape[1] - 1),
                                 axis=1)
    on_path = (tree.tokens == wanted) | (tree.depths == 0)
    up = jnp.maximum(tree.parents, 0)
    for _ in range(max_depth):
        on_path = on_path & jnp.take_along_axis(on_path, up, axis=1)
    return on_path


def lookup_subtree_acceptance(tree: Tree, target_logits: jax.Array, max_depth: int,
                              sizes: tuple[int, ...], copied: jax.Array, use: jax.Array,
                              lookup: int, head_nodes: int) -> jax.Array:
    """[B,S]: draft tokens `lookup.fit` of the s-node subtree (`kept_nodes`) with `lookup`
    copied tokens would accept greedily, per size s (> lookup), counted on `tree`: the
    largest tree (`head_nodes` nodes) with the same copied tokens [B,L] grafted
    (`lookup.graft`, ranks of grafted nodes past every head node's). Rows where not `use`
    [B] keep the head's s nodes."""
    accepted = greedy_accepted_nodes(tree, target_logits, max_depth)
    on_path = on_copied_path(tree, copied, max_depth)
    agreed = _deepest(tree, accepted & on_path)  # the copied tokens the target agrees with
    counts = []
    for s in sizes:
        kept = kept_nodes(tree, s, s - lookup, head_nodes)
        held = _deepest(tree, on_path & kept)  # where fit hangs the branch
        fitted = jnp.maximum(_deepest(tree, accepted & kept), jnp.minimum(agreed, held + lookup))
        whole = _deepest(tree, accepted & kept_nodes(tree, s, s, head_nodes))
        counts.append(jnp.where(use, fitted, whole))
    return jnp.stack(counts, axis=1)


def count_columns(spec: SpecConfig, sizes: tuple[int, ...],
                  long_copy: SpecConfig | None = None) -> int:
    """Columns of `round_counts`: S per lookup length 0..L, and one for `long_copy`."""
    return len(sizes) * (1 + spec.lookup) + (long_copy is not None)


def round_counts(done: Round, spec: SpecConfig, sizes: tuple[int, ...],
                 long_copy: SpecConfig | None = None) -> jax.Array:
    """[B,S*(1+L)] for one round: per size s, the draft tokens the best s-node subtree
    accepted; with a lookup branch of L tokens, L more blocks of S columns for a branch of
    1..L of those tokens in place of the weakest nodes (zero for rows already done); with
    `long_copy`, one more column: that candidate's (see the module docstring)."""
    tree, logits, depth = done.drafted.tree, done.target_logits, spec.max_depth
    head_nodes = spec.total_tokens
    counts = [subtree_acceptance(tree, logits, depth, sizes, head_nodes)]
    if spec.lookup:
        copied, matched, length = done.drafted.branch
        counts += [lookup_subtree_acceptance(tree, logits, depth, sizes, copied, matched, n,
                                             head_nodes)
                   for n in range(1, spec.lookup + 1)]
    if long_copy is not None:
        own = counts[long_copy.lookup][:, sizes.index(long_copy.total_tokens)]
        accepted = greedy_accepted_nodes(tree, logits, depth)
        agreed = _deepest(tree, accepted & on_copied_path(tree, copied, depth))
        copying = jnp.any(done.running & (length >= long_copy.long_ngram))
        counts.append(jnp.where(copying, jnp.minimum(agreed, long_copy.long_lookup),
                                own)[:, None])
    return done.running[:, None] * jnp.concatenate(counts, axis=1)


@functools.partial(jax.jit, static_argnames=("loop", "greedy", "stop", "sizes", "long_copy"),
                   donate_argnames=("state",))
def calibration_loop(loop: SpecLoop, weights: Weights, state: SpecState,
                     sampling: SamplingParams, max_new_tokens: jax.Array,
                     until: jax.Array | None = None, *, stop: StopCriteria,
                     sizes: tuple[int, ...], greedy: bool = True,
                     long_copy: SpecConfig | None = None) -> tuple[SpecState, jax.Array]:
    """Speculative decoding with the largest dynamic tree `loop.spec` (a lookup branch, if
    any, grafted) until every row finishes (or the state has run `until` target forwards),
    and the summed `round_counts` [B,C]: exact for greedy rounds (a long copy's: a lower
    bound); for sampled ones, what each smaller tree would have accepted had the target's
    choice been its argmax."""
    spec = loop.spec
    if not spec.is_dynamic_tree or spec.lookup_replaces or spec.long_lookup:
        raise ValueError(f"calibration counts need a dynamic tree whose lookup branch (if any) "
                         f"is grafted, not {spec.describe()}")
    check_long_copy(spec, sizes, long_copy)
    play = loop.verified_step(weights, sampling, max_new_tokens, greedy=greedy, stop=stop)

    def step(carry: tuple[SpecState, jax.Array]) -> tuple[SpecState, jax.Array]:
        s, counts = carry
        s, done = play(s)
        return s, counts + round_counts(done, spec, sizes, long_copy)

    batch = state.last_token.shape[0]
    counts = jnp.zeros((batch, count_columns(spec, sizes, long_copy)), jnp.int32)
    return jax.lax.while_loop(lambda carry: goes_on(carry[0], until), step, (state, counts))


def check_long_copy(spec: SpecConfig, sizes: tuple[int, ...],
                    long_copy: SpecConfig | None) -> None:
    """ValueError unless the probe `spec` can count `long_copy` (None: nothing to count): a
    candidate with a long copy, its size among `sizes`, its branch no longer than the
    probe's (whose column it then counts from)."""
    if long_copy is None:
        return
    if not long_copy.long_lookup or long_copy.total_tokens not in sizes \
            or not 0 < long_copy.lookup <= spec.lookup:
        raise ValueError(f"the probe {spec.describe()} with sizes {sizes} cannot count "
                         f"{long_copy.describe()}")
