"""The shapes the device programs are built for: Llama-3.1-8B, its public EAGLE-3 head, and
Llama-3.2-1B as its draft model."""

from __future__ import annotations

import dataclasses

from eaglejax.config import ModelConfig
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.dflash import default_taps
from eaglejax.target import default_tap_layers

# meta-llama/Llama-3.1-8B-Instruct's config.json (the fields eaglejax reads)
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
}
# meta-llama/Llama-3.2-1B-Instruct's config.json: the same tokenizer as Llama-3.1-8B
LLAMA32_1B = {
    **LLAMA31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True,
}
EAGLE3_DRAFT_VOCAB = 32000  # the EAGLE-3 heads published for Llama 3.1 8B


def llama31_8b(num_layers: int = 32) -> ModelConfig:
    """Llama-3.1-8B's shapes (llama3 rope scaling, untied output head), `num_layers` deep."""
    return ModelConfig.from_hf_dict({**LLAMA31_8B, "num_hidden_layers": num_layers},
                                    source="Llama-3.1-8B")


def llama32_1b() -> ModelConfig:
    """Llama-3.2-1B's shapes (a draft model for Llama-3.1-8B: the same vocabulary)."""
    return ModelConfig.from_hf_dict(LLAMA32_1B, source="Llama-3.2-1B")


def dflash_head(target: ModelConfig, num_layers: int = 5, block_size: int = 16) -> DraftConfig:
    """A DFlash drafter's shape for `target` as its authors build them (z-lab/dflash): five
    Qwen3-style layers of the target's attention shape (q/k norms), five taps spread over
    the target's layers, blocks of 16; its embedding and output head are the target's."""
    decoder = dataclasses.replace(target, model_type="qwen3", num_layers=num_layers,
                                  tie_word_embeddings=False, attention_bias=False,
                                  qk_norm=True)
    return DraftConfig("dflash", decoder, target.vocab_size, target.hidden_size,
                       default_taps(target.num_layers, num_layers),
                       mask_token_id=target.vocab_size - 1, block_size=block_size)


def eagle3_head(target: ModelConfig, draft_vocab: int = EAGLE3_DRAFT_VOCAB,
                tap_layers: tuple[int, ...] | None = None,
                mask_token_id: int | None = None) -> DraftConfig:
    """The public EAGLE-3 head shape for a Llama-family `target` (for Llama-3.1-8B:
    yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), as `new_eagle3_draft` builds it: one decoder
    layer of the target's width, fc from the taps (default: layers 2, L/2 and L-3, or
    (0, L/2, L) for models too shallow for those), a `draft_vocab` output; with
    `mask_token_id`, the same head as a P-EAGLE head (mask slots)."""
    layers = target.num_layers
    if tap_layers is None:
        tap_layers = default_tap_layers(layers) if layers >= 5 else (0, layers // 2, layers)
    decoder = dataclasses.replace(target, model_type="llama", num_layers=1,
                                  tie_word_embeddings=False, attention_bias=False,
                                  qk_norm=False)
    return DraftConfig("eagle3", decoder, draft_vocab, target.hidden_size,
                       tuple(tap_layers), mask_token_id=mask_token_id)
