"""Hyper-parameters of a Llama-family decoder, read from a Hugging Face style config dict."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from eaglejax.errors import ConfigError

# model_type -> (q/k/v bias, q/k RMS norm)
_FAMILIES = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and numerics of a decoder; hashable so it can be a jit static argument."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    @property
    def kv_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that `from_hf_dict` reads back to an equal config."""
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope = {"rope_theta": self.rope_theta, "rope_type": "llama3",
                    **dataclasses.asdict(self.rope_scaling)}
        arch = {v: k for k, v in _ARCHITECTURES.items()}[self.model_type]
        return {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "sliding_window": self.sliding_window,
        }

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], source: str = "config") -> "ModelConfig":
        """Parse a Hugging Face config dict; `source` names the file in error messages."""
        model_type = cfg.get("model_type")
        if model_type not in _FAMILIES:
            archs = cfg.get("architectures") or []
            model_type = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
        if model_type is None:
            raise ConfigError(
                f"{source}: unsupported architecture (model_type={cfg.get('model_type')!r}, "
                f"architectures={cfg.get('architectures')!r}); supported model types: "
                f"{', '.join(sorted(_FAMILIES))}"
            )

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ConfigError(f"{source}: missing required key {key!r}")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        rope = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling_dict = {**legacy_scaling, **rope}
        rope_type = scaling_dict.get("rope_type", scaling_dict.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            try:
                scaling = RopeScaling(
                    factor=float(scaling_dict["factor"]),
                    low_freq_factor=float(scaling_dict["low_freq_factor"]),
                    high_freq_factor=float(scaling_dict["high_freq_factor"]),
                    original_max_position_embeddings=int(
                        scaling_dict["original_max_position_embeddings"]),
                )
            except KeyError as err:
                raise ConfigError(f"{source}: llama3 rope scaling lacks {err.args[0]!r}") from None
        elif rope_type not in ("default", None):
            raise ConfigError(f"{source}: unsupported rope_type {rope_type!r} (supported: default, llama3)")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: unsupported hidden_act {act!r} (only silu)")
        default_bias, qk_norm = _FAMILIES[model_type]
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", default_bias)) or default_bias,
            qk_norm=qk_norm,
            sliding_window=int(window) if window else None,
        )
