"""EAGLE-3 and P-EAGLE heads in the speculators layout (vllm-project/speculators; what vLLM
reads).

`config.json`: `speculators_model_type: "eagle3"` or `"peagle"` (with `mask_token_id`, and a
`mask_hidden` tensor [1, 1, taps x H]), a nested `transformer_layer_config` (a
complete Llama/Qwen3 config whose vocab_size is the TARGET's: vLLM turns it into a bare
PretrainedConfig, so every key its layers read must be written), `draft_vocab_size`,
`target_hidden_size`, `norm_before_residual` (true when absent, as in vLLM), `norm_before_fc`,
`fc_norm` and `eagle_aux_hidden_state_layer_ids` (layers ENTERED, vLLM's semantics, the same
as eaglejax's).
Weights: `layers.0.*` (2H attention input), standard `layers.1..`, `norm`, `lm_head`, d2t, t2d.
DFlash drafters (`speculators_model_type: "dflash"`) are read and written by `formats.dflash`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eaglejax.config import ModelConfig
from eaglejax.draft.formats.common import (
    ReadResult,
    consumer_layer_config,
    dtype_name,
    layer_ids,
    mask_token_id,
    open_weights,
    parse_decoder,
    read_head_config,
    speculators_section,
)
from eaglejax.draft.formats.dflash import export_speculators_dflash
from eaglejax.draft.formats.eagle3_tensors import (
    SPECULATORS_FIRST,
    eagle3_config,
    read_eagle3_weights,
    write_eagle3_weights,
)
from eaglejax.errors import ConfigError
from eaglejax.target import default_tap_layers

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft
    from eaglejax.loading.hf_dir import HFWeights

TAPS_KEY = "eagle_aux_hidden_state_layer_ids"


def is_speculators(cfg: dict) -> bool:
    return "speculators_model_type" in cfg or "Eagle3Speculator" in (cfg.get("architectures") or [])


def read_speculators(path: Path, target: ModelConfig, weights: "HFWeights | None" = None
                     ) -> ReadResult:
    """(config, float32 params, int32 d2t) of a speculators EAGLE-3 head directory."""
    cfg, source = read_head_config(path)
    kind = cfg.get("speculators_model_type")
    if kind not in ("eagle3", "peagle"):
        raise ConfigError(f"{source}: speculators_model_type {kind!r} is not supported "
                          f"(supported: 'eagle3', 'peagle')")
    mask_id, _ = mask_token_id(cfg, source)
    if kind == "peagle" and mask_id is None:
        raise ConfigError(f"{source}: a 'peagle' head needs its mask token id "
                          f"('mask_token_id')")
    layer_cfg = cfg.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise ConfigError(f"{source}: missing 'transformer_layer_config' object")
    decoder = parse_decoder(layer_cfg, f"{source} (transformer_layer_config)")
    taps = layer_ids(cfg.get(TAPS_KEY), source, TAPS_KEY)
    tap_key = TAPS_KEY if taps is not None else "the default (2, L//2, L-3)"
    weights = open_weights(path, weights)
    # norm_before_residual absent: vLLM reads true for eagle3 heads, false for peagle heads
    config = eagle3_config(cfg, source, decoder, taps or default_tap_layers(target.num_layers),
                           weights, norm_before_residual=kind == "eagle3",
                           mask_token_id=mask_id)
    return read_eagle3_weights(config, weights, path, target, source, tap_key,
                               SPECULATORS_FIRST)


def export_speculators(draft: "Draft", path: str | Path, speculative_tokens: int = 3) -> Path:
    """Write `draft` in the speculators layout as vLLM and the speculators package read it
    (config.json with `speculators_config`, model.safetensors with d2t int64 and t2d bool).
    A DFlash drafter is written in the speculators dflash layout (`formats.dflash`), which
    proposes block_size - 1 tokens (`speculative_tokens` is not used)."""
    c = draft.config
    if c.kind == "dflash":
        return export_speculators_dflash(draft, path)
    why = None
    if c.kind != "eagle3":
        why = (f"it is an {c.kind} head (the speculators layout holds EAGLE-3, P-EAGLE and "
               f"DFlash drafters)")
    elif c.decoder.attention_bias:
        why = ("its layer has q/k/v biases without an o_proj bias, which the consumers' "
               "llama/qwen3 layers (biases on q, k, v and o together, or none) cannot hold")
    if why is not None:
        raise ConfigError(f"cannot export {draft.source} in the speculators layout: {why}")
    out, _ = write_eagle3_weights(draft, path, SPECULATORS_FIRST)
    (out / "config.json").write_text(json.dumps(_config_json(draft, speculative_tokens),
                                                indent=2) + "\n")
    return out


def _config_json(draft: "Draft", speculative_tokens: int) -> dict[str, Any]:
    """The config.json of a bias-free EAGLE-3 head in the speculators layout."""
    c = draft.config
    dtype = dtype_name(draft.params)
    decoder = c.decoder
    if decoder.model_type == "mistral":  # the same layer; vLLM and speculators take llama/qwen3
        decoder = dataclasses.replace(decoder, model_type="llama")
    layer_config = consumer_layer_config(decoder, dtype)
    # vLLM sizes fc from `num_aux_hidden_states` (else 3 taps), not from the tap list
    layer_config["num_aux_hidden_states"] = len(c.tap_layers)
    kind = "peagle" if c.parallel else "eagle3"
    parallel = {"mask_token_id": c.mask_token_id} if c.parallel else {}
    return {
        "architectures": ["PEagleDraftModel" if c.parallel else "Eagle3Speculator"],
        "speculators_model_type": kind,
        **parallel,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        TAPS_KEY: list(c.tap_layers),
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.input_norm,
        "fc_norm": c.fc_norm,
        "norm_output": False,
        "transformer_layer_config": layer_config,
        "speculators_config": speculators_section(kind, speculative_tokens, draft.target),
        "torch_dtype": dtype,
    }
