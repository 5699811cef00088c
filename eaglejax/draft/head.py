"""EAGLE draft heads as pure functions over a parameter dict.

EAGLE-3: `x = fc(taps)` (or the head's own previous hidden state on later steps); the
first layer attends over `concat(embed_norm(embed(token)), hidden_norm(x))`; further
layers are standard; logits = lm_head(final_norm(x)) over the draft vocabulary.
EAGLE-1/2: `x = fc(concat(embed(token), feature))` with the target's final normed hidden
state (or the head's own output) as feature, decoder layers whose first has no input
norm, and the target's lm_head applied to the un-normed output.
Draft position t consumes token t+1 and the target feature of position t.
P-EAGLE (`DraftConfig.parallel`): an EAGLE-3 head whose forward also runs K-1 mask slots
after the newest position (`mask_slots`): one forward proposes K tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.draft import dflash
from eaglejax.draft.config import DraftConfig
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.kv_cache import KVCache
from eaglejax.models.llama import (
    ParamInfo, Params, causal_mask, decoder_layer, embedding_rows, empty_cache, is_param_info,
    linear, param_info as decoder_info, random_params, rms_norm, rope_for, scan_chunks)


class DraftOutput(NamedTuple):
    """hidden: un-normed [B,T,H] (fed back on chain steps; `head_logits` turns it into
    draft-vocabulary logits); k_new/v_new: per layer [B,T,kv,D]; cache: the input cache
    with the new rows staged (None when no cache was given)."""

    hidden: jax.Array
    k_new: tuple[jax.Array, ...]
    v_new: tuple[jax.Array, ...]
    cache: KVCache | None


def param_info(config: DraftConfig) -> Params:
    """Every head parameter's `ParamInfo` (PyTorch [out, in] layout, like the target's), in
    the same tree structure as the params: the decoder's layers (the first without its
    input norm) and the head's own parameters (a DFlash drafter's: `dflash.param_info`)."""
    if config.kind == "dflash":
        return dflash.param_info(config)
    d = config.decoder
    h = d.hidden_size
    decoder = decoder_info(d)
    norm, layers = decoder["final_norm"], decoder["layers"]
    first = {k: v for k, v in layers[0].items() if k != "attn_norm"}
    if config.kind == "eagle3":
        wqkv = first["wqkv"]
        first.update(embed_norm=norm, hidden_norm=norm,
                     wqkv=wqkv._replace(shape=(*wqkv.shape[:-1], 2 * h),
                                        axes=(*wqkv.axes[:-1], "embed2")))
        infos: Params = {"fc": ParamInfo((h, config.feature_size), ("embed", "features")),
                         "layers": [first, *layers[1:]], "final_norm": norm,
                         "lm_head": ParamInfo((config.draft_vocab_size, h),
                                              ("draft_vocab", "embed"))}
        features = ParamInfo((config.feature_size,), ("features",), matrix=False)
        if config.fc_norm:
            infos["fc_norm"] = ParamInfo((len(config.tap_layers), config.target_hidden_size),
                                         ("taps", "features"), "ones", False)
        if config.input_norm:
            infos["input_norm"] = features._replace(init="ones")
        if config.parallel:
            infos["mask_hidden"] = features
            if not config.own_embedding:
                infos["mask_embed"] = ParamInfo((h,), ("embed",), matrix=False)
    else:
        infos = {"fc": ParamInfo((h, 2 * h), ("embed", "embed2")),
                 "layers": [first, *layers[1:]]}
        if config.fc_bias:
            infos["fc_bias"] = ParamInfo((h,), ("embed",), matrix=False)
    if config.own_embedding:
        infos["embed"] = decoder["embed"]
    return infos


def param_shapes(config: DraftConfig) -> Params:
    """Shapes of every head parameter, in the same tree structure as the params."""
    return jax.tree.map(lambda i: i.shape, param_info(config), is_leaf=is_param_info)


def logical_axes(config: DraftConfig) -> Params:
    """Logical axis names of every head parameter, in the same tree structure as the params."""
    return jax.tree.map(lambda i: i.axes, param_info(config), is_leaf=is_param_info)


def init_params(config: DraftConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32,
                scale: float = 0.02) -> Params:
    """Random head parameters (normal * scale; norms at 1)."""
    return random_params(param_info(config), key, dtype, scale)


def compute_dtype(params: Params) -> jnp.dtype:
    """The head's compute dtype: its norms' (its matrices, and the target's table, may be
    stored in 16 bits: `Draft.with_weight_dtype`)."""
    return params["layers"][0]["mlp_norm"].dtype


def embed_tokens(params: Params, config: DraftConfig, target_params: Params,
                 tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The head's token embeddings [..., H] in `dtype`: its own table or the target's; a
    P-EAGLE head trained by eaglejax embeds its mask token with the learned `mask_embed`
    (layouts that store tables carry it as that token's row of the head's own
    `embed_tokens`)."""
    embeds = embedding_rows(params.get("embed", target_params["embed"]), tokens, dtype)
    if "mask_embed" in params:
        is_mask = (tokens == config.mask_token_id)[..., None]
        embeds = jnp.where(is_mask, params["mask_embed"].astype(embeds.dtype), embeds)
    return embeds


def mask_slots(params: Params, config: DraftConfig, batch: int, count: int
               ) -> tuple[jax.Array, jax.Array]:
    """P-EAGLE's mask slots: tokens [B,count] (the mask token) and their features
    [B,count,feature_size] (the learned `mask_hidden`, which passes through `fc` like
    target features)."""
    tokens = jnp.full((batch, count), config.mask_token_id, jnp.int32)
    features = jnp.broadcast_to(params["mask_hidden"], (batch, count, config.feature_size))
    return tokens, features


