"""Write a loaded `Target` as a Hugging Face model directory (what transformers and vLLM load).

Layout: `config.json` (the architecture's own keys, no `quantization_config`),
`model.safetensors` or `model-0000i-of-0000n.safetensors` shards with
`model.safetensors.index.json`, `generation_config.json`, and the tokenizer's
`tokenizer.json` / `tokenizer_config.json` (chat template and special tokens) when the
target has one. Tensors carry Hugging Face names and layouts: every loader leaves the
parameters in HF's rotate-half q/k row order (the GGUF reader undoes llama.cpp's
permutation), so only eaglejax's grouped q/k/v and stacked gate/up are split back.
Files are streamed tensor by tensor, so memory stays at about one decoder layer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax import validation
from eaglejax.config import ModelConfig
from eaglejax.errors import ConfigError, InputError
from eaglejax.loading.safetensors_file import write_safetensors
from eaglejax.loading.weights import hf_layer_shapes, layer_params_to_hf
from eaglejax.target import FLOAT_DTYPES, Target

DEFAULT_SHARD_BYTES = 5 * 2**30
_METADATA = {"format": "pt"}  # what transformers' safetensors loader looks for
_LAYER = "model.layers.{i}."
_O_BIAS = "self_attn.o_proj.bias"


def _zero_o_bias(config: ModelConfig) -> bool:
    """Whether HF's class adds an o_proj bias that eaglejax lacks: Llama and Qwen3 apply
    `attention_bias` to o_proj too (a GGUF Llama may carry q/k/v biases alone); it is
    written as zeros, which is exact. Qwen2's biases are q/k/v only."""
    return config.attention_bias and config.model_type in ("llama", "qwen3")


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the exported model with its HF shape, in file order."""
    c = config
    per_layer = dict(hf_layer_shapes(c))
    if _zero_o_bias(c):
        per_layer[_O_BIAS] = (c.hidden_size,)
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        shapes.update({_LAYER.format(i=i) + name: shape for name, shape in per_layer.items()})
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def _host_tensors(target: Target, dtype: np.dtype) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in `dtype`) in `tensor_shapes` order, one layer on the host at a time."""
    c, params = target.config, target.params

    def cast(array: Any) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(jax.device_get(array)).astype(dtype, copy=False))

    yield "model.embed_tokens.weight", cast(params["embed"])
    per_layer = list(hf_layer_shapes(c)) + ([_O_BIAS] if _zero_o_bias(c) else [])
    for i, layer in enumerate(params["layers"]):
        host = layer_params_to_hf(c, {k: np.asarray(jax.device_get(v)) for k, v in layer.items()})
        if _zero_o_bias(c):
            host[_O_BIAS] = np.zeros((c.hidden_size,), dtype)
        for name in per_layer:
            yield _LAYER.format(i=i) + name, cast(host[name])
    yield "model.norm.weight", cast(params["final_norm"])
    if not c.tie_word_embeddings:
        yield "lm_head.weight", cast(params["lm_head"])


