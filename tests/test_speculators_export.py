"""Exports read by their consumers: eaglejax heads written with `export_speculators` and
`export_reference`, then parsed by the `speculators` package's own config classes and run by its
own EAGLE-3 torch model (the oracle): every field it parses must equal ours and its first-step
draft logits must equal eaglejax's. vLLM turns `transformer_layer_config` into a bare
PretrainedConfig, so the keys its EAGLE-3 layers read without a default are checked as well.

Random heads are built for the small random Llama target of conftest (3 layers, hidden 64,
vocabulary 97); the shipped SmolLM2 head is checked the same way (slow).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from speculators.convert.eagle.eagle3_converter import Eagle3Converter
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

from eaglejax.config import RopeScaling
from eaglejax.draft import Draft, DraftConfig, export_reference, export_speculators, load_draft
from eaglejax.draft.head import init_params
from eaglejax.errors import ConfigError
from tolerances import HEAD_UNITS, assert_close_scaled, scaled_error

V = 97  # the random target's vocabulary

# Keys of `transformer_layer_config` that vLLM's EAGLE-3 llama/qwen3 layers read with no
# default (a missing one stops vLLM at start-up, e.g. `hidden_act`) or with a default that
# would silently change the head (rope, head_dim, KV heads, tap count, ...).
VLLM_LAYER_KEYS = ("hidden_act", "rms_norm_eps", "hidden_size", "intermediate_size",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
                   "vocab_size", "max_position_embeddings", "rope_parameters", "rope_theta",
                   "attention_bias", "mlp_bias", "num_aux_hidden_states", "model_type")


# --------------------------------------------------------------------------------------------
# Random eaglejax heads
# --------------------------------------------------------------------------------------------

def _decoder(target, **changes):
    """The head's decoder: the target's attention shape as a one-layer Llama, then `changes`."""
    base = dataclasses.replace(target.config, model_type="llama", num_layers=1,
                               tie_word_embeddings=False, attention_bias=False, qk_norm=False)
    return dataclasses.replace(base, **changes)


HEADS = {
    # the shape `new_eagle3_draft` makes: full vocabulary, default taps
    "plain": dict(),
    # two layers, a draft vocabulary of 40, two taps, norm_before_residual, per-tap fc norms
    "subset-two-taps-fc-norm": dict(decoder=dict(num_layers=2), draft_vocab=40, taps=(1, 3),
                                    norm_before_residual=True, fc_norm=True),
    # its own embedding, head_dim != hidden / heads, llama3 RoPE scaling, norm_before_fc (one
    # norm over all taps)
    "own-embed-llama3-norm-before-fc": dict(
        decoder=dict(intermediate_size=80, head_dim=24, rope_theta=50000.0,
                     rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), max_position_embeddings=512),
        own_embedding=True, input_norm=True, draft_vocab=50),
    # a Qwen3 layer (q/k norms)
    "qwen3": dict(decoder=dict(model_type="qwen3", qk_norm=True, head_dim=32),
                  norm_before_residual=True),
}


def _random_head(target, case: dict, seed: int = 0) -> Draft:
    """A random EAGLE-3 head for `target`; norms away from 1 so each one's place matters."""
    rng = np.random.default_rng(seed)
    draft_vocab = case.get("draft_vocab", V)
    config = DraftConfig(
        "eagle3", _decoder(target, **case.get("decoder", {})), draft_vocab,
        target.config.hidden_size, case.get("taps", (2, 1, 0)),
        fc_norm=case.get("fc_norm", False), input_norm=case.get("input_norm", False),
        norm_before_residual=case.get("norm_before_residual", False),
        own_embedding=case.get("own_embedding", False))
    params = init_params(config, jax.random.PRNGKey(seed), scale=0.15)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * (1 + 0.3 * rng.standard_normal(x.shape, np.float32))
        if "norm" in jax.tree_util.keystr(path) else x, params)
    used = np.sort(rng.choice(V, draft_vocab, replace=False))
    return Draft(config, params, jax.numpy.asarray(used - np.arange(draft_vocab), jax.numpy.int32),
                 target, f"random-{seed}")


# --------------------------------------------------------------------------------------------
# The speculators package as the oracle
# --------------------------------------------------------------------------------------------

def _package_config(export: Path) -> Eagle3SpeculatorConfig:
    """The package's parse of an export's config.json, set to plain (eager) attention."""
    config = Eagle3SpeculatorConfig.from_pretrained(str(export))
    config.transformer_layer_config._attn_implementation = "eager"
    return config


