"""Helpers shared by the draft-head readers and writers: config parsing, tensor checks,
vocabulary maps, validation against the target."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import jax
import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.head import param_shapes
from eaglejax.errors import ConfigError, EaglejaxError, LoadError
from eaglejax.loading.hf_dir import HFWeights, read_json
from eaglejax.loading.weights import check_tensor_shapes
from eaglejax.models.llama import Params

if TYPE_CHECKING:
    from eaglejax.target import Target

Shapes = dict[str, tuple[int, ...]]
ReadResult = tuple[DraftConfig, Params, np.ndarray]

# Architecture names that draft-head configs use for what is a Llama decoder.
_LLAMA_ALIASES = ("LlamaForCausalLMEagle3", "LlamaForCausalLMEagle", "Eagle3Speculator",
                  "Eagle3LlamaForCausalLM", "EagleLlamaForCausalLM")


def parse_decoder(cfg: Mapping[str, Any], source: str, attention_bias: bool | None = None,
                  **defaults: Any) -> ModelConfig:
    """A head's decoder config from a Llama-style dict; `defaults` fill keys it lacks and
    `attention_bias`, when given, overrides the family's q/k/v bias."""
    cfg = {**defaults, **{k: v for k, v in cfg.items() if v is not None}}
    archs = cfg.get("architectures") or []
    if not cfg.get("model_type") and any(a in _LLAMA_ALIASES for a in archs):
        cfg["model_type"] = "llama"
    config = ModelConfig.from_hf_dict(cfg, source)
    if attention_bias is not None:
        config = dataclasses.replace(config, attention_bias=attention_bias)
    # Qwen2 is Llama plus q/k/v biases; without them, call it Llama so that the config
    # round-trips through to_hf_dict/from_hf_dict (which force Qwen2's biases on).
    if config.model_type == "qwen2" and not config.attention_bias:
        config = dataclasses.replace(config, model_type="llama")
    return config


def flag(cfg: Mapping[str, Any], key: str, default: bool | None, source: str) -> bool | None:
    """A boolean config entry (`default` when absent or null), refusing non-booleans."""
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key!r} must be true or false, got {value!r}")
    return value


def layer_ids(value: Any, source: str, key: str) -> tuple[int, ...] | None:
    """A list of layer ids from a config entry (None when absent)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ConfigError(f"{source}: {key!r} must be a non-empty list of integers, got {value!r}")
    return tuple(value)


# Where P-EAGLE heads name their mask token, in the order vLLM looks (first match wins).
MASK_TOKEN_KEYS = ("mask_token_id", "ptd_token_id", "pard_token", "dspark_noise_token_id",
                   "dflash_config.mask_token_id")


def mask_token_id(cfg: Mapping[str, Any], source: str) -> tuple[int | None, str | None]:
    """A P-EAGLE head's mask token id and the key that gave it, or (None, None)."""
    for key in MASK_TOKEN_KEYS:
        section, _, name = key.rpartition(".")
        holder = cfg.get(section) if section else cfg
        value = holder.get(name) if isinstance(holder, Mapping) else None
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{source}: {key!r} must be a non-negative token id, "
                              f"got {value!r}")
        return value, key
    return None, None


def read_head_config(path: Path) -> tuple[dict[str, Any], str]:
    """A head directory's config.json and its path as the source errors name; refused when
    it asks for what no eaglejax head does (`refuse_unsupported`)."""
    config_path = path / "config.json"
    source = str(config_path)
    cfg = read_json(config_path)
    refuse_unsupported(cfg, source)
    return cfg, source


def refuse_unsupported(cfg: Mapping[str, Any], source: str) -> None:
    """Refuse config flags eaglejax's head does not implement (rather than ignore them)."""
    if cfg.get("norm_output"):
        raise ConfigError(f"{source}: 'norm_output: true' is not supported by eaglejax")


def check_tensors(shapes: Mapping[str, tuple[int, ...]], expected: Shapes, source: str) -> None:
    """LoadError naming the first unexpected, missing or mis-shaped tensor."""
    check_tensor_shapes(shapes, expected, source, "this head's config")


