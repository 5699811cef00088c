"""DFlash drafters in the layouts they are published in, read and written.

z-lab (the authors' checkpoints, read by vLLM and SGLang): `config.json` is the drafter's own
Qwen3 config (`num_hidden_layers`: the drafter's layers) plus `block_size` (top level, or in
`dflash_config`), `dflash_config.mask_token_id` and `dflash_config.target_layer_ids`
(0-based target layers whose OUTPUTS are tapped: eaglejax's entering-layer taps - 1).
speculators (`speculators_model_type: "dflash"`): `transformer_layer_config` (the drafter's
layers), `block_size`, `mask_token_id`, `aux_hidden_state_layer_ids` (hidden-state indices:
eaglejax's taps as they are) and `draft_vocab_size`. Weights in both: `fc.weight`
[H, taps x H], `hidden_norm`, `norm` and Qwen3 layers `layers.N.*` with q/k norms; no
embedding (an `embed_tokens.weight` copy of the target's table is ignored) and no output
head: the target's serves. A speculators drafter with a reduced draft vocabulary
(`draft_vocab_size` < vocab_size) has its own `lm_head.weight` [DV, H] and the EAGLE-3
vocabulary maps `d2t` (int [DV]: draft id i is target id i + d2t[i]) and `t2d` (bool [V]);
a full-vocabulary one's d2t/t2d, if any, are ignored.

`export_dflash` writes the z-lab layout (block size at the top level and in `dflash_config`,
plus `num_target_layers`; it cannot hold a reduced vocabulary), `export_speculators_dflash`
the speculators one (with `speculators_config`: block_size - 1 greedy proposals and the
verifier); both write the weights above in the drafter's dtype and a complete Qwen3 layer
config, and refuse drafters whose layers are not Qwen3's (q/k norms, no biases).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.formats.common import (
    ReadResult, check_t2d, check_tensors, consumer_layer_config, d2t_from_tensors, dtype_name,
    layer_ids, open_weights, parse_decoder, prepare_output_dir, read_head_config,
    speculators_section, to_numpy, validate, vocab_map_tensors, weights_source,
    with_vocab_maps)
from eaglejax.errors import ConfigError
from eaglejax.loading.safetensors_file import save_safetensors
from eaglejax.loading.weights import hf_layer_shapes, layer_params_from_hf, layer_params_to_hf

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft
    from eaglejax.loading.hf_dir import HFWeights

IGNORED = ("embed_tokens.weight", "d2t", "t2d")  # a reduced vocabulary's d2t/t2d are read


def is_dflash(cfg: Mapping[str, Any]) -> bool:
    """Whether a head's config.json describes a DFlash drafter (either layout; a P-EAGLE
    head may name its mask token under `dflash_config` too, but has no block size)."""
    archs = cfg.get("architectures") or []
    section = cfg.get("dflash_config")
    sized = "block_size" in cfg or (isinstance(section, dict) and "block_size" in section)
    return (cfg.get("speculators_model_type") == "dflash"
            or any("DFlash" in str(a) for a in archs) or (section is not None and sized))


def _positive(cfg: Mapping[str, Any], key: str, source: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise ConfigError(f"{source}: {key!r} must be an integer >= 2, got {value!r}")
    return value


def dflash_config(cfg: Mapping[str, Any], source: str, target: ModelConfig) -> DraftConfig:
    """The DraftConfig of a DFlash config.json in either layout (module docstring)."""
    if cfg.get("speculators_model_type") == "dflash":
        layer_cfg = cfg.get("transformer_layer_config")
        if not isinstance(layer_cfg, dict):
            raise ConfigError(f"{source}: missing 'transformer_layer_config' object")
        decoder = parse_decoder(layer_cfg, f"{source} (transformer_layer_config)")
        taps = layer_ids(cfg.get("aux_hidden_state_layer_ids"), source,
                         "aux_hidden_state_layer_ids")
        where, block_key, mask = cfg, "block_size", cfg.get("mask_token_id")
        if cfg.get("sample_from_anchor"):
            raise ConfigError(f"{source}: 'sample_from_anchor: true' is not supported (the "
                              f"block's first slot holds the last accepted token)")
        draft_vocab = cfg.get("draft_vocab_size", decoder.vocab_size)
        if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool) \
                or not 1 <= draft_vocab <= decoder.vocab_size:
            raise ConfigError(f"{source}: 'draft_vocab_size' must be an integer in [1, "
                              f"vocab_size {decoder.vocab_size}], got {draft_vocab!r}")
    else:
        decoder = parse_decoder(cfg, source)
        section = cfg.get("dflash_config") or {}
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: 'dflash_config' must be an object")
        outputs = layer_ids(section.get("target_layer_ids"), source,
                            "dflash_config.target_layer_ids")
        taps = None if outputs is None else tuple(i + 1 for i in outputs)
        where = cfg if "block_size" in cfg else section
        block_key, mask, draft_vocab = "block_size", section.get("mask_token_id"), None
    if taps is None:
        raise ConfigError(f"{source}: the tapped target layers are missing "
                          f"('dflash_config.target_layer_ids' or 'aux_hidden_state_layer_ids')")
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < target.vocab_size:
        raise ConfigError(f"{source}: the mask token id must be a token of the target's "
                          f"vocabulary [0, {target.vocab_size}), got {mask!r}")
    return DraftConfig("dflash", decoder, draft_vocab or decoder.vocab_size, target.hidden_size,
                       taps, mask_token_id=mask, block_size=_positive(where, block_key, source))


def expected_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every weight tensor a DFlash drafter of `config` has, with its PyTorch shape."""
    h = config.hidden_size
    shapes = {"fc.weight": (h, config.feature_size), "hidden_norm.weight": (h,),
              "norm.weight": (h,)}
    if config.reduced_vocab:
        shapes["lm_head.weight"] = (config.draft_vocab_size, h)
    for i in range(config.decoder.num_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in hf_layer_shapes(config.decoder).items()})
    return shapes


