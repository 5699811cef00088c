"""The EAGLE-3 tensor table shared by the reference/SpecForge (`midlayer.*`) and speculators
(`layers.0.*`) layouts, and its mapping onto eaglejax's head parameters."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.formats.common import (
    MASK_TOKEN_KEYS,
    ReadResult,
    Shapes,
    check_t2d,
    check_tensors,
    d2t_from_tensors,
    flag,
    prepare_output_dir,
    to_numpy,
    validate,
    validate_config,
    vocab_map_tensors,
    weights_source,
    with_vocab_maps,
)
from eaglejax.errors import ConfigError
from eaglejax.loading.safetensors_file import save_safetensors
from eaglejax.loading.weights import (
    hf_layer_shapes,
    layer_params_from_hf,
    layer_params_to_hf,
)
from eaglejax.models.llama import Params

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft
    from eaglejax.loading.hf_dir import HFWeights

REFERENCE_FIRST = "midlayer."
SPECULATORS_FIRST = "layers.0."
MASK_HIDDEN = "mask_hidden"  # P-EAGLE's learned stand-in for target features (before fc)


def _layer_prefix(first: str, i: int) -> str:
    return first if i == 0 else f"layers.{i}."


def expected_shapes(config: DraftConfig, first: str) -> Shapes:
    """Every weight tensor the config implies (d2t/t2d excluded), with its PyTorch shape."""
    d, h = config.decoder, config.hidden_size
    shapes: Shapes = {"fc.weight": (h, config.feature_size)}
    for i in range(d.num_layers):
        layer = hf_layer_shapes(d, in_features=2 * h if i == 0 else None)
        shapes.update({_layer_prefix(first, i) + k: s for k, s in layer.items()})
    shapes[first + "hidden_norm.weight"] = (h,)
    shapes["norm.weight"] = (h,)
    shapes["lm_head.weight"] = (config.draft_vocab_size, h)
    if config.fc_norm:
        shapes.update({f"fc_norm.{k}.weight": (config.target_hidden_size,)
                       for k in range(len(config.tap_layers))})
    if config.input_norm:
        shapes["input_norm.weight"] = (config.feature_size,)
    if config.own_embedding:
        shapes["embed_tokens.weight"] = (d.vocab_size, h)
    if config.parallel:
        shapes[MASK_HIDDEN] = (1, 1, config.feature_size)  # speculators' shape
    return shapes


def params_from_tensors(config: DraftConfig, get: Callable[[str], np.ndarray],
                        first: str) -> Params:
    """The head's parameter tree (float32 numpy) from tensors already checked by shape."""
    f32 = lambda name: np.asarray(get(name), np.float32)  # noqa: E731
    layers = []
    for i in range(config.decoder.num_layers):
        prefix = _layer_prefix(first, i)
        layer = layer_params_from_hf(config.decoder, lambda n, p=prefix: get(p + n))
        if i == 0:
            layer["embed_norm"] = layer.pop("attn_norm")
            layer["hidden_norm"] = f32(first + "hidden_norm.weight")
        layers.append(layer)
    params: Params = {"fc": f32("fc.weight"), "layers": layers, "final_norm": f32("norm.weight"),
                      "lm_head": f32("lm_head.weight")}
    if config.fc_norm:
        params["fc_norm"] = np.stack([f32(f"fc_norm.{k}.weight")
                                      for k in range(len(config.tap_layers))])
    if config.input_norm:
        params["input_norm"] = f32("input_norm.weight")
    if config.own_embedding:
        params["embed"] = f32("embed_tokens.weight")
    if config.parallel:
        params["mask_hidden"] = f32(MASK_HIDDEN).reshape(config.feature_size)
    return params


