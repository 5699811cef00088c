"""Speculative decoding with an EAGLE head, all inside one `lax.while_loop`.

Bookkeeping (per row): the target cache holds tokens x_0..x_{n-1}; the newest token x_n is
recorded but not yet in the cache. Draft position t consumes token x_{t+1} and the target
feature of position t; the draft cache holds positions 0..n-1, and its output at position
n-1 (logits and un-normed hidden state) proposes x_{n+1}. One round:
  1. draft (`drafting`): a chain of K tokens, an EAGLE-2 dynamic tree or a static tree,
     rooted at x_n; the chain is the degenerate tree;
  2. verify: the target runs the tree's nodes in one forward, each at position n + depth,
     under the tree mask; greedy acceptance keeps the deepest node whose whole path matches
     the target's argmax, plus the target's bonus token there; sampling is lossless
     (a sampled chain: min(1, p/q); a tree: recursive rejection over siblings);
  3. commit: the accepted path's target K/V rows are written to consecutive slots after
     the prefix (a chain's are already in place); the tokens enter the output one by one
     so EOS, stop sequences and max_new_tokens cut exactly;
  4. catch-up: the head runs over the accepted block with the TARGET's features of the
     path's positions, and proposes the root's children of the next round.
With `spec.lookup`, the loop also keeps each row's context x_0..x_n and grafts a branch
copied from it onto every round's tree (`decoding.lookup`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.decoding import lookup
from eaglejax.decoding.acceptance import verify
from eaglejax.decoding.drafters import Head, Root
from eaglejax.decoding.drafting import Drafted, draft_round
from eaglejax.decoding.output import Output, empty_output, record, row_step_keys
from eaglejax.decoding.prefill import PREFILL_CHUNK, Prefilled, prefill_target
from eaglejax.decoding.sampling import SamplingParams, sample_tokens
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.stopping import StopCriteria, StopTable
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.head import (
    compute_dtype as head_dtype,
    draft_forward,
    draft_forward_chunked,
    head_logits,
    mask_slots,
    to_target_ids,
)
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import ForwardOutput, Params, compute_dtype, forward, lm_head


class SpecState(NamedTuple):
    """Everything the speculative loop carries (see the module docstring)."""

    target_cache: kv_cache.KVCache
    draft_cache: kv_cache.KVCache
    last_token: jax.Array  # [B] x_n
    draft_logits: jax.Array  # [B,DV] the head's proposal for x_{n+1} ([B,K,DV]: P-EAGLE's)
    draft_hidden: jax.Array  # [B,H] the head's un-normed hidden state at position n-1
    out: Output
    row_keys: jax.Array  # [B] PRNG keys, one per row (sampling)
    accept_hist: jax.Array  # [B,D+1] rounds per row that accepted exactly a draft tokens
    forwards: jax.Array  # int32 scalar: target forwards in the loop
    context: jax.Array  # [B,C] x_0..x_n per row when spec.lookup, else [B,0]


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


def target_features(out: ForwardOutput | Prefilled, draft_config: DraftConfig) -> jax.Array:
    """The target features the head consumes: taps (EAGLE-3) or final normed hidden (EAGLE-1)."""
    return out.taps if draft_config.tap_layers else out.hidden


def catch_up(draft_params: Params, draft_config: DraftConfig, target_params: Params,
              cache: kv_cache.KVCache, tokens: jax.Array, features: jax.Array,
              n_accepted: jax.Array, attn_impl: AttentionImpl, slots: int | None = None):
    """Run the head over a block of new positions starting at each row's cache length, keep
    the first n_accepted [B] rows, and return (cache, logits, hidden) at the last kept one.

    `slots` (P-EAGLE; None otherwise) mask slots ride in the same forward after each row's
    last kept row (positions continuing from it, seeing the kept rows and each other only):
    logits [B,1+slots,DV], the next token's and the mask slots' proposals."""
    batch, block = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(block)[None, :]
    mask = None
    if slots is not None:
        slot_tokens, slot_features = mask_slots(draft_params, draft_config, batch, slots)
        tokens = jnp.concatenate([tokens, slot_tokens], axis=1)
        features = jnp.concatenate([features, slot_features.astype(features.dtype)], axis=1)
        last = cache.lengths + n_accepted - 1
        positions = jnp.concatenate(
            [positions, last[:, None] + jnp.arange(1, slots + 1)[None, :]], axis=1)
        width = block + slots
        causal = np.tril(np.ones((width, width), bool))  # then hide unkept rows from the slots
        unkept = jnp.arange(width)[None, :] >= n_accepted[:, None]  # [B,T]
        slot_rows = jnp.arange(width) >= block
        block_cols = jnp.arange(width) < block
        mask = causal[None] & ~(slot_rows[None, :, None] & (block_cols[None, None, :]
                                                            & unkept[:, None, :]))
    out = draft_forward(draft_params, draft_config, target_params, tokens, features, positions,
                        cache, mask=mask, attn_impl=attn_impl)
    hidden = out.hidden[jnp.arange(batch), n_accepted - 1]
    cache = out.cache._replace(lengths=cache.lengths + n_accepted)
    if slots is not None:
        proposing = jnp.concatenate([hidden[:, None], out.hidden[:, block:]], axis=1)
        return cache, head_logits(draft_params, draft_config, target_params, proposing), hidden
    return cache, head_logits(draft_params, draft_config, target_params, hidden), hidden


def _mask_slot_logits(draft_params: Params, draft_config: DraftConfig, target_params: Params,
                      cache: kv_cache.KVCache, count: int, attn_impl: AttentionImpl
                      ) -> jax.Array:
    """P-EAGLE's `count` mask slots after each row's committed draft cache (positions
    continuing from its last row): their proposals [B,count,DV]; nothing is committed."""
    batch = cache.lengths.shape[0]
    tokens, features = mask_slots(draft_params, draft_config, batch, count)
    positions = cache.lengths[:, None] + jnp.arange(count)[None, :]
    out = draft_forward(draft_params, draft_config, target_params, tokens,
                        features.astype(head_dtype(draft_params)), positions, cache,
                        attn_impl=attn_impl)
    return head_logits(draft_params, draft_config, target_params, out.hidden)


def _draft_prefill(draft_params: Params, draft_config: DraftConfig, target_params: Params,
                   cache: kv_cache.KVCache, tokens: jax.Array, features: jax.Array,
                   prompt_lengths: jax.Array, attn_impl: AttentionImpl, chunk: int):
    """Run the head over the whole (shifted) prompt into its empty cache, `chunk` positions
    at a time when longer; return (cache, logits, hidden) at each row's last position."""
    batch, prompt_len = tokens.shape
    if prompt_len <= chunk:  # attention among the new rows only
        positions = jnp.broadcast_to(jnp.arange(prompt_len)[None], (batch, prompt_len))
        out = draft_forward(draft_params, draft_config, target_params, tokens, features,
                            positions, attn_impl=attn_impl)
        cache = kv_cache.append(cache, out.k_new, out.v_new, prompt_lengths)
        hidden = out.hidden
    else:
        hidden, cache = draft_forward_chunked(draft_params, draft_config, target_params, tokens,
                                              features, cache, chunk=chunk, attn_impl=attn_impl)
        cache = cache._replace(lengths=prompt_lengths)
    hidden = hidden[jnp.arange(batch), prompt_lengths - 1]
    return cache, head_logits(draft_params, draft_config, target_params, hidden), hidden


