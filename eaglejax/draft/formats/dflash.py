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

Layer kinds (`DraftConfig.layer_attention`, what each layer's block queries see:
`eaglejax.draft.dflash`). Both layouts type the layers as transformers' Qwen3 config does:
`layer_types` ("full_attention" or "sliding_attention" per layer; absent, layers from
`max_window_layers` (28) on are sliding when `use_sliding_window` is true) and one
`sliding_window`, which transformers' Qwen2/Qwen3 configs hold only under
`use_sliding_window: true` (a sliding layer without it is refused: the consumers would
run it unwindowed or refuse it). Causality differs. z-lab: the top-level `is_causal` for
every layer, or, when absent or null, sliding layers causal and full ones not; `layer_types`,
`sliding_window` or `is_causal` under `dflash_config` must agree with the top level, which
is what z-lab and vLLM read, and vLLM's own `dflash_config` switches (`use_swa`,
`swa_window_size`, `causal`) are refused. speculators: full layers are never causal,
sliding ones are unless `sliding_window_non_causal` (default false). vLLM turns that flag
into one causality for every layer (`not sliding_window_non_causal`, true when absent), so
it runs a drafter that mixes causal sliding layers with full ones otherwise than the
speculators trainer and eaglejax do; no layout value can change that.

DFlash2 drafters (a causal convolution in each layer, a candidate selector: configs that
size them with `conv_kernel_size` and the like) are refused, and so is any of DFlash2's
`input_embedding_scale`, `output_multiplier` or `final_logit_softcapping` set to other than
its neutral value: a DFlash reader that skipped them would draft otherwise than trained.

`export_dflash` writes the z-lab layout (block size at the top level and in `dflash_config`,
plus `num_target_layers`; it cannot hold a reduced vocabulary), `export_speculators_dflash`
the speculators one (with `speculators_config`: block_size - 1 greedy proposals and the
verifier); both write the weights above in the drafter's dtype and a complete Qwen3 layer
config, and refuse drafters whose layers are not Qwen3's (q/k norms, no biases). They
write the layer kinds back as read: `layer_types`, `sliding_window` and z-lab's `is_causal`
(only where the types' default is not what the layers do) or speculators'
`sliding_window_non_causal` (true when no layer is sliding, so that vLLM runs the drafter
non-causal as speculators does); kinds a layout cannot say (layers of two windows, a causal
full layer in the speculators layout, ...) are refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, NoReturn

import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.draft.config import DraftConfig, LayerAttention
from eaglejax.draft.formats.common import (
    ReadResult, check_t2d, check_tensors, consumer_layer_config, d2t_from_tensors, dtype_name,
    flag, layer_ids, open_weights, parse_decoder, prepare_output_dir, read_head_config,
    speculators_section, to_numpy, validate, vocab_map_tensors, weights_source,
    with_vocab_maps)
from eaglejax.errors import ConfigError
from eaglejax.loading.safetensors_file import save_safetensors
from eaglejax.loading.weights import hf_layer_shapes, layer_params_from_hf, layer_params_to_hf

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft
    from eaglejax.loading.hf_dir import HFWeights

IGNORED = ("embed_tokens.weight", "d2t", "t2d")  # a reduced vocabulary's d2t/t2d are read
SLIDING, FULL = "sliding_attention", "full_attention"
MAX_WINDOW_LAYERS = 28  # transformers' Qwen3Config default
VLLM_SWITCHES = ("use_swa", "swa_window_size", "causal")  # under dflash_config
# DFlash2 (a causal convolution in each layer and a candidate selector) sizes its modules
# with these; its scalars change the drafts where not neutral (vLLM's DFlash2 reader).
DFLASH2_MODULES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_SCALARS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
                   "final_logit_softcapping": None}


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


