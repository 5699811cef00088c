"""`Draft`: a loaded draft head bound to its target, and its inspection API."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax import validation
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.dflash import default_taps
from eaglejax.draft.formats.native import write_head
from eaglejax.draft.head import (
    draft_forward,
    head_logits,
    init_params,
    mask_slots,
    param_info,
    to_target_logits,
)
from eaglejax.errors import InputError
from eaglejax.models.llama import Params, store_matrices
from eaglejax.models.placement import replicate
from eaglejax.models.quantized import any_int8
from eaglejax.target import Target, default_tap_layers, weight_storage


@functools.partial(jax.jit, static_argnames=("config", "attn_impl"))
def _teacher_forced_logits(params: Params, config: DraftConfig, target_params: Params,
                           d2t: jax.Array, tokens: jax.Array, features: jax.Array, *,
                           attn_impl: str) -> jax.Array:
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length)[None], (batch, length))
    out = draft_forward(params, config, target_params, tokens, features, positions,
                        attn_impl=attn_impl)
    logits = head_logits(params, config, target_params, out.hidden)
    return to_target_logits(logits, d2t, config.decoder.vocab_size)


@functools.partial(jax.jit, static_argnames=("config", "k", "attn_impl"))
def _parallel_logits(params: Params, config: DraftConfig, target_params: Params,
                     d2t: jax.Array, tokens: jax.Array, features: jax.Array, *, k: int,
                     attn_impl: str) -> jax.Array:
    batch, length = tokens.shape
    mask_tokens, mask_features = mask_slots(params, config, batch, k - 1)
    tokens = jnp.concatenate([tokens, mask_tokens], axis=1)
    features = jnp.concatenate([features, mask_features.astype(features.dtype)], axis=1)
    positions = jnp.broadcast_to(jnp.arange(length + k - 1)[None], tokens.shape)
    out = draft_forward(params, config, target_params, tokens, features, positions,
                        attn_impl=attn_impl)
    logits = head_logits(params, config, target_params, out.hidden[:, length - 1:])
    return to_target_logits(logits, d2t, config.decoder.vocab_size)


@dataclasses.dataclass
class Draft:
    """A draft head ready for speculative decoding. Build it with `eaglejax.load_draft`.

    d2t maps draft-vocabulary index i to target token `i + d2t[i]` (zeros when DV == V).
    """

    config: DraftConfig
    params: Params
    d2t: jax.Array
    target: "Target"
    source: str

    @property
    def parallel(self) -> bool:
        """Whether this is a P-EAGLE head (it drafts K tokens per forward)."""
        return self.config.parallel

    @property
    def dflash(self) -> bool:
        """Whether this is a DFlash drafter (it fills a block per forward)."""
        return self.config.kind == "dflash"

    def logits(self, token_ids: Sequence[Sequence[int]] | np.ndarray,
               features: np.ndarray | jax.Array) -> jax.Array:
        """Teacher-forced first-step draft logits [B,T,V] over the TARGET vocabulary
        (tokens outside the draft vocabulary get -inf). Position t consumes
        `embed(token_ids[t])` and `features[t]` and predicts the token after
        `token_ids[t]`: to score a sequence x with target features f pass `x[:, 1:]` and
        `f[:, :-1]`. (A DFlash drafter proposes blocks instead: `eaglejax.draft.dflash`.)"""
        if self.config.kind == "dflash":
            raise InputError(f"{self.source} is a DFlash drafter: it proposes whole blocks "
                             f"(eaglejax.draft.dflash.block_logits), not one token a step")
        tokens = self.target._token_array(token_ids)
        return _teacher_forced_logits(self.params, self.config, self.target.params, self.d2t,
                                      tokens, self._checked_features(tokens, features),
                                      attn_impl=self.target.attn_impl)

    def _checked_features(self, tokens: jax.Array, features: np.ndarray | jax.Array
                          ) -> jax.Array:
        features = jnp.asarray(features)
        want = (*tokens.shape, self.config.feature_size)
        if features.shape != want:
            raise InputError(f"features must have shape {want} for this head, "
                             f"got {features.shape}")
        return features.astype(self.target.dtype)

    def parallel_logits(self, token_ids: Sequence[Sequence[int]] | np.ndarray,
                        features: np.ndarray | jax.Array, num_draft_tokens: int) -> jax.Array:
        """P-EAGLE's K draft distributions [B,K,V] (target vocabulary, -inf outside the
        draft vocabulary) after a sequence, from ONE forward: `token_ids` and `features` as
        for `logits` (x[:, 1:] with f[:, :-1]); slot 1 is the next token's, slots 2..K come
        from the K-1 mask slots that follow."""
        if not self.config.parallel:
            raise InputError(f"{self.source} is not a P-EAGLE head (no mask token)")
        k = validation.integer("num_draft_tokens", num_draft_tokens, 1)
        tokens = self.target._token_array(token_ids)
        features = self._checked_features(tokens, features)
        return _parallel_logits(self.params, self.config, self.target.params, self.d2t, tokens,
                                features, k=k, attn_impl=self.target.attn_impl)

    def target_features(self, token_ids: Sequence[Sequence[int]] | np.ndarray) -> jax.Array:
        """The target features this head consumes, for a full sequence."""
        if self.config.kind == "eagle1":
            return self.target.final_hidden(token_ids)
        return self.target.features(token_ids, self.config.tap_layers)

    def for_target(self, target: "Target") -> "Draft":
        """This head for `target`, the same model placed elsewhere (`Target.on_mesh`): on
        a mesh the head is replicated on every device (see `eaglejax.models.placement`)."""
        params, d2t = self.params, self.d2t
        if target.mesh is not None:
            params, d2t = replicate((params, d2t), target.mesh)
        return dataclasses.replace(self, params=params, d2t=d2t, target=target)

    def with_weight_dtype(self, dtype: jnp.dtype | str) -> "Draft":
        """This head with its matrices stored in `dtype` (norms and other vectors keep the
        compute dtype), as `Target.with_weight_dtype` stores a target's."""
        dtype = weight_storage("weight_dtype", dtype)
        if any_int8(self.params):
            raise InputError(f"{self.source}: this head's matrices are already quantized to "
                             f"int8; load it again to store them another way")
        params = store_matrices(param_info(self.config), self.params, dtype)
        if self.target.mesh is not None:  # quantized on the host: replicated again
            params = replicate(params, self.target.mesh)
        return dataclasses.replace(self, params=params)

    def save(self, path: str) -> None:
        """Write the head in eaglejax's own format (a new or empty directory)."""
        if any_int8(self.params):
            raise InputError(f"{self.source}: saving int8 storage is not supported yet; save "
                             f"the head as loaded in a float dtype")
        write_head(self.config, self.params, self.d2t, self.source, path)


