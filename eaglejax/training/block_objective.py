"""DFlash's training objective: anchored blocks over the frozen target's features.

Coordinates: a row holds target tokens x_0..x_{S-1} (packed segments, as `ttt.Batch`).
An anchor a is a supervised position whose successor is supervised in the same segment
(`sample_anchors`: up to N per row, drawn without replacement). Its block is what a round
of decoding drafts after committing x_a: the tokens [x_a, mask x (block_size - 1)] at
positions pos_a .. pos_a + block_size - 1, every block token seeing the context keys and
values of its segment's positions strictly before a (x_a's own target features do not
exist yet at decoding time) and the whole block, or, in a typed layer, what its kind lets it
see of them (`dflash.visible` over the tokens' positions, as decoding runs it: per query,
not speculators' anchor-relative window). Slot k >= 1 proposes x_{a+k}; it is supervised
by the target's distribution at a+k-1 (KL divergence, as speculators trains DFlash),
weighted exp(-(k-1)/gamma), where a+k is supervised and in a's segment. A
drafter with a reduced vocabulary is supervised by that distribution restricted to its
tokens and renormalised (as speculators and EAGLE-3 training do). All of a row's blocks
run in one forward (queries N x block_size, keys S + own block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from eaglejax.draft.config import DraftConfig
from eaglejax.draft.dflash import context_kv, visible
from eaglejax.draft.head import head_logits
from eaglejax.models.llama import (
    Params, attention_output_and_mlp, compute_dtype, embedding_rows, qkv_projection,
    rms_norm, rope_for)
from eaglejax.training.ttt import Batch, TargetSignal, shift_left, ttt_attention


def sample_anchors(key: jax.Array, batch: Batch, num_anchors: int
                   ) -> tuple[jax.Array, jax.Array]:
    """(anchors [B,N] int32, valid [B,N] bool): N distinct positions per row drawn
    uniformly among the valid anchors (x_a and x_{a+1} supervised, one segment); a row
    with fewer valid positions takes them all, the rest of its N marked invalid."""
    segments = batch.segments
    allowed = (batch.loss_mask & shift_left(batch.loss_mask, 1, False) & (segments > 0)
               & (shift_left(segments, 1) == segments))
    scores = jnp.where(allowed, jax.random.uniform(key, segments.shape), -1.0)
    top, anchors = jax.lax.top_k(scores, num_anchors)
    return anchors.astype(jnp.int32), top >= 0


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B,S,...] at index [B,...] along axis 1."""
    flat = index.reshape(index.shape[0], -1)
    taken = jax.vmap(lambda row, i: row[i])(x, flat)
    return taken.reshape(*index.shape, *x.shape[2:])


def anchored_blocks(params: Params, config: DraftConfig, target_params: Params,
                    batch: Batch, features: jax.Array, anchors: jax.Array) -> jax.Array:
    """The drafter's final-normed hidden states [B,N,block_size,H] of every anchor's
    block (see the module docstring); features [B,S,F] are the target's taps."""
    d, size = config.decoder, config.block_size
    n_rows, length = batch.segments.shape
    n_anchors = anchors.shape[1]
    keys, values = context_kv(params, config, features, batch.positions)
    slots = jnp.arange(size)
    tokens = jnp.where(slots == 0, _take(batch.tokens, anchors)[..., None],
                       config.mask_token_id).reshape(n_rows, -1)
    positions = (_take(batch.positions, anchors)[..., None] + slots).reshape(n_rows, -1)
    anchor_of_query = jnp.repeat(anchors, size, axis=1)  # [B,Q]
    segment_of_query = _take(batch.segments, anchor_of_query)
    context_mask = ((jnp.arange(length) < anchor_of_query[..., None])
                    & (batch.segments[:, None, :] == segment_of_query[..., None])
                    & (segment_of_query[..., None] > 0))  # [B,Q,S]
    rope = rope_for(d, positions)
    h = embedding_rows(target_params["embed"], tokens, compute_dtype(params))

    def own_block(x: jax.Array) -> jax.Array:  # [B,Q,kv,D] -> each query's block [B,Q,size,kv,D]
        blocks = x.reshape(n_rows, n_anchors, 1, size, *x.shape[2:])
        blocks = jnp.broadcast_to(blocks, (n_rows, n_anchors, size, size, *x.shape[2:]))
        return blocks.reshape(n_rows, n_anchors * size, size, *x.shape[2:])

    for i, (layer, k_ctx, v_ctx) in enumerate(zip(params["layers"], keys, values)):
        kind = config.layer(i)
        seen, in_block = context_mask, None
        if not kind.plain:  # positions: the context's own, and each query's block slots'
            seen = context_mask & visible(kind, positions, batch.positions)
            in_block = jnp.tile(visible(kind, slots, slots), (n_anchors, 1))[None]  # [1,Q,size]
        q, k, v = qkv_projection(d, rope, h, layer)
        attn = ttt_attention(q, k_ctx, v_ctx, seen, own_block(k), own_block(v), in_block)
        h = attention_output_and_mlp(d, h, layer, attn)
    hidden = rms_norm(h, params["final_norm"], d.rms_norm_eps)
    return hidden.reshape(n_rows, n_anchors, size, -1)


@functools.partial(jax.checkpoint, static_argnums=(1,))
def _slot_terms(params: Params, config: DraftConfig, target_params: Params, hidden: jax.Array,
                probs: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed KL(target || drafter) and top-1 hits of one slot over the valid blocks
    (rematerialised: the [B,N,V] logits are recomputed in the backward pass)."""
    logits = head_logits(params, config, target_params, hidden)
    kl = jnp.sum(jax.scipy.special.xlogy(probs, probs)
                 - probs * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    hits = valid & (jnp.argmax(logits, axis=-1) == jnp.argmax(probs, axis=-1))
    return jnp.sum(jnp.where(valid, kl, 0.0)), jnp.sum(hits)


def dflash_loss(params: Params, config: DraftConfig, target_params: Params, batch: Batch,
                signal: TargetSignal, key: jax.Array, num_anchors: int = 64,
                gamma: float = 7.0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """sum over valid (block, slot k) of exp(-(k-1)/gamma) KL_k, divided by the number of
    valid pairs (speculators' normalisation); and (KL_k, top-1 accuracy_k), each
    [block_size - 1], means over slot k's valid blocks. `signal.probs` covers the drafter's
    vocabulary: the whole one, or a reduced one's tokens (restricted and renormalised,
    `ttt.target_signal`)."""
    anchors, anchor_valid = sample_anchors(key, batch, num_anchors)
    hidden = anchored_blocks(params, config, target_params, batch, signal.features, anchors)
    length = batch.segments.shape[1]
    anchor_segment = _take(batch.segments, anchors)
    total, count, losses, accuracies = 0.0, 0, [], []
    for slot in range(1, config.block_size):
        label = anchors + slot
        inside = label < length
        label = jnp.minimum(label, length - 1)
        valid = (anchor_valid & inside & _take(batch.loss_mask, label)
                 & (_take(batch.segments, label) == anchor_segment))
        kl, hits = _slot_terms(params, config, target_params, hidden[:, :, slot],
                               _take(signal.probs, label - 1), valid)
        pairs = jnp.sum(valid)
        total += jnp.exp(-(slot - 1) / gamma) * kl
        count += pairs
        losses.append(kl / jnp.maximum(pairs, 1))
        accuracies.append(hits / jnp.maximum(pairs, 1))
    return total / jnp.maximum(count, 1), (jnp.stack(losses), jnp.stack(accuracies))
