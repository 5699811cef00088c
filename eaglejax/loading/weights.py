"""Map Hugging Face Llama-family tensors onto eaglejax's parameter tree, checking every shape."""

from __future__ import annotations

from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.errors import LoadError
from eaglejax.models.llama import Params, param_shapes

_LAYER = "model.layers.{i}."
_SAME = lambda w: w  # noqa: E731

# eaglejax layer key -> (HF tensor name, converter from PyTorch [out,in] to eaglejax [in,out])
_LAYER_TABLE = {
    "attn_norm": ("input_layernorm.weight", _SAME),
    "mlp_norm": ("post_attention_layernorm.weight", _SAME),
    "wq": ("self_attn.q_proj.weight", np.transpose),
    "wk": ("self_attn.k_proj.weight", np.transpose),
    "wv": ("self_attn.v_proj.weight", np.transpose),
    "wo": ("self_attn.o_proj.weight", np.transpose),
    "w_gate": ("mlp.gate_proj.weight", np.transpose),
    "w_up": ("mlp.up_proj.weight", np.transpose),
    "w_down": ("mlp.down_proj.weight", np.transpose),
    "bq": ("self_attn.q_proj.bias", _SAME),
    "bk": ("self_attn.k_proj.bias", _SAME),
    "bv": ("self_attn.v_proj.bias", _SAME),
    "q_norm": ("self_attn.q_norm.weight", _SAME),
    "k_norm": ("self_attn.k_norm.weight", _SAME),
}


def hf_expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config implies, with its PyTorch shape."""
    c = config
    layer_shapes = param_shapes(config)["layers"][0]
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        for key, shape in layer_shapes.items():
            hf_name, convert = _LAYER_TABLE[key]
            shapes[_LAYER.format(i=i) + hf_name] = shape[::-1] if convert is np.transpose else shape
    return shapes


def check_hf_tensors(names_and_shapes: Mapping[str, tuple[int, ...]], config: ModelConfig,
                     source: str) -> None:
    """Raise LoadError naming the first missing, unexpected or mis-shaped tensor."""
    expected = hf_expected_shapes(config)
    ignorable = ("rotary_emb.inv_freq",)
    unexpected = [n for n in names_and_shapes if n not in expected and not n.endswith(ignorable)]
    # A tied model may still ship a copy of the embedding as lm_head.weight.
    if config.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")
    if unexpected:
        raise LoadError(f"{source}: unexpected tensor {unexpected[0]!r} for a "
                        f"{config.model_type} model of this config ({len(unexpected)} unexpected)")
    for name, shape in expected.items():
        if name not in names_and_shapes:
            raise LoadError(f"{source}: missing tensor {name!r} (expected shape {shape})")
        if tuple(names_and_shapes[name]) != shape:
            raise LoadError(f"{source}: tensor {name!r} has shape {tuple(names_and_shapes[name])}, "
                            f"but the config implies {shape}")


def params_from_hf(get: Callable[[str], np.ndarray], names_and_shapes: Mapping[str, tuple[int, ...]],
                   config: ModelConfig, source: str, dtype: jnp.dtype) -> Params:
    """Build the parameter tree from HF tensors fetched one by one with `get(name)`."""
    check_hf_tensors(names_and_shapes, config, source)
    to_dtype = lambda a: jnp.asarray(np.asarray(a, dtype=np.float32), dtype=dtype)  # noqa: E731
    keys = param_shapes(config)["layers"][0]
    layers = [{key: to_dtype(_LAYER_TABLE[key][1](np.asarray(
                   get(_LAYER.format(i=i) + _LAYER_TABLE[key][0]), np.float32)))
               for key in keys}
              for i in range(config.num_layers)]
    params: Params = {"embed": to_dtype(get("model.embed_tokens.weight")),
                      "layers": layers,
                      "final_norm": to_dtype(get("model.norm.weight"))}
    if not config.tie_word_embeddings:
        params["lm_head"] = to_dtype(np.asarray(get("lm_head.weight"), np.float32).T)
    return params
