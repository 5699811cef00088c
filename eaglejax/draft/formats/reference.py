"""EAGLE-3 heads in the reference layout (SafeAILab/EAGLE) and its SpecForge/SGLang copies,
and P-EAGLE heads in it as vLLM reads them (a `mask_hidden` tensor, the mask token id under
one of `formats.common.MASK_TOKEN_KEYS`).

`config.json` is a Llama config with `draft_vocab_size` (and optionally `target_hidden_size`,
`fc_norm`, `eagle_config.eagle_aux_hidden_state_layer_ids`); the single decoder layer lives
under `midlayer.*`. SpecForge/SGLang layer ids name the OUTPUT of a target layer, i.e. the
stream ENTERING layer id+1, which is what eaglejax stores.
"""

from __future__ import annotations

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
)
from eaglejax.draft.formats.eagle3_tensors import (
    REFERENCE_FIRST,
    eagle3_config,
    read_eagle3_weights,
    write_eagle3_weights,
)
from eaglejax.errors import ConfigError
from eaglejax.target import default_tap_layers

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft
    from eaglejax.loading.hf_dir import HFWeights

OUTPUT_IDS_KEY = "eagle_config.eagle_aux_hidden_state_layer_ids"


def _taps(cfg: dict[str, Any], target: ModelConfig, source: str) -> tuple[tuple[int, ...], str]:
    """Entering-layer taps and where they came from: SpecForge output ids + 1, else vLLM-style
    top-level entering ids, else the default (2, L//2, L-3) of the target."""
    eagle_config = cfg.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise ConfigError(f"{source}: 'eagle_config' must be an object, got {eagle_config!r}")
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ConfigError(f"{source}: eagle_config.use_aux_hidden_state is false (a head "
                          f"without target-layer taps), which eaglejax does not support")
    outputs = layer_ids(eagle_config.get("eagle_aux_hidden_state_layer_ids"), source,
                        OUTPUT_IDS_KEY)
    entering = layer_ids(cfg.get("eagle_aux_hidden_state_layer_ids"), source,
                         "eagle_aux_hidden_state_layer_ids")
    from_outputs = None if outputs is None else tuple(i + 1 for i in outputs)
    if from_outputs is not None and entering is not None and from_outputs != entering:
        raise ConfigError(f"{source}: {OUTPUT_IDS_KEY} {list(outputs)} (layer outputs) and "
                          f"eagle_aux_hidden_state_layer_ids {list(entering)} (layer inputs) "
                          f"name different target layers")
    if from_outputs is not None:
        return from_outputs, f"{OUTPUT_IDS_KEY} {list(outputs)} (layer outputs)"
    if entering is not None:
        return entering, "eagle_aux_hidden_state_layer_ids"
    return default_tap_layers(target.num_layers), "the default (2, L//2, L-3)"


def read_reference(path: Path, target: ModelConfig, weights: "HFWeights | None" = None
                   ) -> ReadResult:
    """(config, float32 params, int32 d2t) of a reference/SpecForge EAGLE-3 head directory."""
    cfg, source = read_head_config(path)
    decoder = parse_decoder({**cfg, "num_hidden_layers": 1}, source,
                            rope_theta=10000.0, max_position_embeddings=2048)
    taps, tap_key = _taps(cfg, target, source)
    weights = open_weights(path, weights)
    config = eagle3_config(cfg, source, decoder, taps, weights, norm_before_residual=False,
                           mask_token_id=mask_token_id(cfg, source)[0])
    return read_eagle3_weights(config, weights, path, target, source, tap_key,
                               REFERENCE_FIRST)


def export_reference(draft: "Draft", path: str | Path) -> Path:
    """Write `draft` in the EAGLE-3 reference layout (config.json + model.safetensors with d2t
    int64 and t2d bool), readable by SafeAILab/EAGLE, SpecForge and SGLang.

    Non-default tap layers are written as SpecForge-style OUTPUT ids under `eagle_config`
    (SGLang adds one); default taps are left implicit. Refuses heads this layout cannot hold.
    """
    c = draft.config
    if c.kind == "dflash":
        raise ConfigError(f"cannot export {draft.source} in the EAGLE-3 reference layout: it is "
                          f"a DFlash drafter, which that layout cannot hold; use export_dflash "
                          f"(the z-lab layout) or export_speculators")
    why = None
    if c.kind != "eagle3":
        why = f"it is an {c.kind} head (the layout holds EAGLE-3 heads only)"
    elif c.decoder.num_layers != 1:
        why = f"it has {c.decoder.num_layers} decoder layers (the layout holds one: midlayer)"
    elif c.input_norm or c.norm_before_residual:
        why = "it uses norm_before_fc / norm_before_residual, which reference readers ignore"
    elif c.decoder.attention_bias or c.decoder.qk_norm:
        why = "its layer has q/k/v biases or q/k norms, which the reference midlayer lacks"
    default = default_tap_layers(draft.target.config.num_layers)
    if why is None and c.tap_layers != default and 0 in c.tap_layers:
        why = "it taps the embeddings (entering layer 0), which has no output-layer id"
    if why is not None:
        raise ConfigError(f"cannot export {draft.source} in the EAGLE-3 reference layout: {why}; "
                          f"use export_speculators (or the eaglejax format)")
    out, params = write_eagle3_weights(draft, path, REFERENCE_FIRST)
    config = consumer_layer_config(c.decoder, dtype_name(params))
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                  draft_vocab_size=c.draft_vocab_size, target_hidden_size=c.target_hidden_size)
    if c.fc_norm:
        config["fc_norm"] = True
    if c.parallel:
        config["mask_token_id"] = c.mask_token_id
    if c.tap_layers != default:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids":
                                  [i - 1 for i in c.tap_layers], "use_aux_hidden_state": True}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