def fc_input(params: Params, config: DraftConfig, features: jax.Array) -> jax.Array:
    """`fc` of target features [..., feature_size] (after the head's input norms, if any)."""
    eps = config.decoder.rms_norm_eps
    if config.fc_norm:
        taps = features.reshape(*features.shape[:-1], len(config.tap_layers), -1)
        features = rms_norm(taps, params["fc_norm"], eps).reshape(features.shape)
    if config.input_norm:
        features = rms_norm(features, params["input_norm"], eps)
    return linear(features, params["fc"])


def draft_forward(params: Params, config: DraftConfig, target_params: Params, tokens: jax.Array,
                  inputs: jax.Array, positions: jax.Array, cache: KVCache | None = None, *,
                  from_features: bool = True, mask: jax.Array | None = None,
                  attn_impl: AttentionImpl = "auto", stage: bool = True) -> DraftOutput:
    """Run the head on tokens [B,T] at positions [B,T].

    inputs: target features [B,T,feature_size] when `from_features`, else the head's own
    previous hidden states [B,T,H] (chain steps). The new K/V rows are staged in the cache
    after each row's valid prefix (lengths unchanged), as in the target's forward; with
    `stage=False` the cache is only read and returned as given (tree drafting, which
    re-feeds its nodes at every depth: no copy of the cache per step).
    """
    d = config.decoder
    eps = d.rms_norm_eps
    batch, t_new = tokens.shape
    mask = causal_mask(batch, t_new) if mask is None else mask
    given = cache
    dtype = compute_dtype(params)
    cache = empty_cache(d, batch, dtype) if cache is None else cache
    rope = rope_for(d, positions)
    embeds = embed_tokens(params, config, target_params, tokens, dtype)
    first = params["layers"][0]
    if config.kind == "eagle3":
        x = fc_input(params, config, inputs) if from_features else inputs
        attn_input = jnp.concatenate([rms_norm(embeds, first["embed_norm"], eps),
                                      rms_norm(x, first["hidden_norm"], eps)], axis=-1)
        if config.norm_before_residual:
            x = rms_norm(x, first["hidden_norm"], eps)
    else:
        x = linear(jnp.concatenate([embeds, inputs.astype(embeds.dtype)], axis=-1), params["fc"])
        if config.fc_bias:
            x = x + params["fc_bias"]
        attn_input = x
    k_new, v_new, k_bufs, v_bufs = [], [], [], []
    for i, (layer, k_cache, v_cache) in enumerate(zip(params["layers"], cache.k, cache.v)):
        x, k, v, k_buf, v_buf = decoder_layer(d, rope, x, layer, k_cache, v_cache, cache.lengths,
                                              mask, attn_impl, attn_input if i == 0 else None,
                                              stage=stage, tables=cache.tables)
        for out, value in ((k_new, k), (v_new, v), (k_bufs, k_buf), (v_bufs, v_buf)):
            out.append(value)
    staged = None if given is None else KVCache(tuple(k_bufs), tuple(v_bufs), cache.lengths,
                                                cache.tables)
    return DraftOutput(x, tuple(k_new), tuple(v_new), staged)


def draft_forward_chunked(params: Params, config: DraftConfig, target_params: Params,
                          tokens: jax.Array, features: jax.Array, cache: KVCache, *, chunk: int,
                          attn_impl: AttentionImpl = "auto") -> tuple[jax.Array, KVCache]:
    """`draft_forward` from target features over tokens [B,P] at positions cache.lengths +
    [0, P) (causal), `chunk` positions at a time (see `llama.scan_chunks`).

    Returns (un-normed hidden [B,P,H], the cache with all P rows staged, lengths unchanged)."""
    def run(carry: KVCache, block: tuple[jax.Array, ...], positions: jax.Array):
        out = draft_forward(params, config, target_params, block[0], block[1], positions, carry,
                            attn_impl=attn_impl)
        return out.cache, out.hidden

    staged, hidden = scan_chunks(run, cache, (tokens, features), chunk)
    return hidden, staged


def head_logits(params: Params, config: DraftConfig, target_params: Params,
                hidden: jax.Array) -> jax.Array:
    """Float32 draft-vocabulary logits [..., DV] of un-normed head outputs [..., H] (a
    DFlash drafter's: final-normed, `dflash.readout`); computed only where needed: the
    vocabulary projection is the head's largest matmul."""
    if config.kind == "dflash":  # its outputs are final-normed already
        return dflash.readout(params, config, target_params, hidden)
    if config.kind == "eagle3":
        logits = linear(hidden, params["lm_head"], norm=params["final_norm"],
                        eps=config.decoder.rms_norm_eps)
    else:
        logits = linear(hidden, target_params.get("lm_head", target_params["embed"]))
    return logits.astype(jnp.float32)


def to_target_ids(draft_ids: jax.Array, d2t: jax.Array) -> jax.Array:
    """Draft-vocabulary indices -> target token ids (`i + d2t[i]`)."""
    return draft_ids + d2t[draft_ids]


def to_target_logits(draft_logits: jax.Array, d2t: jax.Array, target_vocab: int) -> jax.Array:
    """Scatter draft logits [..., DV] into target-vocabulary logits [..., V] (-inf elsewhere)."""
    ids = to_target_ids(jnp.arange(draft_logits.shape[-1]), d2t)
    full = jnp.full((*draft_logits.shape[:-1], target_vocab), -jnp.inf, draft_logits.dtype)
    return full.at[..., ids].set(draft_logits)
