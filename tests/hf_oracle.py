"""transformers, the PyTorch parity oracle: random small Hugging Face models saved as real
checkpoints, and the default model's GGUF as transformers itself reads it (also the
`generate()` baseline of the scripts under benchmarks/). Needs the test extra."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def transformers_gguf_state(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """(transformers config, state dict of torch tensors) read by transformers' own GGUF
    loader (its dequantizer and q/k un-permutation), without `accelerate`."""
    import functools
    from unittest import mock

    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    # transformers builds gguf's name map anew for each of the ~400 modules it walks (7 s):
    # the map depends on the architecture and layer count only
    with mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        tensors = load_gguf_checkpoint(str(path), return_tensors=True,
                                       model_to_load=skeleton)["tensors"]
    return config, tensors


def transformers_model_from_gguf(path: str | Path):
    """A dense float32 transformers causal LM holding the GGUF's weights as transformers
    reads them: the parity oracle and the `generate()` baseline."""
    import torch
    from transformers import AutoModelForCausalLM

    config, tensors = transformers_gguf_state(path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    expected_missing = ["lm_head.weight"] if config.tie_word_embeddings else []
    if result.missing_keys != expected_missing or result.unexpected_keys:
        raise RuntimeError(f"{path}: transformers state dict mismatch: {result}")
    model.tie_weights()
    return model.eval()
