"""Draft heads for speculative-decoding tests: random EAGLE-3 heads and a self-draft."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from eaglejax.draft.config import DraftConfig
from eaglejax.draft.draft import Draft, new_eagle3_draft
from eaglejax.target import Target


def random_eagle3(target: Target, seed: int = 0, draft_vocab: int | None = None,
                  num_layers: int = 1, scale: float = 0.05) -> Draft:
    """A random EAGLE-3 head for `target`; DV < V gets a random sorted draft vocabulary."""
    vocab = target.config.vocab_size
    used = None
    if draft_vocab:
        used = np.sort(np.random.RandomState(seed).choice(vocab, draft_vocab, replace=False))
    return new_eagle3_draft(target, used_tokens=used, num_layers=num_layers, seed=seed,
                            scale=scale)


def self_draft(target: Target) -> Draft:
    """An EAGLE-1 head made of the target's own layers: `fc` passes the token embedding
    through, so the head re-runs the target one position behind. With the target's first
    attention norm and final norm at 1 and unit-RMS embeddings (see `selfdraftable`) it
    proposes what the target would say, except for attention to the first token."""
    c = target.config
    config = DraftConfig("eagle1", c, c.vocab_size, c.hidden_size, ())
    layers = [dict(layer) for layer in target.params["layers"]]
    del layers[0]["attn_norm"]
    fc = jnp.concatenate([jnp.eye(c.hidden_size), jnp.zeros((c.hidden_size, c.hidden_size))], 1)
    params = {"fc": fc.astype(target.dtype), "layers": layers}
    return Draft(config, params, jnp.zeros((c.vocab_size,), jnp.int32), target, "self-draft")


def make_selfdraftable(model) -> None:
    """Edit a transformers Llama in place so `self_draft` of it predicts well: unit-RMS
    embedding rows, first attention norm and final norm at exactly 1."""
    import torch

    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(emb / emb.pow(2).mean(-1, keepdim=True).sqrt())
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
