"""DFlash drafters (block diffusion drafting, arXiv 2602.06036) as pure functions over a
parameter dict.

A DFlash drafter is a stack of decoder layers of the target's kind (Qwen3-style: per-head
q/k norms) with no embedding of its own: it embeds with the target's table and reads out
(`readout`) with the target's head, or, with a reduced draft vocabulary
(`DraftConfig.reduced_vocab`, as speculators trains them), with its own `lm_head` [DV, H]
over DV target tokens (`d2t`): its proposals are then draft-vocabulary logits, which the
decoding loop maps to target ids as it does an EAGLE-3 head's. The target's taps at each
committed position are projected once into a context vector, `ctx = hidden_norm(fc(taps))`,
from which every layer takes that position's key and value directly (`k_norm(k_proj(ctx))`
rotated at the position, `v_proj(ctx)`; no input norm, and the layers never update ctx): the
drafter's cache holds those context keys and values (`context_kv`). A round fills one block:
the last accepted token, then `block_size - 1` mask tokens, at the positions after the
context, and slots 1.. propose the next `block_size - 1` tokens at once (`block_logits`).

What a block query sees is each layer's (`DraftConfig.layer_attention`, read from the
layouts' `layer_types`: `formats.dflash`). A plain ("full_attention") layer: the whole
context and the whole block. A causal layer: no block key after the query. A layer with a
sliding window w: no key, context or block, w or more positions before the query, and, when
not causal, none w or more after it (`visible`). That is z-lab's rule (their reference
`dflash/model.py`), and what vLLM and SGLang run (a per-query window of w - 1 keys back,
and forward too when not causal, e.g. flash-attention's `window_size`). speculators' trainer
(`create_anchor_block_mask_mod`) windows the context relative to the block's anchor instead
(keys from anchor - w on, for every slot: slot i sees up to i + 1 more context keys than
here) and never windows the block itself (which differs only when w < block_size).
The cache's slot p holds position p (a drafter's context starts at position 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eaglejax import native
from eaglejax.draft.config import DraftConfig, LayerAttention
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.kv_cache import KVCache
from eaglejax.models.llama import (
    ParamInfo, Params, compute_dtype, decoder_layer_call, embedding_rows, linear, lm_head,
    param_info as decoder_info, rms_norm, rope_for)
from eaglejax.models.rope import apply_rope


def default_taps(num_target_layers: int, count: int) -> tuple[int, ...]:
    """DFlash's default taps: the outputs of `count` target layers spread from layer 1 to
    layer L-3 (its authors' rule), as entering-layer ids (the output of layer i enters
    layer i + 1)."""
    if count == 1:
        return (num_target_layers // 2 + 1,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (count - 1))) + 1 for i in range(count))


def param_info(config: DraftConfig) -> Params:
    """Every DFlash parameter's `ParamInfo`: `fc` [H, taps x H_target], `hidden_norm`, the
    decoder layers, `final_norm` and, with a reduced vocabulary, `lm_head` [DV, H] (the
    embedding, and otherwise the output head, are the target's)."""
    decoder = decoder_info(config.decoder)
    norm = decoder["final_norm"]
    infos = {"fc": ParamInfo((config.hidden_size, config.feature_size), ("embed", "features")),
             "hidden_norm": norm, "layers": decoder["layers"], "final_norm": norm}
    if config.reduced_vocab:
        infos["lm_head"] = ParamInfo((config.draft_vocab_size, config.hidden_size),
                                     ("draft_vocab", "embed"))
    return infos


def readout(params: Params, config: DraftConfig, target_params: Params,
            hidden: jax.Array) -> jax.Array:
    """Float32 draft-vocabulary logits [..., DV] of final-normed drafter outputs [..., H]:
    through the drafter's own `lm_head` when its vocabulary is reduced, else the target's
    head (DV = V)."""
    if config.reduced_vocab:
        return linear(hidden, params["lm_head"]).astype(jnp.float32)
    return lm_head(target_params, hidden)


def context_kv(params: Params, config: DraftConfig, features: jax.Array,
               positions: jax.Array) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Every layer's keys and values [B,T,kv,D] of context positions [B,T] with target taps
    features [B,T,F]: one projection of each layer's key and value weights over ctx (the
    query rows of `wqkv` are never multiplied)."""
    d = config.decoder
    ctx = rms_norm(linear(features.astype(compute_dtype(params)), params["fc"]),
                   params["hidden_norm"], d.rms_norm_eps)
    cos, sin = rope_for(d, positions)  # [B,T,1,D]
    batch, t_new, _ = ctx.shape
    keys, values = [], []
    for layer in params["layers"]:
        kv_rows = layer["wqkv"][:, -2:]  # [kv, 2, D, H]: each KV head's key, then its value
        kv = linear(ctx, kv_rows.reshape(-1, kv_rows.shape[-1]))
        kv = kv.reshape(batch, t_new, d.num_kv_heads, 2, d.head_dim)
        if d.attention_bias:
            kv = kv + layer["bqkv"][:, -2:]
        k, v = kv[..., 0, :], kv[..., 1, :]
        if d.qk_norm:
            k = rms_norm(k, layer["k_norm"], d.rms_norm_eps)
        keys.append(apply_rope(k, cos, sin))
        values.append(v)
    return tuple(keys), tuple(values)


def visible(kind: LayerAttention, query_positions: jax.Array,
            key_positions: jax.Array) -> jax.Array:
    """Which keys queries see in a layer of `kind` (module docstring): [..., Q, K] bool from
    query positions [..., Q] and key positions [..., K]."""
    ahead = key_positions[..., None, :] - query_positions[..., :, None]  # > 0: key after
    seen = jnp.ones(ahead.shape, bool)
    if kind.causal:
        seen &= ahead <= 0
    if kind.window is not None:
        seen &= -ahead < kind.window
        if not kind.causal:
            seen &= ahead < kind.window
    return seen


def block_logits(params: Params, config: DraftConfig, target_params: Params,
                 tokens: jax.Array, positions: jax.Array, cache: KVCache,
                 attn_impl: AttentionImpl = "auto") -> tuple[jax.Array, KVCache]:
    """Draft-vocabulary logits [B,T-1,DV] (`readout`; DV = V for a full-vocabulary
    drafter) proposed by block slots 1.. for a block of tokens [B,T] (the last accepted
    token, then mask tokens) at positions [B,T], over the context keys and values in
    `cache`, each layer's queries seeing what its kind lets them (`visible`); and the
    cache with the block's rows staged past its valid prefix (lengths unchanged: keeping it
    rather than the input spares a copy of the cache). A windowed layer's attention takes
    the XLA path, the only one that hides cache keys by position (`attention`)."""
    d = config.decoder
    rope = rope_for(d, positions)
    h = embedding_rows(target_params["embed"], tokens, compute_dtype(params))
    slots = jnp.arange(cache.k[0].shape[2])
    k_bufs, v_bufs = [], []
    for i, (layer, k_cache, v_cache) in enumerate(zip(params["layers"], cache.k, cache.v)):
        kind = config.layer(i)
        context = None if kind.window is None else visible(kind, positions, slots)
        h, _, _, k_buf, v_buf = decoder_layer_call(
            d, rope, h, layer, k_cache, v_cache, cache.lengths,
            visible(kind, positions, positions), attn_impl, native.kernels_allowed(),
            tables=cache.tables, cache_mask=context)
        k_bufs.append(k_buf)
        v_bufs.append(v_buf)
    hidden = rms_norm(h, params["final_norm"], d.rms_norm_eps)
    staged = KVCache(tuple(k_bufs), tuple(v_bufs), cache.lengths, cache.tables)
    return readout(params, config, target_params, hidden[:, 1:]), staged