def _refuse_dflash2(cfg: Mapping[str, Any], source: str) -> None:
    """ConfigError where the config (top level or `dflash_config`) describes what only a
    DFlash2 drafter runs: read as DFlash, its drafts would silently differ."""
    section = cfg.get("dflash_config")
    for where, entries in (("", cfg), ("dflash_config.", section if isinstance(section, dict)
                                       else {})):
        for key in DFLASH2_MODULES:
            if key in entries:
                raise ConfigError(f"{source}: {where + key!r} belongs to a DFlash2 drafter (a "
                                  f"causal convolution per layer and a candidate selector), "
                                  f"which eaglejax does not run")
        for key, neutral in DFLASH2_SCALARS.items():
            if entries.get(key, neutral) != neutral:
                raise ConfigError(f"{source}: {where + key!r} is {entries[key]!r}; eaglejax's "
                                  f"DFlash drafter does not apply it (only {neutral!r} or "
                                  f"absent reads)")


def dflash_config(cfg: Mapping[str, Any], source: str, target: ModelConfig) -> DraftConfig:
    """The DraftConfig of a DFlash config.json in either layout (module docstring)."""
    _refuse_dflash2(cfg, source)
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
        kinds = _speculators_kinds(cfg, layer_cfg, decoder, source)
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
        kinds = _z_lab_kinds(cfg, section, decoder, source)
    if taps is None:
        raise ConfigError(f"{source}: the tapped target layers are missing "
                          f"('dflash_config.target_layer_ids' or 'aux_hidden_state_layer_ids')")
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < target.vocab_size:
        raise ConfigError(f"{source}: the mask token id must be a token of the target's "
                          f"vocabulary [0, {target.vocab_size}), got {mask!r}")
    return DraftConfig("dflash", decoder, draft_vocab or decoder.vocab_size, target.hidden_size,
                       taps, mask_token_id=mask, block_size=_positive(where, block_key, source),
                       layer_attention=kinds)


def _window(layer_cfg: Mapping[str, Any], decoder: ModelConfig, source: str) -> int | None:
    """The sliding window the consumers' transformers config holds (a Qwen2/Qwen3 one only
    under `use_sliding_window: true`)."""
    if not layer_cfg.get("use_sliding_window", decoder.model_type not in ("qwen2", "qwen3")):
        return None
    window = layer_cfg.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                               or window < 1):
        raise ConfigError(f"{source}: 'sliding_window' must be a positive integer or null, "
                          f"got {window!r}")
    return window


def _layer_types(layer_cfg: Mapping[str, Any], decoder: ModelConfig, window: int | None,
                 source: str) -> list[str]:
    """Each layer's type, checked, as transformers' Qwen3 config reads or derives them."""
    n = decoder.num_layers
    types = layer_cfg.get("layer_types")
    if types is None:
        if window is None or decoder.model_type not in ("qwen2", "qwen3"):
            return [FULL] * n
        first = layer_cfg.get("max_window_layers", MAX_WINDOW_LAYERS)
        if not isinstance(first, int) or isinstance(first, bool):
            raise ConfigError(f"{source}: 'max_window_layers' must be an integer, got {first!r}")
        return [SLIDING if i >= first else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"{source}: 'layer_types' must list one type for each of the "
                          f"{n} layers, got {types!r}")
    for i, kind in enumerate(types):
        if kind not in (SLIDING, FULL):
            raise ConfigError(f"{source}: 'layer_types'[{i}] is {kind!r}; a DFlash layer is "
                              f"{FULL!r} or {SLIDING!r}")
        if kind == SLIDING and window is None:
            raise ConfigError(f"{source}: layer {i} is {SLIDING!r} but the config holds no "
                              f"window ('sliding_window' a positive integer, with "
                              f"'use_sliding_window': true)")
    return types


def _z_lab_kinds(cfg: Mapping[str, Any], section: Mapping[str, Any], decoder: ModelConfig,
                 source: str) -> tuple[LayerAttention, ...]:
    """The layers' kinds of a z-lab config (module docstring)."""
    window = _window(cfg, decoder, source)
    types = _layer_types(cfg, decoder, window, source)
    causal = flag(cfg, "is_causal", None, source)
    for key, value in (("layer_types", types), ("sliding_window", window),
                       ("is_causal", causal)):
        if key in section and section[key] != value:
            raise ConfigError(f"{source}: 'dflash_config.{key}' is {section[key]!r} but the "
                              f"top level's {key!r} reads as {value!r} (z-lab and vLLM read the "
                              f"top level); give one value")
    for key in VLLM_SWITCHES:
        if section.get(key) not in (None, False):
            raise ConfigError(f"{source}: 'dflash_config.{key}' (vLLM's switch) is not read; "
                              f"type the layers with 'layer_types', 'sliding_window' and "
                              f"'is_causal'")
    return tuple(LayerAttention(window if kind == SLIDING else None,
                                kind == SLIDING if causal is None else causal)
                 for kind in types)


