"""What an EAGLE head keeps between rounds (`HeadState`) and how it gets there: prefilled
over the prompt, caught up over each round's accepted tokens. Every drafting method of this
package drafts from it (`base.HeadDrafter`).

Draft position t consumes token x_{t+1} and the target feature of position t; the cache
holds positions 0..n-1, and the head's output at position n-1 (logits and un-normed hidden
state) proposes x_{n+1}. A P-EAGLE shape (`spec.is_parallel`) also proposes the K-1 tokens
after it, from mask slots that ride in the same forward and are never committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.draft.config import DraftConfig
from eaglejax.draft.head import (
    compute_dtype as head_dtype,
    draft_forward,
    draft_forward_chunked,
    head_logits,
    mask_slots,
)
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import Params, compute_dtype

if TYPE_CHECKING:
    from eaglejax.decoding.drafters.base import Head
    from eaglejax.decoding.spec_config import SpecConfig


class HeadState(NamedTuple):
    """Per row: the head's committed cache, and its proposal for the token after the last
    accepted one: logits [B,DV] (P-EAGLE: [B,K,DV], one per draft position) and the
    un-normed hidden state [B,H] that produced them."""

    cache: kv_cache.KVCache
    logits: jax.Array
    hidden: jax.Array


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


def _mask_slot_logits(head: "Head", cache: kv_cache.KVCache, count: int) -> jax.Array:
    """P-EAGLE's `count` mask slots after each row's committed cache (positions continuing
    from its last row): their proposals [B,count,DV]; nothing is committed."""
    batch = cache.lengths.shape[0]
    tokens, features = mask_slots(head.params, head.config, batch, count)
    positions = cache.lengths[:, None] + jnp.arange(count)[None, :]
    out = draft_forward(head.params, head.config, head.target_params, tokens,
                        features.astype(head_dtype(head.params)), positions, cache,
                        attn_impl=head.attn_impl, stage=False)
    return head.logits(out.hidden)


def prefill(head: "Head", spec: "SpecConfig", tokens: jax.Array, features: jax.Array,
            prompt_lengths: jax.Array, capacity: int, chunk: int,
            cached: kv_cache.KVCache | None = None) -> HeadState:
    """The head over the whole shifted prompt `tokens` [B,P] (the prompt from its second
    token, then the first new token) with the target's prefill `features`, into a fresh
    cache of `capacity` rows (or after the rows of `cached`, a cache of that capacity),
    `chunk` positions at a time when longer: its state at each row's last position."""
    batch, prompt_len = tokens.shape
    if cached is not None:
        hidden, cache = draft_forward_chunked(head.params, head.config, head.target_params,
                                              tokens, features, cached,
                                              chunk=min(chunk, prompt_len),
                                              attn_impl=head.attn_impl)
        cache = cache._replace(lengths=cached.lengths + prompt_lengths)
    elif prompt_len <= chunk:  # attention among the new rows only
        positions = jnp.broadcast_to(jnp.arange(prompt_len)[None], (batch, prompt_len))
        out = draft_forward(head.params, head.config, head.target_params, tokens, features,
                            positions, attn_impl=head.attn_impl)
        cache = kv_cache.append(_empty_cache(head, batch, capacity), out.k_new, out.v_new,
                                prompt_lengths)
        hidden = out.hidden
    else:
        hidden, cache = draft_forward_chunked(head.params, head.config, head.target_params,
                                              tokens, features,
                                              _empty_cache(head, batch, capacity), chunk=chunk,
                                              attn_impl=head.attn_impl)
        cache = cache._replace(lengths=prompt_lengths)
    hidden = hidden[jnp.arange(batch), prompt_lengths - 1]
    logits = head.logits(hidden)
    if spec.is_parallel:  # the mask slots' proposals too
        logits = logits[:, None]
        if spec.draft_depth > 1:
            slots = _mask_slot_logits(head, cache, spec.draft_depth - 1)
            logits = jnp.concatenate([logits, slots], axis=1)
    return HeadState(cache, logits, hidden)


def _empty_cache(head: "Head", batch: int, capacity: int) -> kv_cache.KVCache:
    """A fresh head cache (every device holds all its heads)."""
    d = head.config.decoder
    return kv_cache.init_cache(d.num_layers, batch, capacity, d.num_kv_heads, d.head_dim,
                               compute_dtype(head.target_params), heads_axis=None)


def advance(head: "Head", spec: "SpecConfig", state: HeadState, tokens: jax.Array,
            features: jax.Array, n_accepted: jax.Array, running: jax.Array) -> HeadState:
    """`catch_up` over a round's accepted block: tokens [B,T] x_{n+1}.. beside the target's
    features [B,T,F] of x_n.. (the accepted path's), n_accepted [B] of them kept; rows not
    `running` keep their state."""
    cache, logits, hidden = catch_up(
        head.params, head.config, head.target_params, state.cache, tokens, features,
        jnp.maximum(n_accepted, 1), head.attn_impl,
        spec.draft_depth - 1 if spec.is_parallel else None)
    keep = lambda new, old: jnp.where(  # noqa: E731
        running.reshape(-1, *(1,) * (new.ndim - 1)), new, old)
    return HeadState(cache._replace(lengths=keep(cache.lengths, state.cache.lengths)),
                     keep(logits, state.logits), keep(hidden, state.hidden))