def d2t_from_tensors(d2t: np.ndarray | None, draft_vocab: int, vocab: int,
                     source: str) -> np.ndarray:
    """The draft->target offsets as int32 [DV], refusing a map that cannot be right."""
    if draft_vocab > vocab:
        raise ConfigError(f"{source}: draft_vocab_size {draft_vocab} exceeds the vocabulary "
                          f"size {vocab}")
    if d2t is None:
        if draft_vocab < vocab:
            raise LoadError(f"{source}: draft_vocab_size {draft_vocab} < vocab_size {vocab} but "
                            f"the head has no 'd2t' tensor: its draft tokens cannot be mapped to "
                            f"target tokens")
        return np.zeros((draft_vocab,), np.int32)
    d2t = np.asarray(d2t)
    if d2t.shape != (draft_vocab,) or not np.issubdtype(d2t.dtype, np.integer):
        raise LoadError(f"{source}: 'd2t' must be an integer tensor of shape ({draft_vocab},), "
                        f"got {d2t.dtype}{list(d2t.shape)}")
    if draft_vocab < vocab and not d2t.any():
        raise LoadError(f"{source}: draft_vocab_size {draft_vocab} < vocab_size {vocab} but "
                        f"'d2t' is all zeros (an untrained placeholder): the draft tokens would "
                        f"map to the first {draft_vocab} target ids")
    ids = np.arange(draft_vocab, dtype=np.int64) + d2t.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise LoadError(f"{source}: 'd2t' maps draft ids to target ids in [{ids.min()}, "
                        f"{ids.max()}], outside [0, {vocab})")
    if np.unique(ids).size != ids.size:
        raise LoadError(f"{source}: 'd2t' maps several draft ids to the same target id")
    return d2t.astype(np.int32)


def vocab_map_tensors(d2t: np.ndarray, vocab: int) -> dict[str, np.ndarray]:
    """The vocabulary maps as the EAGLE-3 and DFlash layouts store them: 'd2t' int64 [DV]
    and 't2d', the bool [V] mask of target tokens in the draft vocabulary."""
    d2t = np.asarray(d2t).astype(np.int64)
    t2d = np.zeros((vocab,), bool)
    t2d[np.arange(d2t.size) + d2t] = True
    return {"d2t": d2t, "t2d": t2d}


def with_vocab_maps(shapes: Mapping[str, tuple[int, ...]], expected: Shapes) -> Shapes:
    """`expected` plus d2t/t2d when the file has them (their contents are checked apart)."""
    return {**expected, **{k: tuple(shapes[k]) for k in ("d2t", "t2d") if k in shapes}}


def check_t2d(t2d_shape: tuple[int, ...] | None, vocab: int, source: str) -> None:
    if t2d_shape is not None and tuple(t2d_shape) != (vocab,):
        raise LoadError(f"{source}: tensor 't2d' has shape {tuple(t2d_shape)}, expected ({vocab},)")


def validate_config(config: DraftConfig, target: ModelConfig, source: str,
                    tap_key: str = "tap_layers") -> None:
    """Check a head's config against its target (vocabulary, widths, tap layers)."""
    if config.decoder.vocab_size != target.vocab_size:
        raise ConfigError(f"{source}: vocab_size {config.decoder.vocab_size} does not match the "
                          f"target's vocabulary size {target.vocab_size}")
    if config.target_hidden_size != target.hidden_size:
        raise ConfigError(f"{source}: target_hidden_size {config.target_hidden_size} does not "
                          f"match the target's hidden size {target.hidden_size}")
    if config.kind == "eagle1":
        if config.hidden_size != target.hidden_size:
            raise ConfigError(f"{source}: hidden_size {config.hidden_size} does not match the "
                              f"target's hidden size {target.hidden_size} (an EAGLE-1/2 head "
                              f"uses the target's lm_head)")
        if config.tap_layers:
            raise ConfigError(f"{source}: an EAGLE-1/2 head takes no tap layers")
    else:
        if not config.tap_layers:
            raise ConfigError(f"{source}: an EAGLE-3 head needs at least one tap layer")
        bad = [i for i in config.tap_layers if not 0 <= i <= target.num_layers]
        if bad:
            raise ConfigError(f"{source}: tap layers {list(config.tap_layers)} (entering-layer "
                              f"ids, from {tap_key}) are out of range for a target with "
                              f"{target.num_layers} layers (allowed 0..{target.num_layers})")
        if config.parallel and not 0 <= config.mask_token_id < target.vocab_size:
            raise ConfigError(f"{source}: mask token id {config.mask_token_id} is outside the "
                              f"target's vocabulary [0, {target.vocab_size})")
        if not config.own_embedding and config.hidden_size != target.hidden_size:
            raise LoadError(f"{source}: the head's hidden size {config.hidden_size} differs from "
                            f"the target's {target.hidden_size}, so it needs its own "
                            f"'embed_tokens.weight', which is missing")


