"""Read a llama.cpp GGUF file into a Hugging Face style config, float32 tensors and a tokenizer.

Supported GGUF architectures: ``llama`` (Llama 2/3, Mistral, SmolLM2 are all written as
``llama``), ``qwen2`` (q/k/v biases) and ``qwen3`` (q/k RMS norms). Tensors are returned under
Hugging Face names in Hugging Face shapes (``Linear.weight`` is ``[out, in]``).

llama.cpp's converter permutes the q/k rows of ``llama`` models (``LlamaModel.permute``, from
HF's rotate-half RoPE layout to its interleaved one); this is undone here. Its Qwen2/Qwen3
converters do not permute, and neither does transformers' GGUF loader for them.
"""

from __future__ import annotations

import math
import os
import pathlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from eaglejax.errors import LoadError
from eaglejax.models.gguf_blocks import KINDS, HostBlocks
from eaglejax.tokenizer import Tokenizer

_ARCHS: dict[str, tuple[str, str]] = {
    # GGUF architecture -> (HF model_type, HF architectures[0])
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
_PERMUTED_QK = {"llama"}

# GGUF per-layer tensor -> HF per-layer tensor (both without the layer prefix).
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_REQUIRED_LAYER = [
    "attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
    "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
]
_REQUIRED_EXTRA = {
    "qwen2": ["attn_q.bias", "attn_k.bias", "attn_v.bias"],
    "qwen3": ["attn_q_norm.weight", "attn_k_norm.weight"],
}


@dataclass
class GGUFModel:
    """A GGUF model converted to Hugging Face conventions."""

    path: pathlib.Path
    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tokenizer: Tokenizer
    metadata: dict[str, Any]  # decoded GGUF metadata (tokenizer arrays included)
    blocks: dict[str, HostBlocks] = dataclasses.field(default_factory=dict)  # kept as stored


# ------------------------------------------------------------------------------ metadata


def _decode_field(field: Any) -> Any:
    """A GGUF ReaderField as a plain Python value (str, int, float, bool or list)."""
    from gguf import GGUFValueType

    types = list(field.types)
    if not types:
        return None

    def scalar(part: Any, vtype: Any) -> Any:
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        if vtype == GGUFValueType.BOOL:
            return bool(value)
        if vtype == GGUFValueType.FLOAT32:  # shortest decimal of the float32: 1e-05, not 9.99e-06
            return float(str(np.float32(value)))
        return value

    if types[0] == GGUFValueType.ARRAY:
        if len(types) < 2:
            return []
        sub = types[-1]
        if sub == GGUFValueType.ARRAY:  # nested arrays: not used by the keys we read
            return None
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return []
        values = np.concatenate([field.parts[i] for i in field.data]).tolist()
        return [bool(v) for v in values] if sub == GGUFValueType.BOOL else values
    return scalar(field.parts[field.data[0]], types[0])


def _open_reader(path: pathlib.Path) -> Any:
    from gguf import GGUFReader

    if not path.exists():
        raise LoadError(f"{path}: GGUF file not found")
    if not path.is_file():
        raise LoadError(f"{path}: not a file")
    size = path.stat().st_size
    if size < 24:
        raise LoadError(f"{path}: not a GGUF file (only {size} bytes)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise LoadError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError, IndexError, KeyError, ... on bad files
        raise LoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise LoadError(
                f"{path}: truncated GGUF file: tensor {t.name!r} needs bytes up to {end}, "
                f"file has {size}"
            )
    return reader


def _metadata(reader: Any, path: pathlib.Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = _decode_field(field)
        except (UnicodeDecodeError, IndexError, ValueError) as e:
            raise LoadError(f"{path}: corrupt metadata value for key {key!r}: {e}") from e
    return out


def _need(meta: dict[str, Any], key: str, path: pathlib.Path, kind: type | tuple = int) -> Any:
    if key not in meta:
        raise LoadError(f"{path}: missing required metadata key {key!r}")
    value = meta[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise LoadError(f"{path}: metadata key {key!r} has unexpected value {value!r}")
    return value


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The decoded metadata of a GGUF file (no tensors are read). Raises LoadError."""
    path = pathlib.Path(path)
    return _metadata(_open_reader(path), path)


# ------------------------------------------------------------------------------ config


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int, path: pathlib.Path
                         ) -> dict[str, Any] | None:
    """Recover HF ``rope_scaling`` (rope_type llama3) from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores per-frequency divisors: 1 for short wavelengths, ``factor`` for long ones,
    ``1 / ((1 - s) / factor + s)`` in between with ``s = (orig / wavelen - low) / (high - low)``.
    Only ``orig / (high - low)`` and ``low / (high - low)`` are identifiable; Llama 3.x all
    use ``low_freq_factor = 1``, which fixes the rest. The result is checked against the tensor.
    """
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.size != head_dim // 2:
        raise LoadError(f"{path}: tensor 'rope_freqs.weight' has {f.size} entries, expected "
                        f"head_dim/2 = {head_dim // 2}")
    if np.allclose(f, 1.0):
        return None
    factor = float(f.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    mid = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    if mid.sum() < 2 or factor <= 1:
        raise LoadError(f"{path}: tensor 'rope_freqs.weight' is not a llama3-style RoPE scaling "
                        "(cannot recover rope_scaling)")
    smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)  # = a / wavelen - b
    a, neg_b = np.polyfit(1 / wavelen[mid], smooth, 1)
    b = -neg_b
    if not (np.isfinite(a) and np.isfinite(b) and a > 0 and b > 0):
        raise LoadError(f"{path}: tensor 'rope_freqs.weight' does not match llama3 RoPE scaling "
                        "(cannot recover rope_scaling)")
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": 1.0,
        "high_freq_factor": round(float(1 + 1 / b), 3),
        "original_max_position_embeddings": int(round(float(a / b))),
    }
    rebuilt = _llama3_factors(inv_freq, scaling)
    if not np.allclose(rebuilt, f, rtol=2e-3, atol=2e-3):
        raise LoadError(f"{path}: tensor 'rope_freqs.weight' does not match llama3 RoPE scaling "
                        "(cannot recover rope_scaling)")
    return scaling


def _llama3_factors(inv_freq: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    """llama.cpp's rope_freqs divisors for HF llama3 ``rope_scaling`` ``s``."""
    orig, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"],
                               s["high_freq_factor"], s["factor"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    out = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < orig / high, 1.0, out)
    return np.where(wavelen > orig / low, factor, out)


def _rope_scaling(meta: dict[str, Any], arch: str, path: pathlib.Path) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None or kind == "none":
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if not isinstance(factor, (int, float)):
        raise LoadError(f"{path}: rope scaling {kind!r} without {arch}.rope.scaling.factor")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if isinstance(orig, int):
            scaling["original_max_position_embeddings"] = orig
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                 ("attn_factor", "attention_factor")):
            value = meta.get(f"{arch}.rope.scaling.{gguf_key}")
            if isinstance(value, (int, float)):
                scaling[hf_key] = float(value)
        return scaling
    raise LoadError(f"{path}: unsupported rope scaling type {kind!r} ({arch}.rope.scaling.type)")


def _build_config(meta: dict[str, Any], arch: str, names: set[str], path: pathlib.Path
                  ) -> dict[str, Any]:
    model_type, hf_arch = _ARCHS[arch]
    hidden = _need(meta, f"{arch}.embedding_length", path)
    layers = _need(meta, f"{arch}.block_count", path)
    heads = _need(meta, f"{arch}.attention.head_count", path)
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts: only uniform ones are supported
        if len(set(kv_heads)) != 1:
            raise LoadError(f"{path}: per-layer {arch}.attention.head_count_kv {kv_heads} is not supported")
        kv_heads = kv_heads[0]
    if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
        raise LoadError(f"{path}: {arch}.attention.head_count_kv = {kv_heads!r} does not divide "
                        f"head_count {heads}")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    value_dim = meta.get(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise LoadError(f"{path}: {arch}.attention.value_length {value_dim} != key_length "
                        f"{head_dim} is not supported")
    rope_dim = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise LoadError(f"{path}: partial rotary embedding ({arch}.rope.dimension_count = "
                        f"{rope_dim}, head_dim {head_dim}) is not supported")
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise LoadError(f"{path}: no {arch}.vocab_size and no tokenizer.ggml.tokens")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _need(meta, f"{arch}.feed_forward_length", path),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_need(meta, f"{arch}.attention.layer_norm_rms_epsilon", path,
                                    (int, float))),
        "rope_theta": theta,
        "max_position_embeddings": _need(meta, f"{arch}.context_length", path),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if model_type in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if model_type == "llama":
        config["mlp_bias"] = False
    scaling = _rope_scaling(meta, arch, path)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


# ------------------------------------------------------------------------------ tensors


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute`` (rows of q/k weights and biases)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(t: Any, path: pathlib.Path) -> np.ndarray:
    from gguf import GGMLQuantizationType, dequantize

    try:
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                             GGMLQuantizationType.F64):
            out = np.asarray(t.data).astype(np.float32)  # copies off the memory map
        else:
            out = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise LoadError(f"{path}: tensor {t.name!r} has unsupported quantization type "
                        f"{t.tensor_type.name}") from e
    except Exception as e:
        raise LoadError(f"{path}: cannot dequantize tensor {t.name!r} ({t.tensor_type.name}): {e}"
                        ) from e
    shape = tuple(reversed([int(d) for d in t.shape]))  # GGUF lists dims fastest-first
    out = np.ascontiguousarray(out, dtype=np.float32)
    if out.size != math.prod(shape):
        raise LoadError(f"{path}: tensor {t.name!r} dequantized to {out.size} values, "
                        f"shape {shape} needs {math.prod(shape)}")
    return out.reshape(shape)


def _blocks(t: Any, shape: tuple[int, ...], config: dict[str, Any], arch: str,
            path: pathlib.Path) -> HostBlocks:
    """A matrix's blocks as stored (`HostBlocks`), q/k rows unpermuted as `read_gguf` does."""
    kind = KINDS[t.tensor_type.name]
    raw = np.asarray(t.data)
    if tuple(reversed([int(d) for d in t.shape])) != shape or shape[-1] % kind.per_block \
            or raw.size != math.prod(shape) // kind.per_block * kind.block_bytes:
        raise LoadError(f"{path}: tensor {t.name!r} has shape {list(t.shape)[::-1]} in "
                        f"{raw.size} bytes of {kind.name}, expected {list(shape)} from the "
                        f"metadata in blocks of {kind.per_block} weights, {kind.block_bytes} "
                        f"bytes each")
    blocks = HostBlocks.from_file(raw, kind, shape)
    heads = {".attn_q.": "num_attention_heads", ".attn_k.": "num_key_value_heads"}
    for part, key in heads.items():
        if arch in _PERMUTED_QK and part in t.name:
            blocks = blocks.map(lambda a: _unpermute(a, config[key]))
    return blocks


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _expected_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (h,),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }
    out = {f"model.layers.{n}.{k}": v for n in range(c["num_hidden_layers"])
           for k, v in per_layer.items()}
    out.update({"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
                "lm_head.weight": (c["vocab_size"], h)})
    return out


# ------------------------------------------------------------------------------ entry point


def read_gguf(path: str | os.PathLike[str], keep_blocks: bool = False) -> GGUFModel:
    """Read a GGUF model: HF config, float32 HF-named tensors and its tokenizer.
    `keep_blocks`: matrices in a block type eaglejax computes with as stored
    (`models.gguf_blocks.KINDS`: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) go to `blocks`, decoded but
    not widened.

    Raises LoadError (naming the file and the cause) for a missing, truncated or corrupt
    file, an unsupported architecture or quantization type, or missing metadata/tensors.
    """
    path = pathlib.Path(path)
    reader = _open_reader(path)
    meta = _metadata(reader, path)
    arch = _need(meta, "general.architecture", path, str)
    shards = meta.get("split.count", 1)
    if isinstance(shards, int) and shards > 1:
        raise LoadError(f"{path}: split GGUF ({shards} shards, split.count) is not supported; "
                        "merge it first with `llama-gguf-split --merge`")
    if arch not in _ARCHS:
        raise LoadError(f"{path}: unsupported GGUF architecture {arch!r} "
                        f"(supported: {', '.join(sorted(_ARCHS))})")
    by_name = {t.name: t for t in reader.tensors}
    config = _build_config(meta, arch, set(by_name), path)

    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in by_name]
    for layer in range(config["num_hidden_layers"]):
        for suffix in _REQUIRED_LAYER + _REQUIRED_EXTRA.get(arch, []):
            if f"blk.{layer}.{suffix}" not in by_name:
                missing.append(f"blk.{layer}.{suffix}")
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise LoadError(f"{path}: missing tensor(s) {', '.join(missing[:5])}{more}")
    unknown = [n for n in by_name if n != "rope_freqs.weight" and _hf_name(n) is None]
    if unknown:
        raise LoadError(f"{path}: unexpected tensor(s) for architecture {arch!r}: "
                        f"{', '.join(sorted(unknown)[:5])}")
    if "rope_freqs.weight" in by_name:
        if "rope_scaling" in config:
            raise LoadError(f"{path}: both rope_freqs.weight and {arch}.rope.scaling.* are present")
        scaling = _llama3_rope_scaling(_dequantize(by_name["rope_freqs.weight"], path),
                                       config["rope_theta"], config["head_dim"], path)
        if scaling is not None:
            config["rope_scaling"] = scaling

    shapes = _expected_shapes(config)
    tensors: dict[str, np.ndarray] = {}
    blocks: dict[str, HostBlocks] = {}
    for t in reader.tensors:  # one at a time: peak memory is the output plus one tensor
        hf = _hf_name(t.name)
        if hf is None:
            continue
        if keep_blocks and t.tensor_type.name in KINDS and len(shapes[hf]) == 2:
            blocks[hf] = _blocks(t, shapes[hf], config, arch, path)
            continue
        w = _dequantize(t, path)
        if w.shape != shapes[hf]:
            raise LoadError(f"{path}: tensor {t.name!r} has shape {list(w.shape)} (HF {hf}), "
                            f"expected {list(shapes[hf])} from the metadata")
        if arch in _PERMUTED_QK:
            if ".attn_q." in t.name:
                w = _unpermute(w, config["num_attention_heads"])
            elif ".attn_k." in t.name:
                w = _unpermute(w, config["num_key_value_heads"])
        tensors[hf] = w
    del reader

    tokenizer = Tokenizer.from_gguf_metadata(meta, source=str(path))
    return GGUFModel(path=path, config=config, tensors=tensors, tokenizer=tokenizer, metadata=meta,
                     blocks=blocks)