def new_dflash_draft(target: "Target", *, num_layers: int = 2, block_size: int = 8,
                     mask_token_id: int, used_tokens: np.ndarray | None = None, seed: int = 0,
                     scale: float = 0.02, from_target: bool = False) -> Draft:
    """A freshly initialised DFlash drafter for `target`: `num_layers` Qwen3-style layers of
    the target's attention shape (q/k norms, no biases), filling blocks of `block_size`
    (the last accepted token, then `mask_token_id`), tapping `num_layers` target layers.

    `used_tokens` (sorted target ids, fewer than V) reduces its vocabulary to those tokens:
    it then reads out through its own `lm_head`, the target's output rows of those tokens;
    None (or all V ids): through the target's head.
    `from_target` starts it from the target: its layers are copies of the target's last
    `num_layers` (q/k norms at one), its final norm is the target's, and `fc` passes the
    deepest tap through, so the context keys and values start as those last layers
    compute them from the residual stream they read."""
    c = target.config
    validation.integer("mask_token_id", mask_token_id, 0, c.vocab_size - 1)
    validation.integer("block_size", block_size, 2)
    used = _used_tokens(used_tokens, c.vocab_size)
    decoder = dataclasses.replace(c, model_type="qwen3", num_layers=num_layers,
                                  tie_word_embeddings=False, attention_bias=False,
                                  qk_norm=True)
    taps = default_taps(c.num_layers, num_layers)
    config = DraftConfig("dflash", decoder, len(used), c.hidden_size, taps,
                         mask_token_id=mask_token_id, block_size=block_size)
    params = init_params(config, jax.random.PRNGKey(seed), dtype=target.dtype, scale=scale)
    if config.reduced_vocab:
        params["lm_head"] = _output_rows(target, used)
    if from_target:
        _start_from_target_layers(params, target, config)
    return Draft(config, params, _d2t(used), target, f"new-dflash-seed{seed}")