def validate(config: DraftConfig, params: Params, d2t: np.ndarray, target: ModelConfig,
             source: str, tap_key: str = "tap_layers") -> None:
    """Check a head against its target and its own parameter contract."""
    validate_config(config, target, source, tap_key)
    d2t_from_tensors(d2t, config.draft_vocab_size, target.vocab_size, source)
    check_param_shapes(config, params, source)


def check_param_shapes(config: DraftConfig, params: Params, source: str) -> None:
    """LoadError unless `params` has exactly the tree and shapes of `param_shapes(config)`."""
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    want = jax.tree_util.tree_flatten_with_path(param_shapes(config), is_leaf=is_shape)[0]
    try:
        got = jax.tree_util.tree_flatten_with_path(params)[0]
    except Exception:  # noqa: BLE001
        raise LoadError(f"{source}: parameters are not a tree of arrays") from None
    got_map = {jax.tree_util.keystr(p): tuple(np.shape(a)) for p, a in got}
    want_map = {jax.tree_util.keystr(p): tuple(s) for p, s in want}
    for key, shape in want_map.items():
        if key not in got_map:
            raise LoadError(f"{source}: parameter {key} is missing (expected shape {shape})")
        if got_map[key] != shape:
            raise LoadError(f"{source}: parameter {key} has shape {got_map[key]}, expected {shape}")
    extra = sorted(set(got_map) - set(want_map))
    if extra:
        raise LoadError(f"{source}: unexpected parameter {extra[0]} for this head's config")


def prepare_output_dir(path: str | Path) -> Path:
    """A new or empty directory to write into; refuses to overwrite anything."""
    path = Path(path).expanduser().absolute()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise EaglejaxError(f"{path}: already exists and is not empty; refusing to overwrite")
    path.mkdir(parents=True, exist_ok=True)
    return path


def to_numpy(tree: Params) -> Params:
    """Host copies of every array in a params tree (dtype kept)."""
    return jax.tree.map(np.asarray, tree)


# Llama config entries that transformers' LlamaConfig fills in by default but that some
# consumers read with no default: vLLM builds a bare PretrainedConfig from
# `transformer_layer_config` (and reads `hidden_act`), the reference EAGLE code reads
# `pretraining_tp`, transformers' attention reads `attention_dropout`.
_LLAMA_DEFAULTS = {"hidden_act": "silu", "mlp_bias": False, "attention_dropout": 0.0,
                   "pretraining_tp": 1}


def consumer_layer_config(decoder: ModelConfig, dtype: str) -> dict[str, Any]:
    """A head decoder's config.json entries as the EAGLE-3 consumers (vLLM, speculators,
    SGLang, the reference code) read them: `to_hf_dict` plus the Llama defaults they read
    without a fallback, RoPE both as transformers 5 `rope_parameters` and as the older
    `rope_theta` / `rope_scaling`, `layer_types` when the decoder has a sliding window
    (vLLM and speculators apply a window only to layers typed "sliding_attention"), untied
    embeddings (a head's lm_head is its own) and the weights' `torch_dtype` (transformers 5
    reads it as `dtype`)."""
    out = {**decoder.to_hf_dict(), **_LLAMA_DEFAULTS, "tie_word_embeddings": False}
    scaling = dict(out["rope_parameters"])
    out["rope_theta"] = scaling.pop("rope_theta")
    out["rope_scaling"] = scaling if scaling["rope_type"] != "default" else None
    if decoder.sliding_window:
        out["layer_types"] = ["sliding_attention"] * decoder.num_layers
    out["torch_dtype"] = dtype
    return out


def speculators_section(algorithm: str, speculative_tokens: int, target: "Target"
                        ) -> dict[str, Any]:
    """The `speculators_config` entry of a speculators-layout config.json: greedy proposals
    of `speculative_tokens` tokens and the verifier (the target's source and architecture)."""
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy",
                              "speculative_tokens": speculative_tokens,
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": target.source,
                     "architectures": target.config.to_hf_dict()["architectures"]},
    }


def weights_source(path: Path) -> str:
    """The weights file of a head directory, for error messages."""
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        if (path / name).exists():
            return str(path / name)
    return str(path)


def open_weights(path: Path, weights: "HFWeights | None" = None) -> "HFWeights":
    """The head's tensors (model.safetensors, sharded safetensors or pytorch_model.bin)."""
    return weights if weights is not None else HFWeights(path)


def dtype_name(params: Params) -> str:
    """The dtype of a params tree's first leaf, as HF configs spell it (`torch_dtype`)."""
    return np.dtype(jax.tree.leaves(params)[0].dtype).name
