"""EAGLE-3 "training-time test" (TTT): the head unrolled over its own outputs, and its loss;
P-EAGLE's objective: the head's mask slots unrolled the same way, on sampled depths.

Coordinates: a row holds target tokens x_0..x_{S-1}. Draft position t (the "root")
consumes token x_{t+1} and the target feature of position t. Step 0 is the head run on
real features (what decoding's catch-up does). Step k >= 1 at root t consumes token
x_{t+1+k} and the head's own step k-1 un-normed output at root t, at RoPE position
pos_t + k, and attends to the step-0 keys up to t plus its own keys of steps 1..k (exactly
what the k-th chain step of decoding sees); it predicts x_{t+2+k}, supervised by the
target's next-token distribution at position t+1+k restricted to the draft vocabulary.
Rows may hold several packed sequences (segments): nothing attends or predicts across them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.config import ModelConfig
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.head import draft_forward, embed_tokens, fc_input, head_logits
from eaglejax.draft.head import mask_slots as mask_slots_of
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import (
    Params,
    attention_output_and_mlp,
    forward,
    lm_head,
    qkv_projection,
    rms_norm,
    rope_for,
)


class Batch(NamedTuple):
    """[B,S] arrays of packed rows: tokens int32, segments int32 (0 = padding), positions
    int32 (per segment), loss_mask bool (1 on tokens to predict)."""

    tokens: jax.Array
    segments: jax.Array
    positions: jax.Array
    loss_mask: jax.Array


class TargetSignal(NamedTuple):
    """What the frozen target gives the head, per position of a row: features [B,S,F]
    (its taps), probs [B,S,DV] (its next-token distribution restricted and renormalised to
    the draft vocabulary), draft_argmax [B,S] (draft index of its argmax, -1 outside)."""

    features: jax.Array
    probs: jax.Array
    draft_argmax: jax.Array


def segment_mask(segments: jax.Array) -> jax.Array:
    """[B,S,S]: causal within each segment."""
    length = segments.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    return causal[None] & (segments[:, :, None] == segments[:, None, :])


def shift_left(x: jax.Array, n: int, fill: float | bool = 0) -> jax.Array:
    """x[:, n:] along axis 1, padded at the end with `fill` to the same length."""
    pad = jnp.full((x.shape[0], n, *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def target_signal(target_params: Params, target_config: ModelConfig, batch: Batch,
                  tap_layers: tuple[int, ...], used: jax.Array, t2d: jax.Array,
                  attn_impl: AttentionImpl = "auto") -> TargetSignal:
    """Run the frozen target over the batch: its taps and next-token distributions.

    used: sorted target ids of the draft vocabulary [DV]; t2d: draft index per target id
    [V] (-1 outside)."""
    out = forward(target_params, target_config, batch.tokens, batch.positions,
                  mask=segment_mask(batch.segments), tap_layers=tap_layers, attn_impl=attn_impl)
    logits = lm_head(target_params, out.hidden)
    probs = jax.nn.softmax(logits[..., used], axis=-1)
    return TargetSignal(jax.lax.stop_gradient(out.taps), jax.lax.stop_gradient(probs),
                        t2d[jnp.argmax(logits, axis=-1)])


def ttt_attention(q: jax.Array, k0: jax.Array, v0: jax.Array, mask: jax.Array,
                  k_diag: jax.Array, v_diag: jax.Array,
                  diag_mask: jax.Array | None = None) -> jax.Array:
    """Query t [B,T,Hq,D] attends to k0/v0 [B,S,Hkv,D] where mask [B,T,S] allows and to its
    own n keys k_diag/v_diag [B,T,n,Hkv,D] (those diag_mask [B,T,n] allows, if given); one
    float32 softmax over both; [B,T,Hq,D]."""
    batch, length, n_heads, head_dim = q.shape
    n_kv = k0.shape[2]
    f32 = jnp.float32
    q = q.astype(f32).reshape(batch, length, n_kv, n_heads // n_kv, head_dim) * head_dim**-0.5
    scores0 = jnp.einsum("btkgd,bskd->bkgts", q, k0.astype(f32))
    scores0 = jnp.where(mask[:, None, None], scores0, -jnp.inf)
    scores_diag = jnp.einsum("btkgd,btnkd->bkgtn", q, k_diag.astype(f32))
    if diag_mask is not None:
        scores_diag = jnp.where(diag_mask[:, None, None], scores_diag, -jnp.inf)
    weights = jax.nn.softmax(jnp.concatenate([scores0, scores_diag], axis=-1), axis=-1)
    shared = k0.shape[1]
    out = (jnp.einsum("bkgts,bskd->btkgd", weights[..., :shared], v0.astype(f32))
           + jnp.einsum("bkgtn,btnkd->btkgd", weights[..., shared:], v_diag.astype(f32)))
    return out.reshape(batch, length, n_heads, head_dim).astype(v0.dtype)


def _unrolled_layer(config: ModelConfig, rope: tuple[jax.Array, jax.Array], h: jax.Array,
                    layer: Params, attn_input: jax.Array | None, keys: list[jax.Array],
                    values: list[jax.Array], mask: jax.Array):
    """One decoder layer at step k >= 1 (as `models.llama.decoder_layer`, with TTT
    attention). keys/values: this layer's step-0..k-1 K/V; returns (h, k, v) of step k."""
    q, k, v = qkv_projection(config, rope, h, layer, attn_input)
    attn = ttt_attention(q, keys[0], values[0], mask, jnp.stack([*keys[1:], k], axis=2),
                         jnp.stack([*values[1:], v], axis=2))
    return attention_output_and_mlp(config, h, layer, attn), k, v