def prefill_state(params: Params, config: ModelConfig, draft_params: Params,
                  draft_config: DraftConfig, prompt: jax.Array, prompt_lengths: jax.Array,
                  row_keys: jax.Array, sampling: SamplingParams, max_new_tokens: jax.Array, *,
                  capacity: int, max_tokens: int, spec: SpecConfig, greedy: bool,
                  stop: StopCriteria | StopTable, attn_impl: AttentionImpl = "auto",
                  prefill_chunk: int = PREFILL_CHUNK) -> SpecState:
    """Prefill the target and the head on right-padded prompts (`prefill_chunk` positions at
    a time); record the first token."""
    batch = prompt.shape[0]
    prefilled = prefill_target(params, config, prompt, prompt_lengths, capacity,
                               draft_config.tap_layers, attn_impl, prefill_chunk)
    cache, logits = prefilled.cache, prefilled.logits
    output = empty_output(batch, max_tokens)
    first = sample_tokens(logits, sampling, row_step_keys(row_keys, output.counts), greedy)
    output = record(output, first, output.running, stop, max_new_tokens)
    # Draft position t consumes token t+1: the prompt shifted left, then the first new token.
    rows = jnp.arange(batch)
    shifted = jnp.concatenate([prompt[:, 1:], prompt[:, :1]], axis=1)
    shifted = shifted.at[rows, prompt_lengths - 1].set(first)
    d = draft_config.decoder
    draft_cache = kv_cache.init_cache(d.num_layers, batch, capacity, d.num_kv_heads,
                                      d.head_dim, compute_dtype(params), heads_axis=None)
    draft_cache, draft_logits, draft_hidden = _draft_prefill(
        draft_params, draft_config, params, draft_cache, shifted,
        target_features(prefilled, draft_config), prompt_lengths, attn_impl, prefill_chunk)
    if spec.is_parallel:  # the mask slots' proposals too
        draft_logits = draft_logits[:, None]
        if spec.draft_depth > 1:
            slots = _mask_slot_logits(draft_params, draft_config, params, draft_cache,
                                      spec.draft_depth - 1, attn_impl)
            draft_logits = jnp.concatenate([draft_logits, slots], axis=1)
    context = jnp.zeros((batch, capacity if spec.lookup else 0), jnp.int32)
    if spec.lookup:
        context = lookup.write_context(context.at[:, :prompt.shape[1]].set(prompt),
                                       first[:, None], prompt_lengths)
    return SpecState(cache, draft_cache, first, draft_logits, draft_hidden, output, row_keys,
                     jnp.zeros((batch, spec.max_depth + 1), jnp.int32), jnp.int32(0), context)