def _used_tokens(used_tokens: np.ndarray | None, vocab_size: int) -> np.ndarray:
    """A draft vocabulary's sorted target ids (all of V if None), checked."""
    used = np.arange(vocab_size) if used_tokens is None else np.asarray(used_tokens)
    if used.ndim != 1 or not used.size or np.any(np.diff(used) <= 0) or used[0] < 0 \
            or used[-1] >= vocab_size:
        raise InputError(f"used_tokens must be strictly increasing target ids in "
                         f"[0, {vocab_size}), got {used!r:.80}")
    return used


def _d2t(used: np.ndarray) -> jax.Array:
    """The draft -> target offsets of sorted target ids `used`."""
    return jnp.asarray(used - np.arange(len(used)), jnp.int32)


def _output_rows(target: "Target", used: np.ndarray) -> jax.Array:
    """The target's output-head rows of token ids `used` [DV, H], in the target's dtype."""
    output_rows = target.params.get("lm_head", target.params["embed"])
    return jnp.asarray(output_rows)[jnp.asarray(used)].astype(target.dtype)


def _start_from_target_layers(params: Params, target: "Target", config: DraftConfig) -> None:
    """`new_dflash_draft(from_target=True)`'s initialisation, in place."""
    h, deepest = target.config.hidden_size, int(np.argmax(config.tap_layers))
    copy = functools.partial(jnp.array, dtype=target.dtype, copy=True)
    last_layers = target.params["layers"][-config.decoder.num_layers:]
    for layer, source in zip(params["layers"], last_layers):
        layer.update({name: copy(source[name]) for name in layer if name in source})
    params["final_norm"] = copy(target.params["final_norm"])
    params["hidden_norm"] = copy(last_layers[0]["attn_norm"])
    params["fc"] = jnp.zeros_like(params["fc"]).at[:, deepest * h:(deepest + 1) * h].set(
        jnp.eye(h, dtype=target.dtype))


def new_eagle3_draft(target: "Target", *, used_tokens: np.ndarray | None = None,
                     num_layers: int = 1, seed: int = 0, scale: float = 0.02,
                     from_target: bool = False, mask_token_id: int | None = None,
                     own_embedding: bool = False) -> Draft:
    """A freshly initialised EAGLE-3 head for `target` (the starting point of training).

    Its decoder layers mirror the target's attention shape (heads, KV heads, head dim,
    MLP width); `used_tokens` (sorted target ids) is the draft vocabulary, all of V if None.
    `from_target` warm-starts the output side from the target: the head's lm_head takes the
    target's output rows of the draft vocabulary, its final norm the target's, and `fc`
    passes the deepest tap through, so before any training the head already reads the
    target's late residual stream through the target's own output layer ("logit lens").
    `mask_token_id` makes it a P-EAGLE head (K tokens per forward; `DraftConfig.parallel`)
    whose mask token gets its own trainable embedding `mask_embed` (starting from the
    target's row); `own_embedding`: the head keeps a trainable copy of the whole table.
    """
    c = target.config
    used = _used_tokens(used_tokens, c.vocab_size)
    decoder = dataclasses.replace(c, model_type="llama", num_layers=num_layers,
                                  tie_word_embeddings=False, attention_bias=False, qk_norm=False)
    if mask_token_id is not None:
        validation.integer("mask_token_id", mask_token_id, 0, c.vocab_size - 1)
    config = DraftConfig("eagle3", decoder, len(used), c.hidden_size,
                         default_tap_layers(c.num_layers), own_embedding=own_embedding,
                         mask_token_id=mask_token_id)
    params = init_params(config, jax.random.PRNGKey(seed), dtype=target.dtype, scale=scale)
    if own_embedding:
        params["embed"] = jnp.array(target.params["embed"], target.dtype, copy=True)
    elif mask_token_id is not None:
        params["mask_embed"] = jnp.array(target.params["embed"][mask_token_id], target.dtype)
    if from_target:
        h, deepest = c.hidden_size, int(np.argmax(config.tap_layers))
        params["lm_head"] = _output_rows(target, used)
        params["final_norm"] = jnp.array(target.params["final_norm"], target.dtype, copy=True)
        params["fc"] = jnp.zeros_like(params["fc"]).at[:, deepest * h:(deepest + 1) * h].set(
            jnp.eye(h, dtype=target.dtype))
    return Draft(config, params, _d2t(used), target, f"new-eagle3-seed{seed}")