def ttt_unroll(params: Params, config: DraftConfig, target_params: Params, tokens: jax.Array,
               features: jax.Array, positions: jax.Array, mask: jax.Array,
               ttt_length: int, mask_slots: bool = False) -> list[jax.Array]:
    """The head's un-normed outputs [B,T,H] at steps 0..ttt_length-1, per root position.

    Draft-aligned inputs: root t consumes tokens[t] and features[t] at positions[t]; mask
    [B,T,T] is the step-0 attention mask. Step k reads tokens[t+k] (0 past the end) and the
    head's step k-1 output; with `mask_slots` (P-EAGLE) it reads the mask token and the
    learned `mask_hidden` instead (through `fc`, as decoding's mask slots do), attending
    like step k of the chain: to the step-0 keys up to its root and its own slots."""
    if config.kind != "eagle3":
        raise ValueError(f"training-time test needs an EAGLE-3 head, got {config.kind!r}")
    if mask_slots and not config.parallel:
        raise ValueError("mask slots need a P-EAGLE head (DraftConfig.mask_token_id)")
    d, eps = config.decoder, config.decoder.rms_norm_eps
    out = draft_forward(params, config, target_params, tokens, features, positions, mask=mask,
                        attn_impl="xla")
    hiddens = [out.hidden]
    keys = [[k] for k in out.k_new]
    values = [[v] for v in out.v_new]
    first = params["layers"][0]
    if mask_slots:
        slot_tokens, slot_features = mask_slots_of(params, config, *tokens.shape)
        slot_embeds = embed_tokens(params, config, target_params, slot_tokens, out.hidden.dtype)
        slot_hidden = fc_input(params, config, slot_features.astype(out.hidden.dtype))
    for step in range(1, ttt_length):
        if mask_slots:
            embeds, hidden = slot_embeds, slot_hidden
        else:
            embeds = embed_tokens(params, config, target_params, shift_left(tokens, step),
                                  out.hidden.dtype)
            hidden = hiddens[-1]
        attn_input = jnp.concatenate([rms_norm(embeds, first["embed_norm"], eps),
                                      rms_norm(hidden, first["hidden_norm"], eps)], axis=-1)
        x = rms_norm(hidden, first["hidden_norm"], eps) if config.norm_before_residual else hidden
        rope = rope_for(d, positions + step)
        for i, layer in enumerate(params["layers"]):
            x, k, v = _unrolled_layer(d, rope, x, layer, attn_input if i == 0 else None,
                                      keys[i], values[i], mask)
            keys[i].append(k)
            values[i].append(v)
        hiddens.append(x)
    return hiddens