def round_step(*args, **kwargs) -> Callable[[SpecState], SpecState]:
    """One speculative round as a function SpecState -> SpecState (arguments as for
    `verified_round`)."""
    play = verified_round(*args, **kwargs)
    return lambda s: play(s)[0]


def verified_round(params: Params, config: ModelConfig, draft_params: Params,
                   draft_config: DraftConfig, d2t: jax.Array, sampling: SamplingParams,
                   max_new_tokens: jax.Array, *, spec: SpecConfig, greedy: bool,
                   stop: StopCriteria | StopTable, attn_impl: AttentionImpl = "auto",
                   through: str = "catch_up"
                   ) -> Callable[[SpecState], tuple[SpecState, Round | None]]:
    """One speculative round as a function SpecState -> (SpecState, Round), traced inside a
    loop: draft (`drafting.draft_round`), verify in one target forward (`acceptance.verify`:
    greedy matching, or lossless speculative sampling when not `greedy`), commit, catch up.
    With `through` before "catch_up" (see `PHASES`), a truncated round for timing: it stops
    after that phase, counts a forward and returns no Round; the state keeps what the
    remaining phases would have changed (as far as the phase run changes it)."""
    if through not in PHASES:
        raise ValueError(f"through={through!r}: expected one of {PHASES}")
    depth = spec.max_depth
    head = Head(draft_params, draft_config, params,
                to_target_ids(jnp.arange(draft_config.draft_vocab_size), d2t), attn_impl)
    in_place = spec.is_chain and not spec.lookup  # accepted rows need no commit
    parallel_slots = spec.draft_depth - 1 if spec.is_parallel else None
    spec.check_sampling(greedy)

    def step(s: SpecState) -> tuple[SpecState, Round]:
        running = s.out.running
        rows = jnp.arange(running.shape[0])
        # A row's randomness depends only on its seed and how many tokens it has.
        keys = jax.vmap(lambda key: jax.random.split(key, depth + 1))(
            row_step_keys(s.row_keys, s.out.counts))
        if through == "loop":
            return _counted(s, keys), None
        root = Root(s.last_token, s.draft_logits, s.draft_hidden, s.draft_cache)
        drafted = draft_round(head, root, spec, greedy, sampling, keys, config.vocab_size,
                              s.context, s.target_cache.lengths)
        tree = drafted.tree
        if through == "draft":
            return _counted(s, drafted), None
        positions = s.target_cache.lengths[:, None] + tree.depths
        verified = forward(params, config, tree.tokens, positions, s.target_cache,
                           mask=tree.mask, tap_layers=draft_config.tap_layers,
                           attn_impl=attn_impl)
        logits = lm_head(params, verified.hidden)
        if through == "verify":  # the K/V rows written, the cache's lengths unchanged
            return _counted(s._replace(target_cache=verified.cache), logits,
                            target_features(verified, draft_config)), None
        path, n_accepted, bonus = verify(tree, logits, drafted.probs, spec, greedy, sampling,
                                         keys[:, depth])
        # Emitted this round: the accepted draft tokens, then the bonus; one at a time so
        # EOS, stop sequences and max_new_tokens cut exactly.
        path_tokens = jnp.take_along_axis(tree.tokens, path, axis=1)
        emitted = jnp.where(jnp.arange(depth + 1)[None, :] < n_accepted[:, None],
                            jnp.roll(path_tokens, -1, axis=1), bonus[:, None])
        out = s.out
        for j in range(depth + 1):
            out = record(out, emitted[:, j], j <= n_accepted, stop, max_new_tokens)
        advance = jnp.where(running, n_accepted + 1, 0)
        features = target_features(verified, draft_config)
        target_cache = verified.cache
        if not in_place:
            target_cache = kv_cache.write_rows(target_cache, verified.k_new, verified.v_new,
                                                  path)
            features = jnp.take_along_axis(features, path[:, :, None], axis=1)
        target_cache = target_cache._replace(lengths=s.target_cache.lengths + advance)
        if through == "accept":
            return _counted(s._replace(target_cache=target_cache, out=out,
                                       last_token=jnp.where(running, bonus, s.last_token)),
                            features, emitted), None
        draft_cache, draft_logits, draft_hidden = catch_up(
            draft_params, draft_config, params, s.draft_cache, emitted, features,
            jnp.maximum(advance, 1), attn_impl, parallel_slots)
        # Rows that were already done keep their committed draft length.
        draft_cache = draft_cache._replace(
            lengths=jnp.where(running, draft_cache.lengths, s.draft_cache.lengths))
        context = s.context
        if spec.lookup:
            context = lookup.write_context(context, emitted, s.target_cache.lengths + 1)
        hist = s.accept_hist.at[rows, n_accepted].add(running.astype(jnp.int32))
        state = SpecState(target_cache, draft_cache, jnp.where(running, bonus, s.last_token),
                          draft_logits, draft_hidden, out, s.row_keys, hist, s.forwards + 1,
                          context)
        return state, Round(drafted, logits, running)

    return step


def _counted(state: SpecState, *results) -> SpecState:
    """`state` after a truncated round: one more forward counted, and the next round's
    inputs made to depend on the phase's `results` (a reduction the compiler cannot see
    through), so the work that produced them is kept and never hoisted out of the loop as
    invariant; no value changes (unless a result is NaN)."""
    total = sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(results))
    keep = lambda x: jnp.where(jnp.isnan(total), jnp.zeros_like(x), x)  # noqa: E731
    return state._replace(forwards=state.forwards + 1, last_token=keep(state.last_token),
                          draft_logits=keep(state.draft_logits),
                          draft_hidden=keep(state.draft_hidden))
