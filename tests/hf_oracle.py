"""Random small Hugging Face models (the PyTorch parity oracle), saved as real checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=512)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, max_position_embeddings=512,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
}


def make_hf_model(family: str, directory: Path, seed: int = 0, **overrides):
    """Build a random transformers model of `family`, save it to `directory`, return it."""
    import torch
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # random norms and biases so every weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def hf_logits(model, token_ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(token_ids), dtype=torch.long)).logits.float().numpy()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
