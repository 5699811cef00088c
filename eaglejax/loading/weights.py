"""Map Hugging Face Llama-family tensors onto eaglejax's parameter tree, checking every shape."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.errors import LoadError
from eaglejax.models.llama import Params

_LAYER = "model.layers.{i}."


def hf_layer_shapes(config: ModelConfig, in_features: int | None = None,
                    attn_norm: bool = True) -> dict[str, tuple[int, ...]]:
    """One decoder layer's HF tensor names (relative to the layer) with their PyTorch shapes.

    `in_features` overrides the q/k/v input width (EAGLE-3 heads feed their first layer 2H);
    `attn_norm=False` drops `input_layernorm` (EAGLE-1/2's first layer has none).
    """
    c = config
    width = c.hidden_size if in_features is None else in_features
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        "input_layernorm.weight": (c.hidden_size,),
        "post_attention_layernorm.weight": (c.hidden_size,),
        "self_attn.q_proj.weight": (q_out, width),
        "self_attn.k_proj.weight": (kv_out, width),
        "self_attn.v_proj.weight": (kv_out, width),
        "self_attn.o_proj.weight": (c.hidden_size, q_out),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
    }
    if not attn_norm:
        del shapes["input_layernorm.weight"]
    if c.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q_out,), "self_attn.k_proj.bias": (kv_out,),
                       "self_attn.v_proj.bias": (kv_out,)})
    if c.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (c.head_dim,),
                       "self_attn.k_norm.weight": (c.head_dim,)})
    return shapes


def hf_expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config implies, with its PyTorch shape."""
    c = config
    per_layer = hf_layer_shapes(c)
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        shapes.update({_LAYER.format(i=i) + k: s for k, s in per_layer.items()})
    return shapes


def _group_qkv(config: ModelConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """HF q/k/v (weights [out,in] or biases [out]) -> [kv_heads, kv_group + 2, head_dim, in...]."""
    c = config

    def split(w: np.ndarray, per_kv: int) -> np.ndarray:
        return w.reshape(c.num_kv_heads, per_kv, c.head_dim, *w.shape[1:])

    return np.concatenate([split(q, c.kv_group), split(k, 1), split(v, 1)], axis=1)


def _ungroup_qkv(config: ModelConfig, grouped: np.ndarray) -> tuple[np.ndarray, ...]:
    """Inverse of `_group_qkv`: [kv_heads, kv_group + 2, head_dim, in...] -> HF q, k, v."""
    c = config
    tail = grouped.shape[3:]
    q = grouped[:, :c.kv_group].reshape(c.num_heads * c.head_dim, *tail)
    k = grouped[:, c.kv_group].reshape(c.num_kv_heads * c.head_dim, *tail)
    v = grouped[:, c.kv_group + 1].reshape(c.num_kv_heads * c.head_dim, *tail)
    return q, k, v


# eaglejax matrix -> the HF tensors (within a layer) it is made of, in order
LAYER_MATRICES: dict[str, tuple[str, ...]] = {
    "wqkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "wo": ("self_attn.o_proj.weight",),
    "w_gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "w_down": ("mlp.down_proj.weight",),
}


# the axis of a fused matrix along which its HF parts lie side by side (`fused_part`)
FUSED_AXIS: dict[str, int] = {"wqkv": 1, "w_gate_up": 0}


def fused_part(config: ModelConfig, key: str, index: int, part: np.ndarray) -> np.ndarray:
    """HF part `index` of the fused matrix `key` (`LAYER_MATRICES[key]`) in the fused
    layout: its slice along `FUSED_AXIS[key]` (q [kv_heads, kv_group, head_dim, ...], k and
    v [kv_heads, 1, head_dim, ...]; gate and up [1, ...])."""
    if key == "wqkv":
        per_kv = config.kv_group if index == 0 else 1
        return part.reshape(config.num_kv_heads, per_kv, config.head_dim, *part.shape[1:])
    return part[None]


def fuse_matrix(config: ModelConfig, key: str, parts: list[np.ndarray]) -> np.ndarray:
    """The eaglejax matrix `key` from its HF parts (`LAYER_MATRICES[key]`, in order); the
    parts' last dim may be anything (rows are what is grouped)."""
    if key not in FUSED_AXIS:
        return parts[0]
    return np.concatenate([fused_part(config, key, i, part) for i, part in enumerate(parts)],
                          axis=FUSED_AXIS[key])


def layer_params_from_hf(config: ModelConfig, get: Callable[[str], np.ndarray],
                         attn_norm: bool = True,
                         skip: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """One layer's eaglejax arrays (float32) from its HF tensors (`get` takes the name within
    the layer); `attn_norm=False` for a layer without `input_layernorm`; the matrices named
    in `skip` are left out (the caller has them)."""
    f32 = lambda name: np.asarray(get(name), np.float32)  # noqa: E731
    attn = "self_attn.{}_proj.{}"
    layer = {"mlp_norm": f32("post_attention_layernorm.weight")}
    layer.update({key: fuse_matrix(config, key, [f32(name) for name in names])
                  for key, names in LAYER_MATRICES.items() if key not in skip})
    if attn_norm:
        layer = {"attn_norm": f32("input_layernorm.weight"), **layer}
    if config.attention_bias:
        layer["bqkv"] = _group_qkv(config, *(f32(attn.format(x, "bias")) for x in "qkv"))
    if config.qk_norm:
        layer["q_norm"] = f32("self_attn.q_norm.weight")
        layer["k_norm"] = f32("self_attn.k_norm.weight")
    return layer


def layer_params_to_hf(config: ModelConfig,
                       layer: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of `layer_params_from_hf`: HF tensor names (within the layer) -> arrays, in the
    params' own dtype. Keys of `layer` it does not know (e.g. EAGLE norms) are left out."""
    out: dict[str, np.ndarray] = {}
    if "attn_norm" in layer:
        out["input_layernorm.weight"] = np.asarray(layer["attn_norm"])
    for name, array in zip("qkv", _ungroup_qkv(config, np.asarray(layer["wqkv"]))):
        out[f"self_attn.{name}_proj.weight"] = array
    out["self_attn.o_proj.weight"] = np.asarray(layer["wo"])
    if config.attention_bias:
        for name, array in zip("qkv", _ungroup_qkv(config, np.asarray(layer["bqkv"]))):
            out[f"self_attn.{name}_proj.bias"] = array
    if config.qk_norm:
        out["self_attn.q_norm.weight"] = np.asarray(layer["q_norm"])
        out["self_attn.k_norm.weight"] = np.asarray(layer["k_norm"])
    gate_up = np.asarray(layer["w_gate_up"])
    out["mlp.gate_proj.weight"], out["mlp.up_proj.weight"] = gate_up[0], gate_up[1]
    out["mlp.down_proj.weight"] = np.asarray(layer["w_down"])
    out["post_attention_layernorm.weight"] = np.asarray(layer["mlp_norm"])
    return out


def check_tensor_shapes(found: Mapping[str, tuple[int, ...]],
                        expected: Mapping[str, tuple[int, ...]], source: str, what: str,
                        ignorable: tuple[str, ...] = ("rotary_emb.inv_freq",)) -> None:
    """LoadError naming the first unexpected (it would be silently ignored), missing or
    mis-shaped tensor; `what` names the model the config describes."""
    unexpected = sorted(n for n in found if n not in expected and not n.endswith(ignorable))
    if unexpected:
        raise LoadError(f"{source}: unexpected tensor {unexpected[0]!r} for {what} "
                        f"({len(unexpected)} unexpected; it would be silently ignored)")
    for name, shape in expected.items():
        if name not in found:
            raise LoadError(f"{source}: missing tensor {name!r} (expected shape {tuple(shape)})")
        if tuple(found[name]) != tuple(shape):
            raise LoadError(f"{source}: tensor {name!r} has shape {tuple(found[name])}, but the "
                            f"config implies {tuple(shape)}")


def check_hf_tensors(names_and_shapes: Mapping[str, tuple[int, ...]], config: ModelConfig,
                     source: str) -> None:
    """Raise LoadError naming the first missing, unexpected or mis-shaped tensor."""
    found = dict(names_and_shapes)
    if config.tie_word_embeddings:  # a tied model may still ship a copy as lm_head.weight
        found.pop("lm_head.weight", None)
    check_tensor_shapes(found, hf_expected_shapes(config), source,
                        f"a {config.model_type} model of this config")


Placer = Callable[[tuple, Any], Any]  # (parameter path, host array or quantized matrix) -> placed
# (eaglejax matrix key, its HF tensor names) -> the matrix kept as stored, or None
Stored = Callable[[str, tuple[str, ...]], Any]


def params_from_hf(get: Callable[[str], np.ndarray], names_and_shapes: Mapping[str, tuple[int, ...]],
                   config: ModelConfig, source: str, dtype: jnp.dtype,
                   place: Placer | None = None, stored: Stored | None = None) -> Params:
    """Build the parameter tree from HF tensors fetched one by one with `get(name)`.
    `place(path, host array in dtype)` puts each parameter where it belongs (a device
    mesh: `eaglejax.models.placement`); by default the default device. `stored(key, names)`
    may return a matrix kept as its file stores it (GGUF blocks: `place` puts it too); `get`
    is then never asked for those names."""
    check_hf_tensors(names_and_shapes, config, source)
    if place is None:
        def to_dtype(path, a):
            return jnp.asarray(np.asarray(a, dtype=np.float32), dtype=dtype)
    else:
        def to_dtype(path, a):
            return place(path, np.asarray(a, dtype=np.float32).astype(dtype))
    keep = stored or (lambda key, names: None)

    def kept_at(path: tuple, kept: Any) -> Any:
        return kept if place is None or kept is None else place(path, kept)

    def matrix(key: str, name: str) -> Any:
        kept = kept_at((key,), keep(key, (name,)))
        return to_dtype((key,), get(name)) if kept is None else kept

    layers = []
    for i in range(config.num_layers):
        prefix = _LAYER.format(i=i)
        kept = {key: kept_at(("layers", i, key), keep(key, tuple(prefix + n for n in names)))
                for key, names in LAYER_MATRICES.items()}
        kept = {key: leaf for key, leaf in kept.items() if leaf is not None}
        layer = layer_params_from_hf(config, lambda name, i=i: get(_LAYER.format(i=i) + name),
                                     skip=frozenset(kept))
        layers.append({**{key: to_dtype(("layers", i, key), value) for key, value in layer.items()},
                       **kept})
    params: Params = {"embed": matrix("embed", "model.embed_tokens.weight"),
                      "layers": layers,
                      "final_norm": to_dtype(("final_norm",), get("model.norm.weight"))}
    if not config.tie_word_embeddings:
        params["lm_head"] = matrix("lm_head", "lm_head.weight")
    return params
