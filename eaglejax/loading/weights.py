"""Map Hugging Face Llama-family tensors onto eaglejax's parameter tree, checking every shape."""

from __future__ import annotations

from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.errors import LoadError
from eaglejax.models.llama import Params, param_shapes

_LAYER = "model.layers.{i}."
# eaglejax name -> (HF name, converter from the HF tensor to eaglejax's layout)
def _linear_to_heads(n: int, d: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda w: w.T.reshape(w.shape[1], n, d)


def _layer_table(c: ModelConfig) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]]:
    same = lambda w: w  # noqa: E731
    table = {
        "attn_norm": ("input_layernorm.weight", same),
        "mlp_norm": ("post_attention_layernorm.weight", same),
        "wq": ("self_attn.q_proj.weight", _linear_to_heads(c.num_heads, c.head_dim)),
        "wk": ("self_attn.k_proj.weight", _linear_to_heads(c.num_kv_heads, c.head_dim)),
        "wv": ("self_attn.v_proj.weight", _linear_to_heads(c.num_kv_heads, c.head_dim)),
        "wo": ("self_attn.o_proj.weight", lambda w: w.T.reshape(c.num_heads, c.head_dim, -1)),
        "w_gate": ("mlp.gate_proj.weight", np.transpose),
        "w_up": ("mlp.up_proj.weight", np.transpose),
        "w_down": ("mlp.down_proj.weight", np.transpose),
    }
    if c.attention_bias:
        table["bq"] = ("self_attn.q_proj.bias", lambda b: b.reshape(c.num_heads, c.head_dim))
        table["bk"] = ("self_attn.k_proj.bias", lambda b: b.reshape(c.num_kv_heads, c.head_dim))
        table["bv"] = ("self_attn.v_proj.bias", lambda b: b.reshape(c.num_kv_heads, c.head_dim))
    if c.qk_norm:
        table["q_norm"] = ("self_attn.q_norm.weight", same)
        table["k_norm"] = ("self_attn.k_norm.weight", same)
    return table


def hf_expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config implies, with its PyTorch shape."""
    c = config
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = {
        "input_layernorm.weight": (c.hidden_size,),
        "post_attention_layernorm.weight": (c.hidden_size,),
        "self_attn.q_proj.weight": (q_out, c.hidden_size),
        "self_attn.k_proj.weight": (kv_out, c.hidden_size),
        "self_attn.v_proj.weight": (kv_out, c.hidden_size),
        "self_attn.o_proj.weight": (c.hidden_size, q_out),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
    }
    if c.attention_bias:
        per_layer.update({"self_attn.q_proj.bias": (q_out,), "self_attn.k_proj.bias": (kv_out,),
                          "self_attn.v_proj.bias": (kv_out,)})
    if c.qk_norm:
        per_layer.update({"self_attn.q_norm.weight": (c.head_dim,),
                          "self_attn.k_norm.weight": (c.head_dim,)})
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        shapes.update({_LAYER.format(i=i) + k: s for k, s in per_layer.items()})
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
    table = _layer_table(config)
    layers = {}
    for key, (hf_name, convert) in table.items():
        stacked = np.stack([convert(np.asarray(get(_LAYER.format(i=i) + hf_name), np.float32))
                            for i in range(config.num_layers)])
        layers[key] = to_dtype(stacked)
    params: Params = {"embed": to_dtype(get("model.embed_tokens.weight")),
                      "layers": layers,
                      "final_norm": to_dtype(get("model.norm.weight"))}
    if not config.tie_word_embeddings:
        params["lm_head"] = to_dtype(np.asarray(get("lm_head.weight"), np.float32).T)
    _check_tree_shapes(params, config)
    return params


def _check_tree_shapes(params: Params, config: ModelConfig) -> None:
    expected = param_shapes(config)
    for key, shape in expected["layers"].items():
        assert params["layers"][key].shape == shape, (key, params["layers"][key].shape, shape)