def _speculators_kinds(cfg: Mapping[str, Any], layer_cfg: Mapping[str, Any],
                       decoder: ModelConfig, source: str) -> tuple[LayerAttention, ...]:
    """The layers' kinds of a speculators config (module docstring)."""
    where = f"{source} (transformer_layer_config)"
    window = _window(layer_cfg, decoder, where)
    types = _layer_types(layer_cfg, decoder, window, where)
    causal = not flag(cfg, "sliding_window_non_causal", False, source)
    return tuple(LayerAttention(window, causal) if kind == SLIDING else LayerAttention()
                 for kind in types)


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
    config = {**_layer_config(draft, "z-lab DFlash"), "architectures": ["DFlashDraftModel"],
              "block_size": c.block_size, "dflash_config": dflash_section,
              "num_target_layers": draft.target.config.num_layers}
    kinds = [c.layer(i) for i in range(c.decoder.num_layers)]
    if any(k.causal != (k.window is not None) for k in kinds):  # not the types' default
        if len({k.causal for k in kinds}) > 1:
            _refuse(draft, "z-lab DFlash", "its layers' causality is neither the layer types' "
                    "default (sliding layers causal, full ones not) nor one for every layer, "
                    "which is all 'is_causal' can say")
        config["is_causal"] = kinds[0].causal
    return _write(draft, path, config)


def export_speculators_dflash(draft: "Draft", path: str | Path) -> Path:
    """Write a DFlash drafter in the speculators dflash layout (what the speculators package
    and vLLM read) to `path`, a new or empty directory; returns it."""
    c = draft.config
    _check_exportable(draft, "speculators dflash")
    layer_config = _layer_config(draft, "speculators dflash")
    kinds = [c.layer(i) for i in range(c.decoder.num_layers)]
    sliding = {k.causal for k in kinds if k.window is not None}
    if any(k.causal and k.window is None for k in kinds) or len(sliding) > 1:
        _refuse(draft, "speculators dflash", "the layout runs full-attention layers non-causal "
                "and every sliding layer with one causality ('sliding_window_non_causal'); "
                "its layers are " + ", ".join(_describe(k) for k in kinds))
    # With no sliding layer the flag is moot for speculators, and true makes vLLM (which
    # applies `not flag` to every layer) run the layers non-causal too.
    non_causal = not sliding.pop() if sliding else True
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
        "sliding_window_non_causal": non_causal,
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
        _refuse(draft, layout, why)


def _refuse(draft: "Draft", layout: str, why: str) -> NoReturn:
    raise ConfigError(f"cannot export {draft.source} in the {layout} layout: {why}")


def _describe(kind: LayerAttention) -> str:
    causal = "causal" if kind.causal else "non-causal"
    return f"{causal} full" if kind.window is None else f"{causal} sliding ({kind.window})"


def _layer_config(draft: "Draft", layout: str) -> dict[str, Any]:
    """The drafter's layers as a complete Qwen3 config.json dict (vLLM builds its layers
    from it; speculators passes it to transformers' Qwen3Config), typed as `layer_attention`
    says: a layer is sliding where it has a window, and the one `sliding_window` is theirs
    (else the decoder's, which then types no layer)."""
    c = draft.config
    d = c.decoder
    windows = {c.layer(i).window for i in range(d.num_layers)} - {None}
    if len(windows) > 1:
        _refuse(draft, layout, f"its layers have windows of {sorted(windows)} positions; the "
                f"layout holds one 'sliding_window'")
    window = windows.pop() if windows else d.sliding_window
    config = consumer_layer_config(dataclasses.replace(d, sliding_window=window),
                                   dtype_name(draft.params))
    del config["mlp_bias"], config["pretraining_tp"]  # Llama's, not Qwen3's
    types = [SLIDING if c.layer(i).window else FULL for i in range(d.num_layers)]
    config.update(use_sliding_window=window is not None,
                  max_window_layers=0 if SLIDING in types else d.num_layers, layer_types=types)
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