@functools.partial(jax.checkpoint, static_argnums=(1,))
def _step_loss(params: Params, config: DraftConfig, hidden: jax.Array, probs: jax.Array,
               target_ids: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Soft cross entropy and top-1 accuracy of one step over the valid roots
    (rematerialised: the [B,T,DV] logits are recomputed in the backward pass, not stored)."""
    logits = head_logits(params, config, {}, hidden)
    cross_entropy = -jnp.sum(probs * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    count = jnp.maximum(jnp.sum(valid), 1)
    loss = jnp.sum(jnp.where(valid, cross_entropy, 0.0)) / count
    hits = valid & (jnp.argmax(logits, axis=-1) == target_ids)
    return loss, jnp.sum(hits) / count


def ttt_loss(params: Params, config: DraftConfig, target_params: Params, batch: Batch,
             signal: TargetSignal, ttt_length: int = 7,
             step_weight: float = 0.8) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """sum_k step_weight^k * loss_k, and (loss_k, top-1 accuracy_k) [ttt_length] each.

    Root t at step k counts where token t+2+k is supervised and in t's segment and the
    target's argmax at t+1+k lies in the draft vocabulary."""
    segments = batch.segments
    hiddens = ttt_unroll(params, config, target_params, shift_left(batch.tokens, 1),
                         signal.features, batch.positions, segment_mask(segments), ttt_length)
    losses, accuracies = [], []
    for step, hidden in enumerate(hiddens):
        target_ids = shift_left(signal.draft_argmax, 1 + step, -1)
        valid = (shift_left(batch.loss_mask, 2 + step, False) & (segments > 0)
                 & (shift_left(segments, 2 + step) == segments) & (target_ids >= 0))
        loss, accuracy = _step_loss(params, config, hidden, shift_left(signal.probs, 1 + step),
                                    target_ids, valid)
        losses.append(loss)
        accuracies.append(accuracy)
    losses_array = jnp.stack(losses)
    total = jnp.sum(losses_array * step_weight ** jnp.arange(ttt_length))
    return total, (losses_array, jnp.stack(accuracies))


def cod_keep(key: jax.Array, shape: tuple[int, int], num_depths: int, rate: float = 0.7,
             floor: float = 0.2) -> jax.Array:
    """P-EAGLE's conditional-on-depth sampling as a mask [num_depths,B,T] of (root, depth)
    pairs: depth 0 keeps every root, depth d a random share max(rate^d, floor) of them,
    nested (a root kept at depth d is kept at every shallower depth)."""
    draw = jax.random.uniform(key, shape)
    shares = jnp.maximum(rate ** jnp.arange(num_depths), floor).at[0].set(1.0)
    return draw[None] < shares[:, None, None]


def peagle_loss(params: Params, config: DraftConfig, target_params: Params, batch: Batch,
                signal: TargetSignal, num_depths: int, key: jax.Array, rate: float = 0.7,
                floor: float = 0.2) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """P-EAGLE's objective: the mean soft cross entropy over the sampled (root, depth) pairs
    (`cod_keep`; depth d: the mask slot proposing token t+2+d), and (loss_d, top-1
    accuracy_d) [num_depths] each. Validity as in `ttt_loss`."""
    segments = batch.segments
    hiddens = ttt_unroll(params, config, target_params, shift_left(batch.tokens, 1),
                         signal.features, batch.positions, segment_mask(segments), num_depths,
                         mask_slots=True)
    kept = cod_keep(key, segments.shape, num_depths, rate, floor)
    losses, accuracies, total, count = [], [], 0.0, 0
    for depth, hidden in enumerate(hiddens):
        target_ids = shift_left(signal.draft_argmax, 1 + depth, -1)
        valid = (shift_left(batch.loss_mask, 2 + depth, False) & (segments > 0)
                 & (shift_left(segments, 2 + depth) == segments) & (target_ids >= 0)
                 & kept[depth])
        loss, accuracy = _step_loss(params, config, hidden,
                                    shift_left(signal.probs, 1 + depth), target_ids, valid)
        pairs = jnp.sum(valid)
        total, count = total + loss * jnp.maximum(pairs, 1), count + pairs
        losses.append(loss)
        accuracies.append(accuracy)
    return total / jnp.maximum(count, 1), (jnp.stack(losses), jnp.stack(accuracies))
