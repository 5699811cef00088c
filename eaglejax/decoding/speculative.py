"""Speculative decoding with an EAGLE head, chain drafting, all inside one `lax.while_loop`.

Bookkeeping (per row): the target cache holds tokens x_0..x_{n-1}; the newest token x_n is
recorded but not yet in the cache. Draft position t consumes token x_{t+1} and the target
feature of position t; the draft cache holds positions 0..n-1, and its output at position
n-1 (logits and un-normed hidden state) proposes x_{n+1}. One round:
  1. chain: d_1 from those logits, then K-1 single-token head steps that feed back the
     head's own hidden state, giving d_2..d_K (their cache rows are scratch);
  2. verify: the target runs [x_n, d_1..d_K] in one forward; greedy acceptance keeps the
     longest prefix with d_i == argmax at position i-1, plus the target's bonus token
     (sampling: the draft samples its chain and `acceptance.sample_accept` applies the
     lossless min(1, p/q) rule);
  3. commit: the accepted rows are already in place in the target cache (a chain is a
     path), so the length advances by accepted + 1; the tokens enter the output one by one
     so EOS, stop sequences and max_new_tokens cut exactly;
  4. catch-up: the head runs over the accepted block with the TARGET's features of those
     positions, overwriting its scratch rows, and proposes the next round's d_1.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.config import ModelConfig
from eaglejax.decoding.acceptance import draft_sample, greedy_accept, sample_accept
from eaglejax.decoding.output import Output, empty_output, record, row_step_keys
from eaglejax.decoding.plain import prefill_target
from eaglejax.decoding.sampling import SamplingParams, sample_tokens
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.head import draft_forward, head_logits, to_target_ids
from eaglejax.errors import InputError
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import ForwardOutput, Params, forward, lm_head


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """How to speculate. `num_draft_tokens` (K): draft tokens per round in chain mode."""

    num_draft_tokens: int = 5

    def __post_init__(self):
        if not isinstance(self.num_draft_tokens, int) or not 1 <= self.num_draft_tokens <= 64:
            raise InputError(f"num_draft_tokens must be an integer in [1, 64], "
                             f"got {self.num_draft_tokens!r}")


class SpecState(NamedTuple):
    """Everything the speculative loop carries (see the module docstring)."""

    target_cache: kv_cache.KVCache
    draft_cache: kv_cache.KVCache
    last_token: jax.Array  # [B] x_n
    draft_logits: jax.Array  # [B,DV] the head's proposal for x_{n+1}
    draft_hidden: jax.Array  # [B,H] the head's un-normed hidden state at position n-1
    out: Output
    row_keys: jax.Array  # [B] PRNG keys, one per row (sampling)
    accept_hist: jax.Array  # [B,K+1] rounds per row that accepted exactly a draft tokens
    forwards: jax.Array  # int32 scalar: target forwards in the loop


def _features(out: ForwardOutput, draft_config: DraftConfig) -> jax.Array:
    """The target features the head consumes: taps (EAGLE-3) or final normed hidden (EAGLE-1)."""
    return out.taps if draft_config.tap_layers else out.hidden


def _catch_up(draft_params: Params, draft_config: DraftConfig, target_params: Params,
              cache: kv_cache.KVCache, tokens: jax.Array, features: jax.Array,
              n_accepted: jax.Array, attn_impl: AttentionImpl, fresh: bool = False):
    """Run the head over a block of new positions starting at each row's cache length, keep
    the first n_accepted [B] rows, and return (cache, logits, hidden) at the last kept one.
    `fresh`: the cache is empty (prefill), so attention runs among the new rows only."""
    batch, block = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(block)[None, :]
    out = draft_forward(draft_params, draft_config, target_params, tokens, features, positions,
                        None if fresh else cache, attn_impl=attn_impl)
    hidden = out.hidden[jnp.arange(batch), n_accepted - 1]
    if fresh:
        cache = kv_cache.append(cache, out.k_new, out.v_new, n_accepted)
    else:
        cache = out.cache._replace(lengths=cache.lengths + n_accepted)
    return cache, head_logits(draft_params, draft_config, target_params, hidden), hidden


@functools.partial(jax.jit, static_argnames=("config", "draft_config", "capacity", "max_tokens",
                                             "num_draft", "greedy", "stop", "attn_impl"))
def spec_prefill(params: Params, config: ModelConfig, draft_params: Params,
                 draft_config: DraftConfig, prompt: jax.Array, prompt_lengths: jax.Array,
                 row_keys: jax.Array, sampling: SamplingParams, max_new_tokens: jax.Array, *,
                 capacity: int, max_tokens: int, num_draft: int, greedy: bool,
                 stop: StopCriteria, attn_impl: AttentionImpl = "auto") -> SpecState:
    """Prefill the target and the head on right-padded prompts; record the first token."""
    batch, prompt_len = prompt.shape
    cache, logits, out = prefill_target(params, config, prompt, prompt_lengths, capacity,
                                        draft_config.tap_layers, attn_impl)
    output = empty_output(batch, max_tokens)
    first = sample_tokens(logits, sampling, row_step_keys(row_keys, output.counts), greedy)
    output = record(output, first, output.running, stop, max_new_tokens)
    # Draft position t consumes token t+1: the prompt shifted left, then the first new token.
    rows = jnp.arange(batch)
    shifted = jnp.concatenate([prompt[:, 1:], prompt[:, :1]], axis=1)
    shifted = shifted.at[rows, prompt_lengths - 1].set(first)
    d = draft_config.decoder
    draft_cache = kv_cache.init_cache(d.num_layers, batch, capacity, d.num_kv_heads,
                                      d.head_dim, params["embed"].dtype)
    draft_cache, draft_logits, draft_hidden = _catch_up(
        draft_params, draft_config, params, draft_cache, shifted, _features(out, draft_config),
        prompt_lengths, attn_impl, fresh=True)
    return SpecState(cache, draft_cache, first, draft_logits, draft_hidden, output, row_keys,
                     jnp.zeros((batch, num_draft + 1), jnp.int32), jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("config", "draft_config", "num_draft", "greedy",
                                             "stop", "attn_impl"), donate_argnames=("state",))
def spec_loop(params: Params, config: ModelConfig, draft_params: Params,
              draft_config: DraftConfig, d2t: jax.Array, state: SpecState,
              sampling: SamplingParams, max_new_tokens: jax.Array, *, num_draft: int,
              greedy: bool, stop: StopCriteria, attn_impl: AttentionImpl = "auto") -> SpecState:
    """Chain speculation (K = num_draft draft tokens per round) until every row finishes:
    greedy matching, or lossless speculative sampling when not `greedy`."""
    k = num_draft
    vocab = config.vocab_size
    draft_ids = to_target_ids(jnp.arange(draft_config.draft_vocab_size), d2t)

    def propose(logits: jax.Array, key: jax.Array):
        if greedy:
            return draft_ids[jnp.argmax(logits, axis=-1)].astype(jnp.int32), None
        return draft_sample(logits, sampling, key, draft_ids, vocab)

    def draft_chain(s: SpecState, keys: jax.Array):
        """[B,K] draft tokens (target ids) and, when sampling, their distributions [B,K,V].
        The chain's cache rows are scratch."""
        token, probs = propose(s.draft_logits, keys[:, 0])
        drafted, dists, hidden, cache = [token], [probs], s.draft_hidden, s.draft_cache
        for i in range(1, k):
            out = draft_forward(draft_params, draft_config, params, token[:, None],
                                hidden[:, None], cache.lengths[:, None], cache,
                                from_features=False, attn_impl=attn_impl)
            cache = out.cache._replace(lengths=cache.lengths + 1)
            hidden = out.hidden[:, 0]
            token, probs = propose(head_logits(draft_params, draft_config, params, hidden),
                                   keys[:, i])
            drafted.append(token)
            dists.append(probs)
        return jnp.stack(drafted, axis=1), None if greedy else jnp.stack(dists, axis=1)

    def step(s: SpecState) -> SpecState:
        running = s.out.running
        rows = jnp.arange(running.shape[0])
        # A row's randomness depends only on its seed and how many tokens it has.
        keys = jax.vmap(lambda key: jax.random.split(key, k + 1))(
            row_step_keys(s.row_keys, s.out.counts))
        drafted, draft_probs = draft_chain(s, keys)
        block = jnp.concatenate([s.last_token[:, None], drafted], axis=1)  # [B,K+1]
        positions = s.target_cache.lengths[:, None] + jnp.arange(k + 1)[None, :]
        verified = forward(params, config, block, positions, s.target_cache,
                           tap_layers=draft_config.tap_layers, attn_impl=attn_impl)
        logits = lm_head(params, verified.hidden)
        if greedy:
            n_accepted, bonus = greedy_accept(drafted, logits)
        else:
            n_accepted, bonus = sample_accept(drafted, draft_probs, logits, sampling, keys[:, k])
        # Emitted this round: d_1..d_a then the bonus; one token at a time for exact stops.
        emitted = jnp.where(jnp.arange(k + 1)[None, :] < n_accepted[:, None],
                            jnp.concatenate([drafted, drafted[:, :1]], axis=1), bonus[:, None])
        out = s.out
        for j in range(k + 1):
            out = record(out, emitted[:, j], j <= n_accepted, stop, max_new_tokens)
        advance = jnp.where(running, n_accepted + 1, 0)
        target_cache = verified.cache._replace(lengths=s.target_cache.lengths + advance)
        draft_cache, draft_logits, draft_hidden = _catch_up(
            draft_params, draft_config, params, s.draft_cache, emitted,
            _features(verified, draft_config), jnp.maximum(advance, 1), attn_impl)
        # Rows that were already done keep their committed draft length.
        draft_cache = draft_cache._replace(
            lengths=jnp.where(running, draft_cache.lengths, s.draft_cache.lengths))
        hist = s.accept_hist.at[rows, n_accepted].add(running.astype(jnp.int32))
        return SpecState(target_cache, draft_cache, jnp.where(running, bonus, s.last_token),
                         draft_logits, draft_hidden, out, s.row_keys, hist, s.forwards + 1)

    return jax.lax.while_loop(lambda s: jnp.any(s.out.running), step, state)
