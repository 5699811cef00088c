"""Speculative decoding: the prefill state and one round, which `decoding.loops.SpecLoop`
runs inside one `lax.while_loop`.

Bookkeeping (per row): the target cache holds tokens x_0..x_{n-1}; the newest token x_n is
recorded but not yet in the cache. The drafter of `spec.method` keeps its own state
(`decoding.drafters`; an EAGLE head's: its cache of positions 0..n-1 and its proposal for
x_{n+1}, `drafters.head_state`). One round:
  1. draft (`drafting`): the drafter's tree (a chain of K tokens, an EAGLE-2 dynamic tree,
     a static tree, P-EAGLE's chain or lattice tree), rooted at x_n;
  2. verify: the target runs the tree's nodes in one forward, each at position n + depth,
     under the tree mask; greedy acceptance keeps the deepest node whose whole path matches
     the target's argmax, plus the target's bonus token there; sampling is lossless
     (a sampled chain: min(1, p/q); a tree: recursive rejection over siblings);
  3. commit: the accepted path's target K/V rows are written to consecutive slots after
     the prefix (a chain's are already in place); the tokens enter the output one by one
     so EOS, stop sequences and max_new_tokens cut exactly;
  4. catch-up: the drafter takes in the accepted block with the TARGET's features of the
     path's positions (the EAGLE head runs over it and proposes the next round's root
     children).
With `spec.lookup`, the loop also keeps each row's context x_0..x_n and grafts a branch
copied from it (and with `spec.lookup_history`, from the replies decoded before, an input
of the round like the weights) onto every round's tree (`decoding.lookup`); with
`spec.long_lookup`, rounds where the context matched long verify a longer copy alone.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.config import ModelConfig
from eaglejax.decoding import lookup
from eaglejax.decoding.acceptance import tree_greedy_accept, tree_sample_accept, verify
from eaglejax.decoding.drafters import Head, drafter
from eaglejax.decoding.drafters.draft_model import ModelHead
from eaglejax.decoding.drafting import Drafted, context_match, draft_round
from eaglejax.decoding.output import Output, empty_output, record, row_step_keys
from eaglejax.decoding.prefill import PREFILL_CHUNK, Prefilled, prefill_target
from eaglejax.decoding.sampling import SamplingParams, sample_tokens
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.stopping import StopCriteria, StopTable
from eaglejax.decoding.tree import Tree, chain_tree, tree_from_parents
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.head import to_target_ids
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import ForwardOutput, Params, forward, lm_head


class SpecState(NamedTuple):
    """Everything the speculative loop carries (see the module docstring)."""

    target_cache: kv_cache.KVCache
    last_token: jax.Array  # [B] x_n
    out: Output
    row_keys: jax.Array  # [B] PRNG keys, one per row (sampling)
    accept_hist: jax.Array  # [B,D+1] rounds per row that accepted exactly a draft tokens
    forwards: jax.Array  # int32 scalar: target forwards in the loop
    context: jax.Array  # [B,C] x_0..x_n per row when spec.lookup, else [B,0]
    drafter: Any  # the drafter's own state (EAGLE heads: `drafters.HeadState`)


# A round's phases in order; `SpecLoop(..., through=phase)` stops each round after it (the
# rounds of "loop" only split keys and count), for timing what each phase costs
# (`eaglejax.round_split`). "accept" includes the commit and the output's recording.
PHASES = ("loop", "draft", "verify", "accept", "catch_up")


class Round(NamedTuple):
    """What one round drafted and what the target made of it (for counters kept outside the
    loop state, e.g. `decoding.calibration`)."""

    drafted: Drafted
    target_logits: jax.Array  # [B,N,V] at the tree's nodes
    running: jax.Array  # [B] rows that were still generating


def tap_layers(draft_config: DraftConfig | ModelConfig | None) -> tuple[int, ...]:
    """The target layers whose inputs the head reads (none: EAGLE-1, a draft model, or no
    draft)."""
    return draft_config.tap_layers if isinstance(draft_config, DraftConfig) else ()


def target_features(out: ForwardOutput | Prefilled,
                    draft_config: DraftConfig | ModelConfig | None) -> jax.Array:
    """The target features a drafter consumes: taps (EAGLE-3) or final normed hidden
    (EAGLE-1, or no head)."""
    return out.taps if tap_layers(draft_config) else out.hidden


def bind_head(params: Params, draft_params: Params | None,
              draft_config: DraftConfig | ModelConfig | None, d2t: jax.Array | None,
              attn_impl: AttentionImpl, history: jax.Array | None = None
              ) -> Head | ModelHead | dict[str, jax.Array] | None:
    """The draft weights bound inside the compiled loop: a head bound to its target, a draft
    model (its `d2t` spans the ids it shares with the target), or with neither, what a
    model-free drafter reads: {"history": the history of earlier replies} (suffix
    drafting's, `decoding.suffix_history`), None without one."""
    if draft_config is None:
        return None if history is None else {"history": history}
    if isinstance(draft_config, ModelConfig):
        return ModelHead(draft_params, draft_config,
                         to_target_ids(jnp.arange(d2t.shape[0]), d2t), attn_impl)
    return Head(draft_params, draft_config, params,
                to_target_ids(jnp.arange(draft_config.draft_vocab_size), d2t), attn_impl)


def prefill_state(params: Params, config: ModelConfig, draft_params: Params | None,
                  draft_config: DraftConfig | ModelConfig | None, d2t: jax.Array | None,
                  prompt: jax.Array, prompt_lengths: jax.Array, row_keys: jax.Array,
                  sampling: SamplingParams, max_new_tokens: jax.Array, *, capacity: int,
                  max_tokens: int, spec: SpecConfig, greedy: bool, stop: StopCriteria | StopTable,
                  attn_impl: AttentionImpl = "auto",
                  prefill_chunk: int = PREFILL_CHUNK,
                  cached: Cached | None = None, logprobs: int | None = None,
                  history: jax.Array | None = None) -> SpecState:
    """Prefill the target and the drafter on right-padded prompts (`prefill_chunk`
    positions at a time); record the first token (an output keeping `logprobs` most likely
    tokens' log-probabilities, if not None). With `cached` (a head's drafter only), `prompt`
    is what follows the rows it holds (`Cached`). `history`: the replies decoded before
    (`decoding.suffix_history`) for a drafter that reads them, if any."""
    batch = prompt.shape[0]
    prefilled = prefill_target(params, config, prompt, prompt_lengths, capacity,
                               tap_layers(draft_config), attn_impl, prefill_chunk,
                               cached=None if cached is None else cached.target)
    output = empty_output(batch, max_tokens, logprobs)
    first = sample_tokens(prefilled.logits, sampling, row_step_keys(row_keys, output.counts),
                          greedy)
    output = record(output, first, output.running, stop, max_new_tokens, prefilled.logits)
    # Each row's tokens x_0..x_n: its prompt, then the first new token.
    tokens = jnp.pad(prompt, ((0, 0), (0, 1))).at[jnp.arange(batch), prompt_lengths].set(first)
    head = bind_head(params, draft_params, draft_config, d2t, attn_impl, history)
    features = target_features(prefilled, draft_config)
    if cached is None:
        drafted = drafter(spec.method).prefill(head, spec, tokens, features, prompt_lengths,
                                               capacity, prefill_chunk)
    else:
        drafted = drafter(spec.method).prefill(head, spec, tokens, features, prompt_lengths,
                                               capacity, prefill_chunk, cached=cached.head)
        prompt, prompt_lengths = cached.prompt, cached.target.lengths + prompt_lengths
    context = jnp.zeros((batch, capacity if spec.lookup else 0), jnp.int32)
    if spec.lookup:
        context = lookup.write_context(context.at[:, :prompt.shape[1]].set(prompt),
                                       first[:, None], prompt_lengths)
    return SpecState(prefilled.cache, first, output, row_keys,
                     jnp.zeros((batch, spec.max_depth + 1), jnp.int32), jnp.int32(0), context,
                     drafted)


class Cached(NamedTuple):
    """What a prefill continues from (the serving engine's prefix cache): the target's and
    the head's caches holding each row's first positions (the same count in both), and the
    whole prompts [B,P'] (right-padded) for the context-lookup branch."""

    target: kv_cache.KVCache
    head: kv_cache.KVCache
    prompt: jax.Array


def round_step(*args, **kwargs) -> Callable[[SpecState], SpecState]:
    """One speculative round as a function SpecState -> SpecState (arguments as for
    `verified_round`)."""
    play = verified_round(*args, **kwargs)
    return lambda s: play(s)[0]


def verified_round(params: Params, config: ModelConfig, draft_params: Params | None,
                   draft_config: DraftConfig | ModelConfig | None, d2t: jax.Array | None,
                   sampling: SamplingParams,
                   max_new_tokens: jax.Array, *, spec: SpecConfig, greedy: bool,
                   stop: StopCriteria | StopTable, attn_impl: AttentionImpl = "auto",
                   through: str = "catch_up", history: jax.Array | None = None
                   ) -> Callable[[SpecState], tuple[SpecState, Round | None]]:
    """One speculative round as a function SpecState -> (SpecState, Round), traced inside a
    loop: draft (`drafting.draft_round`; `history`: the replies decoded before, for a lookup
    branch that searches them), verify in one target forward (`acceptance.verify`:
    greedy matching, or lossless speculative sampling when not `greedy`), commit, catch up.
    With `through` before "catch_up" (see `PHASES`), a truncated round for timing: it stops
    after that phase, counts a forward and returns no Round; the state keeps what the
    remaining phases would have changed (as far as the phase run changes it).
    With `spec.min_match` a round whose longest suffix match is too short is a plain step:
    one branch drafts, verifies and accepts, the other runs the target at the root alone
    (its "draft" phase is the match's length, its "verify" phase the whole branch).
    With `spec.long_lookup` a round where some running row's context match is long verifies
    the root and that many copied tokens as a chain instead of the shape's own round; each
    branch commits and catches up at its own width (the "draft" phase is the search and the
    own round's draft, the "verify" phase the whole branch taken); its rounds return no
    Round (their trees differ in size: `calibration` refuses such shapes)."""
    if through not in PHASES:
        raise ValueError(f"through={through!r}: expected one of {PHASES}")
    depth = spec.max_depth
    head = bind_head(params, draft_params, draft_config, d2t, attn_impl, history)
    method = drafter(spec.method)
    own = spec.without_long_lookup()  # the shape's own rounds (no long copy)
    in_place = spec.is_chain and not spec.lookup  # accepted rows need no commit
    spec.check_sampling(greedy)

    def step(s: SpecState) -> tuple[SpecState, Round]:
        running = s.out.running
        rows = jnp.arange(running.shape[0])
        # A row's randomness depends only on its seed and how many tokens it has.
        keys = jax.vmap(lambda key: jax.random.split(key, depth + 1))(
            row_step_keys(s.row_keys, s.out.counts))
        if through == "loop":
            return _counted(s, keys), None

        def drafted_round(searched: tuple | None = None) -> Drafted:
            return draft_round(head, s.drafter, s.last_token, own, greedy, sampling, keys,
                               config.vocab_size, s.context, s.target_cache.lengths, history,
                               searched)

        def verify_forward(tree: Tree, nodes: int) -> tuple[ForwardOutput, jax.Array]:
            """The target over the tree's first `nodes` nodes, its outputs padded to all."""
            positions = s.target_cache.lengths[:, None] + tree.depths[:, :nodes]
            out = forward(params, config, tree.tokens[:, :nodes], positions, s.target_cache,
                          mask=tree.mask[:, :nodes, :nodes],
                          tap_layers=tap_layers(draft_config), attn_impl=attn_impl)
            return _pad_nodes((out, lm_head(params, out.hidden)), tree.tokens.shape[1])

        def speculative(searched: tuple | None = None) -> tuple:
            drafted = drafted_round(searched)
            verified, logits = verify_forward(drafted.tree, drafted.tree.tokens.shape[1])
            return drafted, verified, logits, verify(drafted.tree, logits, drafted.probs, own,
                                                     greedy, sampling, keys[:, depth])

        def plain_step() -> tuple:
            """The target alone at the root, shaped as `speculative`'s round."""
            shape = jax.eval_shape(drafted_round).tree
            batch, nodes = shape.tokens.shape
            # the root's token again as every other node, each a child of the root
            tree = tree_from_parents(jnp.broadcast_to(s.last_token[:, None], (batch, nodes)),
                                     jnp.broadcast_to(jnp.arange(nodes) > 0, (batch, nodes)) - 1,
                                     shape.paths.shape[2] - 1)
            verified, logits = verify_forward(tree, 1)
            zeros = jnp.zeros_like(s.last_token)
            accepted = (jnp.zeros((zeros.shape[0], depth + 1), jnp.int32), zeros,
                        sample_tokens(logits[:, 0], sampling, keys[:, depth], greedy))
            return Drafted(tree, None, None), verified, logits, accepted

        def finish(node_tokens: jax.Array, verified: ForwardOutput, logits: jax.Array,
                   accepted: tuple[jax.Array, jax.Array, jax.Array]) -> SpecState:
            """Commit what a verified round accepted (paths [B,W+1] of W + 1 nodes, W draft
            tokens at most), record it, catch the drafter up (stopping after `through`)."""
            if through == "verify":  # the K/V rows written, the cache's lengths unchanged
                return _counted(s._replace(target_cache=verified.cache), logits,
                                target_features(verified, draft_config))
            path, n_accepted, bonus = accepted
            # Emitted this round: the accepted draft tokens, then the bonus; one at a time so
            # EOS, stop sequences and max_new_tokens cut exactly.
            path_tokens = jnp.take_along_axis(node_tokens, path, axis=1)
            emitted = jnp.where(jnp.arange(path.shape[1])[None, :] < n_accepted[:, None],
                                jnp.roll(path_tokens, -1, axis=1), bonus[:, None])
            out = s.out
            # Emitted token j was drawn from the target's distribution at path node j.
            at_path = None if out.logprobs is None else jnp.take_along_axis(
                logits, path[:, :, None], axis=1)
            for j in range(path.shape[1]):
                out = record(out, emitted[:, j], j <= n_accepted, stop, max_new_tokens,
                             None if at_path is None else at_path[:, j])
            advance = jnp.where(running, n_accepted + 1, 0)
            features = target_features(verified, draft_config)
            target_cache = verified.cache
            if not in_place:
                target_cache = kv_cache.write_rows(target_cache, verified.k_new,
                                                   verified.v_new, path)
                features = jnp.take_along_axis(features, path[:, :, None], axis=1)
            target_cache = target_cache._replace(lengths=s.target_cache.lengths + advance)
            last_token = jnp.where(running, bonus, s.last_token)
            if through == "accept":
                return _counted(s._replace(target_cache=target_cache, out=out,
                                           last_token=last_token), features, emitted)
            # Rows that were already done keep the drafter's state.
            caught_up = method.catch_up(head, own, s.drafter, emitted, features, advance,
                                        running)
            context = s.context
            if spec.lookup:
                context = lookup.write_context(context, emitted, s.target_cache.lengths + 1)
            hist = s.accept_hist.at[rows, n_accepted].add(running.astype(jnp.int32))
            return SpecState(target_cache, last_token, out, s.row_keys, hist, s.forwards + 1,
                             context, caught_up)

        def own_round(searched: tuple) -> SpecState:
            drafted, verified, logits, accepted = speculative(searched)
            return finish(drafted.tree.tokens, verified, logits, accepted)

        def long_copy(searched: tuple) -> SpecState:
            """The root and `spec.long_lookup` copied tokens, verified as one chain."""
            tree = chain_tree(s.last_token, searched[0][:, :spec.long_lookup])
            verified, logits = verify_forward(tree, spec.long_lookup + 1)
            accepted = (tree_greedy_accept(tree, logits, spec.long_lookup) if greedy else
                        tree_sample_accept(tree, logits, sampling, keys[:, depth],
                                           spec.long_lookup, 1))
            return finish(tree.tokens, verified, logits, accepted)

        if spec.long_lookup:  # a long copy where some running row's match is long enough
            searched = context_match(spec, s.context, s.target_cache.lengths, history)
            if through == "draft":
                return _counted(s, searched, drafted_round(searched)), None
            copying = jnp.any(running & (searched[1] >= spec.long_ngram))
            return jax.lax.cond(copying, long_copy, own_round, searched), None
        if spec.min_match:  # a plain step unless some running row's match is long enough
            if through == "draft":
                return _counted(s, method.longest_match(s.drafter)), None
            speculate = jnp.any(running & (method.longest_match(s.drafter) >= spec.min_match))
            drafted, verified, logits, accepted = jax.lax.cond(speculate, speculative,
                                                               plain_step)
        else:
            if through == "draft":
                return _counted(s, drafted_round()), None
            drafted, verified, logits, accepted = speculative()
        state = finish(drafted.tree.tokens, verified, logits, accepted)
        return state, None if through != "catch_up" else Round(drafted, logits, running)

    return step


def _pad_nodes(tree: Any, nodes: int) -> Any:
    """Every array of `tree` but KV caches padded with zeros along axis 1 (nodes) to
    `nodes`."""
    def pad(x):
        if isinstance(x, kv_cache.KVCache) or x.shape[1] == nodes:
            return x
        return jnp.pad(x, [(0, 0), (0, nodes - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

    return jax.tree.map(pad, tree, is_leaf=lambda x: isinstance(x, kv_cache.KVCache))


def _counted(state: SpecState, *results) -> SpecState:
    """`state` after a truncated round: one more forward counted, and the next round's
    inputs made to depend on the phase's `results` (a reduction the compiler cannot see
    through), so the work that produced them is kept and never hoisted out of the loop as
    invariant; no value changes (unless a result is NaN)."""
    total = sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(results))
    keep = lambda x: jnp.where(jnp.isnan(total), jnp.zeros_like(x), x)  # noqa: E731
    drafter_state = jax.tree.map(  # every leaf but KV caches (too large to pass through)
        lambda x: x if isinstance(x, kv_cache.KVCache) else jax.tree.map(keep, x),
        state.drafter, is_leaf=lambda x: isinstance(x, kv_cache.KVCache))
    return state._replace(forwards=state.forwards + 1, last_token=keep(state.last_token),
                          drafter=drafter_state)