def _assert_package_reads_ours(export: Path, draft: Draft) -> Eagle3SpeculatorConfig:
    """Every field the package parses equals the head's, and vLLM's keys are all written."""
    config = _package_config(export)
    c, d = draft.config, draft.config.decoder
    layer = config.transformer_layer_config
    assert type(config) is Eagle3SpeculatorConfig
    assert layer.model_type == {"mistral": "llama"}.get(d.model_type, d.model_type)
    assert layer.hidden_act == "silu"
    assert (layer.vocab_size, layer.hidden_size, layer.intermediate_size) == \
        (d.vocab_size, d.hidden_size, d.intermediate_size)
    assert (layer.num_hidden_layers, layer.num_attention_heads, layer.num_key_value_heads,
            layer.head_dim) == (d.num_layers, d.num_heads, d.num_kv_heads, d.head_dim)
    assert layer.rms_norm_eps == d.rms_norm_eps
    assert layer.max_position_embeddings == d.max_position_embeddings
    rope = {"rope_theta": d.rope_theta, "rope_type": "default"}
    if d.rope_scaling is not None:
        rope = {**rope, "rope_type": "llama3", **dataclasses.asdict(d.rope_scaling)}
    assert layer.rope_parameters == rope
    assert not layer.attention_bias and not layer.mlp_bias and not layer.tie_word_embeddings
    assert config.draft_vocab_size == c.draft_vocab_size
    assert config.target_hidden_size == c.target_hidden_size
    assert config.eagle_aux_hidden_state_layer_ids == list(c.tap_layers)
    assert (config.norm_before_residual, config.norm_before_fc, config.fc_norm,
            config.norm_output) == (c.norm_before_residual, c.input_norm, c.fc_norm, False)
    assert config.speculators_config.proposal_methods[0].speculative_tokens == 3

    written = json.loads((export / "config.json").read_text())["transformer_layer_config"]
    missing = [k for k in VLLM_LAYER_KEYS if k not in written]
    assert not missing, f"transformer_layer_config lacks {missing}"
    assert written["num_aux_hidden_states"] == len(c.tap_layers)
    assert written["rope_theta"] == d.rope_theta
    return config


def _package_logits(model: Eagle3DraftModel, tokens: np.ndarray, features: np.ndarray
                    ) -> np.ndarray:
    """The package model's first-step (TTT step 0) draft-vocabulary logits [T, DV] for one
    row, caught at its lm_head while its own forward runs."""
    caught = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: caught.append(out))
    length = tokens.shape[1]
    try:
        with torch.no_grad():
            model(hidden_states=torch.tensor(features, dtype=torch.float32),
                  input_ids=torch.tensor(tokens), position_ids=torch.arange(length)[None],
                  document_ids=torch.zeros(1, length, dtype=torch.long), ttt_steps=1)
    finally:
        hook.remove()
    return caught[0][0].double().numpy()


def _both_logits(model: Eagle3DraftModel, draft: Draft, tokens: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced first-step logits [T, DV] of eaglejax and of the package model over the
    draft vocabulary; asserts the package holds the same draft -> target map."""
    d2t = np.asarray(draft.d2t)
    if model.d2t is not None:
        np.testing.assert_array_equal(model.d2t.numpy(), d2t)
    features = np.asarray(draft.target_features(tokens), np.float32)
    tokens, features = tokens[:, 1:], features[:, :-1]
    ours = np.asarray(draft.logits(tokens, features), np.float64)[0]
    return ours[:, np.arange(d2t.size) + d2t], _package_logits(model, tokens, features)


def _assert_same_logits(model: Eagle3DraftModel, draft: Draft, tokens: np.ndarray):
    """Both within float32 noise of one head step (tolerances.HEAD_UNITS, as deep as the
    head's layers), with the same argmax."""
    ours, theirs = _both_logits(model, draft, tokens)
    assert_close_scaled(ours, theirs, units=HEAD_UNITS, depth=draft.config.decoder.num_layers,
                        what="draft logits vs speculators")
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


def _model_from_weights(export: Path, draft: Draft) -> Eagle3DraftModel:
    """The package model built from the export's config.json and loaded with exactly its
    tensors; the target's embedding where the head shares it. (The package's own
    `from_pretrained` is not used: it leaves a shared embedding as uninitialised memory
    whenever that memory holds no NaN, speculators 0.9.0.)"""
    model = Eagle3DraftModel(_package_config(export))
    missing, unexpected = model.load_state_dict(load_file(export / "model.safetensors"),
                                                strict=False)
    assert unexpected == ([] if model.use_draft_vocab else ["d2t", "t2d"])  # identity maps
    shared = [] if draft.config.own_embedding else ["embed_tokens.weight"]
    assert sorted(missing) == sorted(shared + ["verifier_lm_head.weight",
                                               "verifier_norm.weight"])
    if shared:
        model.embed_tokens.weight.data = torch.tensor(
            np.asarray(draft.target.params["embed"], np.float32))
    return model.eval()


@pytest.fixture(scope="module")
def target(target_of):
    return target_of("llama")


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, V, size=(1, 12))


# --------------------------------------------------------------------------------------------
# Speculators layout
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(HEADS))
def test_speculators_export_runs_in_the_package(tmp_path, name, target, tokens):
    draft = _random_head(target, HEADS[name])
    export = export_speculators(draft, tmp_path / "spec")
    _assert_package_reads_ours(export, draft)
    _assert_same_logits(_model_from_weights(export, draft), draft, tokens)