def read_dflash(path: Path, target: ModelConfig, weights: "HFWeights | None" = None
                ) -> ReadResult:
    """(config, float32 params, int32 d2t) of a DFlash drafter directory."""
    cfg, source = read_head_config(path)
    config = dflash_config(cfg, source, target)
    weights = open_weights(path, weights)
    wsource = weights_source(path)
    ignored = ("embed_tokens.weight",) if config.reduced_vocab else IGNORED
    shapes = {k: v for k, v in weights.shapes().items() if k not in ignored}
    check_tensors(shapes, with_vocab_maps(shapes, expected_shapes(config)), wsource)
    check_t2d(shapes.get("t2d"), target.vocab_size, wsource)
    d2t = d2t_from_tensors(weights.get("d2t") if "d2t" in shapes else None,
                           config.draft_vocab_size, target.vocab_size, wsource)
    f32 = lambda name: np.asarray(weights.get(name), np.float32)  # noqa: E731
    layers = [layer_params_from_hf(config.decoder, lambda n, i=i: weights.get(f"layers.{i}.{n}"))
              for i in range(config.decoder.num_layers)]
    params = {"fc": f32("fc.weight"), "hidden_norm": f32("hidden_norm.weight"),
              "layers": layers, "final_norm": f32("norm.weight")}
    if config.reduced_vocab:
        params["lm_head"] = f32("lm_head.weight")
    validate(config, params, d2t, target, source, "the tapped layers")
    return config, params, d2t


def export_dflash(draft: "Draft", path: str | Path) -> Path:
    """Write a DFlash drafter in the z-lab layout (what vLLM and SGLang read, and speculators'
    DFlash converter takes) to `path`, a new or empty directory; returns it."""
    c = draft.config
    _check_exportable(draft, "z-lab DFlash")
    if 0 in c.tap_layers:
        raise ConfigError(f"cannot export {draft.source} in the z-lab DFlash layout: it taps "
                          f"the embeddings (entering layer 0), which has no target-layer "
                          f"output id; use the speculators layout")
    if c.reduced_vocab:
        raise ConfigError(f"cannot export {draft.source} in the z-lab DFlash layout: its "
                          f"draft vocabulary is reduced ({c.draft_vocab_size} of "
                          f"{c.decoder.vocab_size} tokens), which the layout cannot hold; "
                          f"use the speculators layout")
    dflash_section = {"mask_token_id": c.mask_token_id, "block_size": c.block_size,
                      "target_layer_ids": [i - 1 for i in c.tap_layers]}
    config = {**_layer_config(draft), "architectures": ["DFlashDraftModel"],
              "block_size": c.block_size, "dflash_config": dflash_section,
              "num_target_layers": draft.target.config.num_layers}
    return _write(draft, path, config)


def export_speculators_dflash(draft: "Draft", path: str | Path) -> Path:
    """Write a DFlash drafter in the speculators dflash layout (what the speculators package
    and vLLM read) to `path`, a new or empty directory; returns it."""
    c = draft.config
    _check_exportable(draft, "speculators dflash")
    layer_config = _layer_config(draft)
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "aux_hidden_state_layer_ids": list(c.tap_layers),
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "speculators_config": speculators_section("dflash", c.block_size - 1, draft.target),
        "torch_dtype": layer_config["torch_dtype"],
    }
    return _write(draft, path, config)


def _check_exportable(draft: "Draft", layout: str) -> None:
    """ConfigError, naming the drafter and why, unless the layout can hold it."""
    c = draft.config
    why = None
    if c.kind != "dflash":
        why = f"it is an {c.kind} head (the layout holds DFlash drafters only)"
    elif c.decoder.attention_bias or not c.decoder.qk_norm:
        why = ("its layers are not Qwen3 layers (q/k norms, no biases), which the consumers' "
               "DFlash layers are")
    if why is not None:
        raise ConfigError(f"cannot export {draft.source} in the {layout} layout: {why}")


def _layer_config(draft: "Draft") -> dict[str, Any]:
    """The drafter's layers as a complete Qwen3 config.json dict (vLLM builds its layers
    from it; speculators passes it to transformers' Qwen3Config)."""
    d = draft.config.decoder
    config = consumer_layer_config(d, dtype_name(draft.params))
    del config["mlp_bias"], config["pretraining_tp"]  # Llama's, not Qwen3's
    window = "sliding_attention" if d.sliding_window else "full_attention"
    config.update(use_sliding_window=d.sliding_window is not None,
                  max_window_layers=0 if d.sliding_window else d.num_layers,
                  layer_types=[window] * d.num_layers)
    return config


def _write(draft: "Draft", path: str | Path, config: dict[str, Any]) -> Path:
    """model.safetensors (the drafter's tensors in their own dtype; with a reduced
    vocabulary its lm_head, d2t and t2d too) and config.json."""
    c = draft.config
    out = prepare_output_dir(path)
    params = to_numpy(draft.params)
    tensors = {"fc.weight": params["fc"], "hidden_norm.weight": params["hidden_norm"]}
    for i, layer in enumerate(params["layers"]):
        tensors.update({f"layers.{i}.{k}": v
                        for k, v in layer_params_to_hf(c.decoder, layer).items()})
    tensors["norm.weight"] = params["final_norm"]
    if c.reduced_vocab:
        tensors["lm_head.weight"] = params["lm_head"]
        tensors.update(vocab_map_tensors(np.asarray(draft.d2t), c.decoder.vocab_size))
    save_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