def tensors_from_params(config: DraftConfig, params: Params, first: str,
                        target_embed: np.ndarray) -> dict[str, np.ndarray]:
    """Inverse of `params_from_tensors`, in the params' own dtype (d2t/t2d excluded).

    A learned `mask_embed` is written as the layouts hold it: the head's own
    `embed_tokens`, the target's table (`target_embed`) with the mask token's row replaced."""
    arr = np.asarray
    out: dict[str, np.ndarray] = {"fc.weight": arr(params["fc"])}
    for i, layer in enumerate(params["layers"]):
        layer = dict(layer)
        if i == 0:
            out[first + "hidden_norm.weight"] = arr(layer.pop("hidden_norm"))
            layer["attn_norm"] = layer.pop("embed_norm")
        prefix = _layer_prefix(first, i)
        out.update({prefix + k: v for k, v in layer_params_to_hf(config.decoder, layer).items()})
    out["norm.weight"] = arr(params["final_norm"])
    out["lm_head.weight"] = arr(params["lm_head"])
    if config.fc_norm:
        out.update({f"fc_norm.{k}.weight": arr(w) for k, w in enumerate(arr(params["fc_norm"]))})
    if config.input_norm:
        out["input_norm.weight"] = arr(params["input_norm"])
    if config.own_embedding:
        out["embed_tokens.weight"] = arr(params["embed"])
    if "mask_embed" in params:
        mask_embed = arr(params["mask_embed"])
        table = np.array(target_embed, dtype=mask_embed.dtype)
        table[config.mask_token_id] = mask_embed
        out["embed_tokens.weight"] = table
    if config.parallel:
        out[MASK_HIDDEN] = arr(params["mask_hidden"]).reshape(1, 1, config.feature_size)
    return out


def read_eagle3_weights(config: DraftConfig, weights: "HFWeights", path: Path,
                        target: ModelConfig, source: str, tap_key: str, first: str) -> ReadResult:
    """Validate a parsed EAGLE-3 config and its tensors against the target, then build
    (config, float32 params, int32 d2t); `first` is the layout's first-layer prefix."""
    validate_config(config, target, source, tap_key)
    shapes = weights.shapes()
    wsource = weights_source(path)
    if MASK_HIDDEN in shapes and not config.parallel:
        raise ConfigError(f"{source}: the head has a {MASK_HIDDEN!r} tensor (P-EAGLE) but no "
                          f"mask token id under any of {', '.join(MASK_TOKEN_KEYS)}")
    expected = expected_shapes(config, first)
    if config.parallel and MASK_HIDDEN in shapes and \
            int(np.prod(shapes[MASK_HIDDEN])) == config.feature_size:
        expected[MASK_HIDDEN] = tuple(shapes[MASK_HIDDEN])  # [F], [1,F] or [1,1,F]
    check_tensors(shapes, with_vocab_maps(shapes, expected), wsource)
    check_t2d(shapes.get("t2d"), target.vocab_size, wsource)
    d2t = d2t_from_tensors(weights.get("d2t") if "d2t" in shapes else None,
                           config.draft_vocab_size, config.decoder.vocab_size, wsource)
    params = params_from_tensors(config, weights.get, first)
    validate(config, params, d2t, target, source, tap_key)
    return config, params, d2t


def eagle3_config(cfg: Mapping[str, Any], source: str, decoder: ModelConfig,
                  taps: tuple[int, ...], weights: "HFWeights", *,
                  norm_before_residual: bool, mask_token_id: int | None) -> DraftConfig:
    """The DraftConfig of an EAGLE-3 head from the config keys both layouts share
    (`draft_vocab_size`, `target_hidden_size`, `fc_norm`, `norm_before_fc`,
    `norm_before_residual` with the layout's default) and whether its weights carry their own
    embedding."""
    return DraftConfig(
        kind="eagle3", decoder=decoder,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or decoder.vocab_size),
        target_hidden_size=int(cfg.get("target_hidden_size") or decoder.hidden_size),
        tap_layers=taps,
        fc_norm=flag(cfg, "fc_norm", False, source),
        input_norm=flag(cfg, "norm_before_fc", False, source),
        norm_before_residual=flag(cfg, "norm_before_residual", norm_before_residual, source),
        own_embedding="embed_tokens.weight" in weights.shapes(), mask_token_id=mask_token_id)


def write_eagle3_weights(draft: "Draft", path: str | Path, first: str) -> tuple[Path, Params]:
    """A fresh output directory at `path` holding `draft`'s tensors in the layout whose
    first layer is named `first` (model.safetensors, with d2t int64 and t2d bool); the
    directory and the head's parameters as numpy arrays."""
    c = draft.config
    out = prepare_output_dir(path)
    params = to_numpy(draft.params)
    tensors = tensors_from_params(c, params, first, np.asarray(draft.target.params["embed"]))
    tensors.update(vocab_map_tensors(np.asarray(draft.d2t), c.decoder.vocab_size))
    save_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    return out, params