def test_the_logit_check_rejects_a_wrong_norm_epsilon(tmp_path, target, tokens):
    """Negative control: the package model built from an export whose rms_norm_eps was
    edited to 10x the head's fails `_assert_same_logits`."""
    draft = _random_head(target, HEADS["plain"])
    export = export_speculators(draft, tmp_path / "spec")
    config = json.loads((export / "config.json").read_text())
    config["transformer_layer_config"]["rms_norm_eps"] *= 10
    (export / "config.json").write_text(json.dumps(config))
    ours, theirs = _both_logits(_model_from_weights(export, draft), draft, tokens)
    assert scaled_error(ours, theirs, depth=draft.config.decoder.num_layers) > 2 * HEAD_UNITS


def test_speculators_export_of_a_narrow_head(tmp_path, target):
    """A head narrower than its target: the package parses target_hidden_size (its torch model
    sizes fc from the head's own width, so it cannot run such a head; vLLM can)."""
    draft = _random_head(target, dict(decoder=dict(hidden_size=48, intermediate_size=80),
                                      own_embedding=True))
    config = _assert_package_reads_ours(export_speculators(draft, tmp_path / "spec"), draft)
    assert (config.target_hidden_size, config.transformer_layer_config.hidden_size) == (64, 48)


def test_speculators_export_refuses_qkv_bias(tmp_path, target):
    draft = _random_head(target, {})
    biased = dataclasses.replace(draft.config, decoder=dataclasses.replace(
        draft.config.decoder, model_type="qwen2", attention_bias=True))
    with pytest.raises(ConfigError, match="q/k/v biases"):
        export_speculators(dataclasses.replace(draft, config=biased), tmp_path / "spec")
    assert not (tmp_path / "spec").exists()


def test_speculators_export_of_a_mistral_head(tmp_path, target):
    """A Mistral-shaped layer is written as Llama (what vLLM and speculators build), and a
    sliding window as layer_types, which is where both look for it."""
    draft = _random_head(target, {})
    mistral = dataclasses.replace(draft.config, decoder=dataclasses.replace(
        draft.config.decoder, model_type="mistral", sliding_window=64))
    draft = dataclasses.replace(draft, config=mistral)
    export = export_speculators(draft, tmp_path / "spec")
    layer = _assert_package_reads_ours(export, draft).transformer_layer_config
    assert layer.sliding_window == 64 and layer.layer_types == ["sliding_attention"]
    assert load_draft(export, target=target).config.decoder.sliding_window == 64


# --------------------------------------------------------------------------------------------
# Reference layout, through the package's converter for reference/SpecForge checkpoints
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["plain", "own-embed-llama3-norm-before-fc"])
def test_reference_export_converts_in_the_package(tmp_path, name, target, tokens, hf_family):
    """The package's converter reads the reference config.json itself (hidden_act, rope,
    head_dim, eps, KV heads, sizes, dtype; absent keys take defaults that would change the
    head), so equal logits after conversion mean every key it needs was written."""
    case = {k: v for k, v in HEADS[name].items() if k != "input_norm"}  # reference: no such norm
    draft = _random_head(target, case)
    export = export_reference(draft, tmp_path / "ref")
    converted = tmp_path / "converted"
    Eagle3Converter().convert(export, converted, base_model=str(hf_family("llama")[0]),
                              validate=False)
    _assert_same_logits(_model_from_weights(converted, draft), draft, tokens)


# --------------------------------------------------------------------------------------------
# The shipped SmolLM2 head
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_shipped_head_export_runs_in_the_package(tmp_path, smollm2):
    draft = load_draft(Path(__file__).parents[1] / "checkpoints/smollm2-135m-instruct-eagle3",
                       target=smollm2)
    export = export_speculators(draft, tmp_path / "spec")
    _assert_package_reads_ours(export, draft)
    model = _model_from_weights(export, draft)
    tokens = np.asarray([smollm2.tokenizer.encode(
        "The quick brown fox jumps over the lazy dog because it wanted to")])
    _assert_same_logits(model, draft, tokens)
