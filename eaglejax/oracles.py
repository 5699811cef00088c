"""Other projects' implementations that eaglejax is checked and benchmarked against.

Needs the test extra (torch, transformers); nothing in the library imports this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def transformers_gguf_state(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """(transformers config, state dict of torch tensors) read by transformers' own GGUF
    loader (its dequantizer and q/k un-permutation), without `accelerate`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
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