def _plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into consecutive shards of at most `max_bytes` (a tensor larger
    than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _write_weights(target: Target, out: Path, dtype: np.dtype, max_bytes: int) -> list[str]:
    """The safetensors file(s) and, when sharded, their index; returns the file names."""
    shapes = tensor_shapes(target.config)
    sizes = {name: math.prod(shape) * dtype.itemsize for name, shape in shapes.items()}
    shards = _plan_shards(sizes, max_bytes)
    tensors = _host_tensors(target, dtype)  # one stream, consumed shard by shard
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, names in zip(files, shards):
        write_safetensors(out / file, {name: (dtype, shapes[name]) for name in names}, tensors,
                          _METADATA)
    if len(shards) == 1:
        return files
    index = {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {name: file for file, names in zip(files, shards) for name in names}}
    _write_json(out / "model.safetensors.index.json", index)
    return [*files, "model.safetensors.index.json"]


def _special_ids(target: Target) -> tuple[int | None, int | None, int | None]:
    """(bos, primary eos, pad) ids: the tokenizer's, else the first stop id."""
    tok = target.tokenizer
    bos = tok.bos_token_id if tok is not None else None
    eos = tok.eos_token_id if tok is not None else None
    if eos is None and target.eos_token_ids:
        eos = target.eos_token_ids[0]
    pad = tok.pad_token_id if tok is not None else None
    return bos, eos, pad


def hf_config(target: Target, dtype: str) -> dict[str, Any]:
    """`config.json` for the target's architecture: the keys transformers' config class of
    that model type writes, RoPE both as transformers 5 `rope_parameters` and as the older
    `rope_theta` / `rope_scaling` (vLLM on transformers 4), the weights' dtype as `dtype`
    and `torch_dtype`, and Llama's and Qwen's `layer_types` where a window applies
    (eaglejax windows every layer: every layer is typed "sliding_attention")."""
    c = target.config
    if c.model_type == "mistral" and c.attention_bias:
        raise ConfigError(f"{target.source}: a Mistral model with attention biases has no "
                          f"Hugging Face architecture (MistralForCausalLM has no biases)")
    config = c.to_hf_dict()  # the architecture's own keys; completed and adjusted below
    rope = config["rope_parameters"]
    bos, eos, pad = _special_ids(target)
    config.update({
        "hidden_act": "silu",
        "rope_theta": c.rope_theta,
        "rope_scaling": ({k: v for k, v in rope.items() if k != "rope_theta"}
                         if c.rope_scaling is not None else None),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": dtype,
        "torch_dtype": dtype,
    })
    if c.model_type == "llama" and not c.sliding_window:
        del config["sliding_window"]  # LlamaConfig has none
    if c.model_type not in ("llama", "qwen3"):
        del config["attention_bias"]  # Qwen2's biases are implied, Mistral has none
    if c.model_type == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    if c.model_type == "qwen2" and c.head_dim == c.hidden_size // c.num_heads:
        del config["head_dim"]  # Qwen2Config has none; its attention derives it
    if c.model_type in ("qwen2", "qwen3"):
        config.update(use_sliding_window=c.sliding_window is not None,
                      max_window_layers=0 if c.sliding_window else c.num_layers)
    # transformers 5 reads a Mistral config with `layer_types` as Ministral: Mistral's
    # window is model-wide anyway.
    if c.model_type != "mistral" and (c.sliding_window or c.model_type != "llama"):
        kind = "sliding_attention" if c.sliding_window else "full_attention"
        config["layer_types"] = [kind] * c.num_layers
    return config


def generation_config(target: Target) -> dict[str, Any]:
    """`generation_config.json`: bos, pad and every stop id (EOS and the chat end of turn)."""
    bos, eos, pad = _special_ids(target)
    stops = list(target.eos_token_ids) or ([eos] if eos is not None else [])
    out: dict[str, Any] = {"bos_token_id": bos,
                           "eos_token_id": stops[0] if len(stops) == 1 else (stops or None)}
    if pad is not None:
        out["pad_token_id"] = pad
    return out


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_addressable(target: Target) -> None:
    spread = [leaf for leaf in jax.tree.leaves(target.params)
              if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable]
    if spread:
        raise InputError(f"{target.source}: the parameters are spread over several hosts; "
                         f"export from one process holding the whole model")


def export_hf(target: Target, path: str | Path, *, dtype: Any = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write `target` as a Hugging Face directory at `path` (new or empty: nothing is
    overwritten). `dtype`: float32, bfloat16 or float16 for every tensor (default: the
    target's compute dtype; 16-bit stored matrices are widened exactly). Weights over
    `max_shard_bytes` are split into shards with an index. Returns the directory."""
    out = validation.new_output_dir("path", path).absolute()
    if dtype is None:
        dtype = jnp.dtype(target.dtype)
    dtype = np.dtype(validation.dtype("dtype", dtype, FLOAT_DTYPES))
    max_shard_bytes = validation.integer("max_shard_bytes", max_shard_bytes, 1, 2**62)
    config = hf_config(target, dtype.name)
    _check_addressable(target)
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(target, out, dtype, max_shard_bytes)
    if target.tokenizer is not None:
        target.tokenizer.save(out)
    _write_json(out / "generation_config.json", generation_config(target))
    _write_json(out / "config.json", config)  # last: a directory without it is incomplete
    return out
