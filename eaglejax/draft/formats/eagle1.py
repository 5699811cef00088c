"""EAGLE-1/2 heads (SafeAILab/EAGLE `cnets1.py`; SGLang renames the arch LlamaForCausalLMEagle).

`fc.weight [H, 2H]` (+ `fc.bias` unless absent or `"bias": false`) over
`concat(embed(token), target final normed hidden)`, then standard `layers.{i}.*` decoder layers
whose first has no `input_layernorm` (q/k/v biases when `qkv_bias`); no final norm and no
lm_head: the target's lm_head reads the un-normed output.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.formats.common import (
    ReadResult,
    Shapes,
    check_tensors,
    flag,
    open_weights,
    parse_decoder,
    read_head_config,
    validate,
    validate_config,
    weights_source,
)
from eaglejax.loading.weights import hf_layer_shapes, layer_params_from_hf
from eaglejax.models.llama import Params

if TYPE_CHECKING:
    from eaglejax.loading.hf_dir import HFWeights


def expected_shapes(config: DraftConfig) -> Shapes:
    d, h = config.decoder, config.hidden_size
    shapes: Shapes = {"fc.weight": (h, 2 * h)}
    if config.fc_bias:
        shapes["fc.bias"] = (h,)
    for i in range(d.num_layers):
        layer = hf_layer_shapes(d, attn_norm=i > 0)
        shapes.update({f"layers.{i}.{k}": s for k, s in layer.items()})
    if config.own_embedding:
        shapes["embed_tokens.weight"] = (d.vocab_size, h)
    return shapes


def read_eagle1(path: Path, target: ModelConfig, weights: "HFWeights | None" = None
                ) -> ReadResult:
    """(config, float32 params, zero d2t) of an EAGLE-1/2 head directory."""
    cfg, source = read_head_config(path)
    qkv_bias = cfg.get("qkv_bias")
    decoder = parse_decoder(cfg, source, None if qkv_bias is None else bool(qkv_bias),
                            rope_theta=10000.0, max_position_embeddings=2048)
    weights = open_weights(path, weights)
    shapes = weights.shapes()
    config = DraftConfig(
        kind="eagle1", decoder=decoder, draft_vocab_size=decoder.vocab_size,
        target_hidden_size=decoder.hidden_size,
        # Some published heads lack fc.bias although the config does not say "bias": false.
        fc_bias=flag(cfg, "bias", True, source) and "fc.bias" in shapes,
        own_embedding="embed_tokens.weight" in shapes)
    validate_config(config, target, source)
    check_tensors(shapes, expected_shapes(config), weights_source(path))
    f32 = lambda name: np.asarray(weights.get(name), np.float32)  # noqa: E731
    layers = [layer_params_from_hf(decoder, lambda n, i=i: weights.get(f"layers.{i}.{n}"),
                                   attn_norm=i > 0) for i in range(decoder.num_layers)]
    params: Params = {"fc": f32("fc.weight"), "layers": layers}
    if config.fc_bias:
        params["fc_bias"] = f32("fc.bias")
    if config.own_embedding:
        params["embed"] = f32("embed_tokens.weight")
    d2t = np.zeros((config.draft_vocab_size,), np.int32)
    validate(config, params, d2t, target, source)
    return config, params, d2t
