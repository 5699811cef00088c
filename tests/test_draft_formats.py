"""Draft-head checkpoint layouts: each reader against an independent torch oracle written from
the PyTorch-layout tensors, export/reload round trips, layer-id normalisation and refusals.

Heads are random, built here from the key tables of docs/formats.md, for the small random
Llama target of conftest (3 layers, hidden 64, 4 heads / 2 KV heads, vocab 97).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglejax.cli import main as cli_main
from eaglejax.draft import (Draft, export_reference, export_speculators, load_draft,
                            save_draft)
from eaglejax.errors import ConfigError, EaglejaxError, LoadError
from tolerances import HEAD_UNITS, assert_close_scaled

V, HT, L = 97, 64, 3  # the target's vocabulary, hidden size and layer count
EPS = 1e-5


# --------------------------------------------------------------------------------------------
# Random heads in PyTorch layout
# --------------------------------------------------------------------------------------------

class Spec:
    """Shape of a random head: hidden h, heads nh / kv, head dim hd, MLP width i."""

    def __init__(self, h=64, nh=4, kv=2, hd=None, i=96, layers=1, taps=3, dv=40, theta=10000.0):
        self.h, self.nh, self.kv, self.hd = h, nh, kv, hd or h // nh
        self.i, self.layers, self.taps, self.dv, self.theta = i, layers, taps, dv, theta


def _normal(g, *shape, scale=0.1):
    return torch.randn(*shape, generator=g, dtype=torch.float32) * scale


def _norm(g, n):
    return 1.0 + 0.1 * torch.randn(n, generator=g, dtype=torch.float32)


def _layer(g, prefix, s: Spec, in_dim, input_norm=True, bias=False):
    t = {}
    if input_norm:
        t[prefix + "input_layernorm.weight"] = _norm(g, s.h)
    for name, out in (("q", s.nh * s.hd), ("k", s.kv * s.hd), ("v", s.kv * s.hd)):
        t[f"{prefix}self_attn.{name}_proj.weight"] = _normal(g, out, in_dim)
        if bias:
            t[f"{prefix}self_attn.{name}_proj.bias"] = _normal(g, out)
    t[prefix + "self_attn.o_proj.weight"] = _normal(g, s.h, s.nh * s.hd)
    t[prefix + "mlp.gate_proj.weight"] = _normal(g, s.i, s.h)
    t[prefix + "mlp.up_proj.weight"] = _normal(g, s.i, s.h)
    t[prefix + "mlp.down_proj.weight"] = _normal(g, s.h, s.i)
    t[prefix + "post_attention_layernorm.weight"] = _norm(g, s.h)
    return t


def eagle3_tensors(seed, s: Spec, first="midlayer.", fc_norm=False, input_norm=False,
                   embed=False, ht=HT):
    """A random EAGLE-3 head (reference `midlayer.` or speculators `layers.0.`)."""
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": _normal(g, s.h, s.taps * ht)}
    t.update(_layer(g, first, s, 2 * s.h))
    t[first + "hidden_norm.weight"] = _norm(g, s.h)
    for i in range(1, s.layers):
        t.update(_layer(g, f"layers.{i}.", s, s.h))
    t["norm.weight"] = _norm(g, s.h)
    t["lm_head.weight"] = _normal(g, s.dv, s.h)
    if fc_norm:
        t.update({f"fc_norm.{k}.weight": _norm(g, ht) for k in range(s.taps)})
    if input_norm:
        t["input_norm.weight"] = _norm(g, s.taps * ht)
    if embed:
        t["embed_tokens.weight"] = _normal(g, V, s.h, scale=1.0)
    used = torch.sort(torch.randperm(V, generator=g)[:s.dv]).values
    t["d2t"] = (used - torch.arange(s.dv)).to(torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    t["t2d"] = t2d
    return t


def eagle1_tensors(seed, s: Spec, fc_bias=True, qkv_bias=False):
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": _normal(g, s.h, 2 * s.h)}
    if fc_bias:
        t["fc.bias"] = _normal(g, s.h)
    for i in range(s.layers):
        t.update(_layer(g, f"layers.{i}.", s, s.h, input_norm=i > 0, bias=qkv_bias))
    return t


def llama_config(s: Spec, **extra):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.h,
           "intermediate_size": s.i, "num_attention_heads": s.nh, "num_key_value_heads": s.kv,
           "num_hidden_layers": s.layers, "rms_norm_eps": EPS, "vocab_size": V,
           "hidden_act": "silu"}
    cfg.update(extra)
    return cfg


def write_head(directory: Path, config: dict, tensors: dict, weights: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if weights == "bin":
        torch.save(tensors, directory / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    return directory


# --------------------------------------------------------------------------------------------
# The oracle: the first draft step written from the PyTorch tensors, in float64
# --------------------------------------------------------------------------------------------

def _rms(x, w, eps=EPS):
    return w.double() * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, theta):
    """x [B, heads, T, hd], rotate-half layout, positions 0..T-1."""
    hd, length = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv[None]
    angles = torch.cat([angles, angles], dim=-1)
    rotated = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def _attention(x, sd, p, s: Spec):
    batch, length, _ = x.shape

    def proj(name, heads):
        y = x @ sd[f"{p}self_attn.{name}_proj.weight"].double().T
        if f"{p}self_attn.{name}_proj.bias" in sd:
            y = y + sd[f"{p}self_attn.{name}_proj.bias"].double()
        return y.view(batch, length, heads, s.hd).transpose(1, 2)

    q, k, v = proj("q", s.nh), proj("k", s.kv), proj("v", s.kv)
    q, k = _rope(q, s.theta), _rope(k, s.theta)
    k = k.repeat_interleave(s.nh // s.kv, dim=1)
    v = v.repeat_interleave(s.nh // s.kv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(s.hd)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(batch, length, s.nh * s.hd)
    return out @ sd[p + "self_attn.o_proj.weight"].double().T


def _mlp(x, sd, p):
    w = lambda n: sd[f"{p}mlp.{n}_proj.weight"].double()  # noqa: E731
    return (torch.nn.functional.silu(x @ w("gate").T) * (x @ w("up").T)) @ w("down").T


def _rest_and_mlp(h, sd, s: Spec, first_prefix):
    h = h + _mlp(_rms(h, sd[first_prefix + "post_attention_layernorm.weight"]), sd, first_prefix)
    for i in range(1, s.layers):
        p = f"layers.{i}."
        h = h + _attention(_rms(h, sd[p + "input_layernorm.weight"]), sd, p, s)
        h = h + _mlp(_rms(h, sd[p + "post_attention_layernorm.weight"]), sd, p)
    return h


def eagle3_oracle(sd, s: Spec, tokens, features, target_embed, first="midlayer.",
                  fc_norm=False, input_norm=False, norm_before_residual=False):
    """Target-vocabulary logits [B, T, V] of the first EAGLE-3 step (-inf outside the draft)."""
    f = torch.tensor(np.asarray(features), dtype=torch.float64)
    if fc_norm:
        f = torch.cat([_rms(c, sd[f"fc_norm.{k}.weight"])
                       for k, c in enumerate(f.split(HT, dim=-1))], dim=-1)
    if input_norm:
        f = _rms(f, sd["input_norm.weight"])
    x = f @ sd["fc.weight"].double().T
    embed = sd["embed_tokens.weight"].double() if "embed_tokens.weight" in sd else target_embed
    e = embed[torch.as_tensor(tokens)]
    hidden = _rms(x, sd[first + "hidden_norm.weight"])
    attn_in = torch.cat([_rms(e, sd[first + "input_layernorm.weight"]), hidden], dim=-1)
    h = (hidden if norm_before_residual else x) + _attention(attn_in, sd, first, s)
    h = _rest_and_mlp(h, sd, s, first)
    draft = _rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].double().T
    full = torch.full((*draft.shape[:-1], V), -math.inf, dtype=torch.float64)
    full[..., torch.arange(s.dv) + sd["d2t"]] = draft
    return full.numpy()


def eagle1_oracle(sd, s: Spec, tokens, features, target_embed, target_lm_head):
    f = torch.tensor(np.asarray(features), dtype=torch.float64)
    e = target_embed[torch.as_tensor(tokens)]
    x = torch.cat([e, f], dim=-1) @ sd["fc.weight"].double().T
    if "fc.bias" in sd:
        x = x + sd["fc.bias"].double()
    h = x + _attention(x, sd, "layers.0.", s)  # no input norm on the first layer
    h = _rest_and_mlp(h, sd, s, "layers.0.")
    return (h @ target_lm_head.T).numpy()  # target lm_head on the un-normed output


# --------------------------------------------------------------------------------------------
# Fixtures and comparison helpers
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target(target_of):
    return target_of("llama")


@pytest.fixture(scope="module")
def target_weights(hf_family):
    model = hf_family("llama")[1]
    return (model.model.embed_tokens.weight.detach().double(),
            model.lm_head.weight.detach().double())


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, V, size=(2, 9))


def _assert_logits(got, want):
    """Within float32 noise of the float64 oracle for one head step (tolerances.HEAD_UNITS):
    -inf outside the draft vocabulary in both, noise at most 6.4 units of about 3e-7."""
    assert_close_scaled(got, want, units=HEAD_UNITS, what="draft logits")


def _first_step(draft: Draft, tokens):
    """Aligned inputs of the first draft step: tokens x[1:], features f[:-1]."""
    feats = draft.target_features(tokens)
    return tokens[:, 1:], np.asarray(feats)[:, :-1]


def _assert_same_tensors(exported: Path, source: dict):
    """The exported file holds exactly the source checkpoint's tensors (t2d rebuilt from d2t)."""
    got = load_file(exported / "model.safetensors")
    assert set(got) == set(source)
    for name, tensor in source.items():
        assert got[name].dtype == tensor.dtype, name
        # bit identity is the property: an export copies tensors, it computes nothing
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


def _assert_same_head(a: Draft, b: Draft):
    assert a.config == b.config
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(a.d2t), np.asarray(b.d2t))


# --------------------------------------------------------------------------------------------
# EAGLE-3, reference and SpecForge layouts
# --------------------------------------------------------------------------------------------

REFERENCE_CASES = {
    # the reference's own config: no rope_theta, no head_dim, default taps, pytorch_model.bin
    "reference-bin": dict(spec=Spec(), weights="bin", extra={}),
    # head_dim honoured (32 != 64 // 4), rope_theta honoured, safetensors
    "reference-head-dim": dict(spec=Spec(hd=32, theta=50000.0), weights="safetensors",
                               extra={"head_dim": 32, "rope_theta": 50000.0}),
    # SpecForge: its arch name, fc_norm, output-id taps, its own embedding
    "specforge-fc-norm": dict(spec=Spec(), weights="safetensors", fc_norm=True, embed=True,
                              extra={"architectures": ["LlamaForCausalLMEagle3"], "fc_norm": True,
                                     "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                      [0, 1, 2]}}),
}


def _reference_head(tmp_path, name, case, seed=1):
    s = case["spec"]
    tensors = eagle3_tensors(seed, s, fc_norm=case.get("fc_norm", False),
                             embed=case.get("embed", False))
    config = llama_config(s, num_hidden_layers=1, draft_vocab_size=s.dv, **case["extra"])
    return write_head(tmp_path / name, config, tensors, case["weights"]), tensors


@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_reference_layout_matches_oracle(tmp_path, name, target, target_weights, tokens):
    case = REFERENCE_CASES[name]
    path, sd = _reference_head(tmp_path, name, case)
    draft = load_draft(path, target=target)
    assert draft.config.kind == "eagle3" and draft.config.draft_vocab_size == case["spec"].dv
    toks, feats = _first_step(draft, tokens)
    want = eagle3_oracle(sd, case["spec"], toks, feats, target_weights[0],
                         fc_norm=case.get("fc_norm", False))
    _assert_logits(draft.logits(toks, feats), want)

    for writer in (export_reference, export_speculators, save_draft):
        _assert_same_head(draft, load_draft(writer(draft, tmp_path / writer.__name__),
                                            target=target))
    _assert_same_tensors(tmp_path / "export_reference", sd)


def test_reference_defaults(tmp_path, target):
    path, _ = _reference_head(tmp_path, "ref", REFERENCE_CASES["reference-bin"])
    c = load_draft(path, target=target).config
    assert c.decoder.rope_theta == 10000.0 and c.decoder.max_position_embeddings == 2048
    assert c.decoder.head_dim == 16 and c.tap_layers == (2, L // 2, L - 3)
    assert not c.norm_before_residual and not c.own_embedding


# --------------------------------------------------------------------------------------------
# EAGLE-3, speculators layout
# --------------------------------------------------------------------------------------------

def _speculators_config(s: Spec, taps=(1, 2, 3), ht=HT, **top):
    layer = llama_config(s)
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "draft_vocab_size": s.dv, "target_hidden_size": ht,
           "eagle_aux_hidden_state_layer_ids": list(taps), "transformer_layer_config": layer,
           "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
               {"proposal_type": "greedy", "speculative_tokens": 3}],
               "verifier": {"name_or_path": "x"}}}
    cfg.update(top)
    return cfg


SPECULATORS_CASES = {
    # two layers, narrower head (48) than the target (64) with its own embedding,
    # norm_before_residual absent (vLLM: true), norm_before_fc
    "multi-layer-norm-before-fc": dict(spec=Spec(h=48, layers=2), weights="safetensors",
                                       nbr=True, input_norm=True, embed=True,
                                       top={"norm_before_fc": True}),
    # fc_norm, norm_before_residual false, pytorch_model.bin
    "fc-norm-bin": dict(spec=Spec(), weights="bin", nbr=False, fc_norm=True,
                        top={"fc_norm": True, "norm_before_residual": False}),
}


@pytest.mark.parametrize("name", list(SPECULATORS_CASES))
def test_speculators_layout_matches_oracle(tmp_path, name, target, target_weights, tokens):
    case = SPECULATORS_CASES[name]
    s = case["spec"]
    sd = eagle3_tensors(2, s, first="layers.0.", fc_norm=case.get("fc_norm", False),
                        input_norm=case.get("input_norm", False), embed=case.get("embed", False))
    path = write_head(tmp_path / name, _speculators_config(s, **case["top"]), sd, case["weights"])
    draft = load_draft(path, target=target)
    assert draft.config.tap_layers == (1, 2, 3)
    assert draft.config.norm_before_residual == case["nbr"]
    toks, feats = _first_step(draft, tokens)
    want = eagle3_oracle(sd, s, toks, feats, target_weights[0], first="layers.0.",
                         fc_norm=case.get("fc_norm", False),
                         input_norm=case.get("input_norm", False),
                         norm_before_residual=case["nbr"])
    _assert_logits(draft.logits(toks, feats), want)

    for writer in (export_speculators, save_draft):
        _assert_same_head(draft, load_draft(writer(draft, tmp_path / writer.__name__),
                                            target=target))
    _assert_same_tensors(tmp_path / "export_speculators", sd)
    if s.layers > 1:
        with pytest.raises(ConfigError, match="2 decoder layers"):
            export_reference(draft, tmp_path / "ref")
        assert not (tmp_path / "ref").exists()


@pytest.mark.parametrize("name,wrong", [
    ("multi-layer-norm-before-fc", dict(rms_norm_eps=1e-6)),
    ("reference-head-dim", dict(rope_theta=10000.0)),
], ids=["rms_norm_eps", "rope_theta"])
def test_oracle_check_rejects_a_wrong_norm_epsilon_or_rope_base(tmp_path, name, wrong, target,
                                                                target_weights, tokens):
    """Negative control: `_assert_logits` fails for a head run with the target's epsilon
    1e-6 instead of its own 1e-5 (the hardest case: 1.1e-5 off, 36 to 39 units), or with the
    default rope_theta 1e4 instead of its 5e4."""
    if name in SPECULATORS_CASES:
        case = SPECULATORS_CASES[name]
        s = case["spec"]
        sd = eagle3_tensors(2, s, first="layers.0.", input_norm=True, embed=True)
        path = write_head(tmp_path / name, _speculators_config(s, **case["top"]), sd,
                          case["weights"])
        oracle = dict(first="layers.0.", input_norm=True, norm_before_residual=True)
    else:
        case = REFERENCE_CASES[name]
        s = case["spec"]
        path, sd = _reference_head(tmp_path, name, case)
        oracle = {}
    draft = load_draft(path, target=target)
    toks, feats = _first_step(draft, tokens)
    want = eagle3_oracle(sd, s, toks, feats, target_weights[0], **oracle)
    _assert_logits(draft.logits(toks, feats), want)
    decoder = dataclasses.replace(draft.config.decoder, **wrong)
    bad = dataclasses.replace(draft, config=dataclasses.replace(draft.config, decoder=decoder))
    with pytest.raises(AssertionError, match="noise units"):
        _assert_logits(bad.logits(toks, feats), want)


def test_speculators_export_config(tmp_path, target):
    path, _ = _reference_head(tmp_path, "ref", REFERENCE_CASES["reference-bin"])
    draft = load_draft(path, target=target)
    cfg = json.loads((export_speculators(draft, tmp_path / "out") / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 1, 0]  # entering ids, vLLM's
    assert cfg["norm_before_residual"] is False
    assert cfg["transformer_layer_config"]["vocab_size"] == V
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] >= 1


# --------------------------------------------------------------------------------------------
# Layer-id semantics
# --------------------------------------------------------------------------------------------

def test_layer_ids_normalised(tmp_path, target, tokens):
    """SpecForge output ids [0, 1, 2] and speculators entering ids [1, 2, 3] are the same taps."""
    s = Spec()
    ref_sd = eagle3_tensors(3, s)
    spec_sd = {k.replace("midlayer.", "layers.0."): v for k, v in ref_sd.items()}
    specforge = write_head(tmp_path / "specforge", llama_config(
        s, num_hidden_layers=1, draft_vocab_size=s.dv,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}), ref_sd, "safetensors")
    speculators = write_head(tmp_path / "speculators", _speculators_config(
        s, taps=(1, 2, 3), norm_before_residual=False), spec_sd, "safetensors")
    a, b = load_draft(specforge, target=target), load_draft(speculators, target=target)
    assert a.config.tap_layers == b.config.tap_layers == (1, 2, 3)
    toks, feats = _first_step(a, tokens)
    np.testing.assert_array_equal(np.asarray(a.logits(toks, feats)),
                                  np.asarray(b.logits(toks, feats)))
    # the reference export writes them back as output ids, for SGLang
    cfg = json.loads((export_reference(b, tmp_path / "out") / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]


def test_layer_ids_conflict_refused(tmp_path, target):
    s = Spec()
    path = write_head(tmp_path / "h", llama_config(
        s, num_hidden_layers=1, draft_vocab_size=s.dv, eagle_aux_hidden_state_layer_ids=[0, 1, 2],
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}),
        eagle3_tensors(3, s), "safetensors")
    with pytest.raises(ConfigError, match="name different target layers"):
        load_draft(path, target=target)


# --------------------------------------------------------------------------------------------
# EAGLE-1/2
# --------------------------------------------------------------------------------------------

EAGLE1_CASES = {
    "fc-bias-qkv-bias-bin": dict(fc_bias=True, qkv_bias=True, weights="bin", extra={
        "qkv_bias": True}),
    "no-fc-bias-sglang": dict(fc_bias=False, qkv_bias=False, weights="safetensors", extra={
        "bias": False, "architectures": ["LlamaForCausalLMEagle"]}),
    "bias-true-but-absent": dict(fc_bias=False, qkv_bias=False, weights="safetensors", extra={}),
}


@pytest.mark.parametrize("name", list(EAGLE1_CASES))
def test_eagle1_matches_oracle(tmp_path, name, target, target_weights, tokens):
    case = EAGLE1_CASES[name]
    s = Spec(layers=2, dv=V)
    sd = eagle1_tensors(4, s, fc_bias=case["fc_bias"], qkv_bias=case["qkv_bias"])
    path = write_head(tmp_path / name, llama_config(s, **case["extra"]), sd, case["weights"])
    draft = load_draft(path, target=target)
    c = draft.config
    assert c.kind == "eagle1" and c.tap_layers == () and c.draft_vocab_size == V
    assert c.fc_bias == case["fc_bias"] and c.decoder.attention_bias == case["qkv_bias"]
    assert not np.asarray(draft.d2t).any()
    toks, feats = _first_step(draft, tokens)  # the target's final normed hidden state
    _assert_logits(draft.logits(toks, feats),
                   eagle1_oracle(sd, s, toks, feats, *target_weights))
    _assert_same_head(draft, load_draft(save_draft(draft, tmp_path / "native"), target=target))
    for writer in (export_reference, export_speculators):
        with pytest.raises(ConfigError, match="eagle1 head"):
            writer(draft, tmp_path / writer.__name__)


def test_eagle1_detected_from_tensors(tmp_path, target):
    """A plain Llama config without EAGLE hints: the tensor names decide."""
    s = Spec(layers=1, dv=V)
    path = write_head(tmp_path / "h", llama_config(s), eagle1_tensors(5, s), "safetensors")
    assert load_draft(path, target=target).config.kind == "eagle1"


# --------------------------------------------------------------------------------------------
# eaglejax's own format, dtype and the CLI
# --------------------------------------------------------------------------------------------

def test_native_dtype_and_save(tmp_path, target):
    path, _ = _reference_head(tmp_path, "ref", REFERENCE_CASES["reference-bin"])
    draft = load_draft(path, target=target, dtype="bfloat16")
    assert {x.dtype.name for x in jax.tree.leaves(draft.params)} == {"bfloat16"}
    draft.save(str(tmp_path / "native"))
    manifest = json.loads((tmp_path / "native" / "eaglejax.json").read_text())
    assert manifest["format"] == "eaglejax-draft" and manifest["dtype"] == "bfloat16"
    _assert_same_head(draft, load_draft(tmp_path / "native", target=target, dtype="bfloat16"))
    with pytest.raises(EaglejaxError, match="refusing to overwrite"):
        save_draft(draft, tmp_path / "native")
    with pytest.raises(EaglejaxError, match="refusing to overwrite"):
        export_reference(draft, tmp_path / "native")
    with pytest.raises(EaglejaxError, match="refusing to overwrite"):
        export_speculators(draft, tmp_path / "native")


def test_cli_convert(tmp_path, target, hf_family, capsys):
    path, _ = _reference_head(tmp_path, "ref", REFERENCE_CASES["specforge-fc-norm"])
    target_dir = str(hf_family("llama")[0])
    out = tmp_path / "spec"
    assert cli_main(["convert", str(path), str(out), "--target", target_dir,
                     "--to", "speculators"]) == 0
    _assert_same_head(load_draft(path, target=target), load_draft(out, target=target))
    assert cli_main(["convert", str(path), str(out), "--target", target_dir]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eaglejax: error:") and "refusing to overwrite" in err
    assert len(err.splitlines()) == 1


# --------------------------------------------------------------------------------------------
# Refusals: each names the file and the key or shape at fault
# --------------------------------------------------------------------------------------------

def _broken_reference(tmp_path, target, *, config=None, drop=(), add=None, replace=None,
                      spec=None):
    s = spec or Spec()
    tensors = eagle3_tensors(6, s)
    for k in drop:
        del tensors[k]
    tensors.update(add or {})
    tensors.update(replace or {})
    cfg = llama_config(s, num_hidden_layers=1, draft_vocab_size=s.dv)
    cfg.update(config or {})
    path = write_head(tmp_path / "broken", cfg, tensors, "safetensors")
    return lambda: load_draft(path, target=target)


def test_refuses_missing_d2t(tmp_path, target):
    load = _broken_reference(tmp_path, target, drop=("d2t", "t2d"))
    with pytest.raises(LoadError, match=r"model\.safetensors.*draft_vocab_size 40 < vocab_size "
                                        r"97.*no 'd2t'"):
        load()


def test_refuses_all_zero_d2t(tmp_path, target):
    load = _broken_reference(tmp_path, target, replace={"d2t": torch.zeros(40, dtype=torch.int64)})
    with pytest.raises(LoadError, match=r"'d2t' is all zeros"):
        load()


def test_refuses_d2t_out_of_range(tmp_path, target):
    load = _broken_reference(tmp_path, target,
                             replace={"d2t": torch.full((40,), 90, dtype=torch.int64)})
    with pytest.raises(LoadError, match=r"'d2t' maps draft ids to target ids in \[90, 129\]"):
        load()


def test_refuses_vocab_mismatch(tmp_path, target):
    load = _broken_reference(tmp_path, target, config={"vocab_size": 100},
                             replace={"t2d": torch.zeros(100, dtype=torch.bool)})
    with pytest.raises(ConfigError, match=r"config\.json: vocab_size 100 does not match the "
                                          r"target's vocabulary size 97"):
        load()


def test_refuses_hidden_mismatch(tmp_path, target):
    s = Spec()
    load = _broken_reference(tmp_path, target, config={"target_hidden_size": 32},
                             replace={"fc.weight": torch.zeros(s.h, 3 * 32)})
    with pytest.raises(ConfigError, match=r"config\.json: target_hidden_size 32 does not match "
                                          r"the target's hidden size 64"):
        load()


def test_refuses_eagle1_hidden_mismatch(tmp_path, target):
    s = Spec(h=32, layers=1, dv=V)
    path = write_head(tmp_path / "h", llama_config(s), eagle1_tensors(7, s), "safetensors")
    with pytest.raises(ConfigError, match=r"config\.json: .*hidden size"):
        load_draft(path, target=target)


def test_refuses_taps_out_of_range(tmp_path, target):
    load = _broken_reference(tmp_path, target,
                             config={"eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                      [0, 1, 5]}})
    with pytest.raises(ConfigError, match=r"config\.json: tap layers \[1, 2, 6\].*"
                                          r"eagle_aux_hidden_state_layer_ids \[0, 1, 5\].*"
                                          r"out of range"):
        load()


def test_refuses_speculators_taps_out_of_range(tmp_path, target):
    s = Spec()
    path = write_head(tmp_path / "h", _speculators_config(s, taps=(1, 2, 4)),
                      eagle3_tensors(8, s, first="layers.0."), "safetensors")
    with pytest.raises(ConfigError, match=r"config\.json: tap layers \[1, 2, 4\].*out of range"):
        load_draft(path, target=target)


def test_refuses_unknown_tensor(tmp_path, target):
    load = _broken_reference(tmp_path, target, add={"midlayer.self_attn.extra.weight":
                                                    torch.zeros(3)})
    with pytest.raises(LoadError, match=r"model\.safetensors: unexpected tensor "
                                        r"'midlayer\.self_attn\.extra\.weight'"):
        load()


def test_refuses_fc_norm_tensors_without_config_flag(tmp_path, target):
    load = _broken_reference(tmp_path, target, add={"fc_norm.0.weight": torch.ones(HT)})
    with pytest.raises(LoadError, match=r"unexpected tensor 'fc_norm\.0\.weight'"):
        load()


def test_refuses_shape_mismatch(tmp_path, target):
    load = _broken_reference(tmp_path, target, replace={"lm_head.weight": torch.zeros(41, 64)})
    with pytest.raises(LoadError, match=r"tensor 'lm_head\.weight' has shape \(41, 64\), but the "
                                        r"config implies \(40, 64\)"):
        load()


def test_refuses_missing_tensor(tmp_path, target):
    load = _broken_reference(tmp_path, target, drop=("midlayer.hidden_norm.weight",))
    with pytest.raises(LoadError, match=r"missing tensor 'midlayer\.hidden_norm\.weight'"):
        load()


def test_refuses_narrow_head_without_embedding(tmp_path, target):
    s = Spec(h=48)
    path = write_head(tmp_path / "h", _speculators_config(s), eagle3_tensors(
        9, s, first="layers.0."), "safetensors")
    with pytest.raises(LoadError, match=r"needs its own 'embed_tokens\.weight'"):
        load_draft(path, target=target)


def test_refuses_unsupported_flags_and_kinds(tmp_path, target):
    load = _broken_reference(tmp_path, target, config={"norm_output": True})
    with pytest.raises(ConfigError, match="norm_output"):
        load()
    s = Spec()
    path = write_head(tmp_path / "dspark", _speculators_config(s, speculators_model_type="dspark"),
                      eagle3_tensors(10, s, first="layers.0."), "safetensors")
    with pytest.raises(ConfigError, match="speculators_model_type 'dspark'"):
        load_draft(path, target=target)
    # DFlash is read (tests/test_dflash.py, its reduced vocabularies tests/test_dflash_vocab.py),
    # but an EAGLE-3 config relabelled as DFlash names no taps where DFlash's layout does
    path = write_head(tmp_path / "dflash", _speculators_config(s, speculators_model_type="dflash"),
                      eagle3_tensors(10, s, first="layers.0."), "safetensors")
    with pytest.raises(ConfigError, match="the tapped target layers are missing"):
        load_draft(path, target=target)
    # P-EAGLE is read (tests/test_peagle.py), but not without its mask token
    path = write_head(tmp_path / "peagle", _speculators_config(s, speculators_model_type="peagle"),
                      eagle3_tensors(10, s, first="layers.0."), "safetensors")
    with pytest.raises(ConfigError, match="a 'peagle' head needs its mask token id"):
        load_draft(path, target=target)


def test_refuses_non_heads(tmp_path, target, hf_family):
    with pytest.raises(LoadError, match="not a draft head"):
        load_draft(hf_family("llama")[0], target=target)  # a target model directory
    target.save(str(tmp_path / "ckpt"))
    with pytest.raises(LoadError, match="'eaglejax-target' is not a draft head"):
        load_draft(tmp_path / "ckpt", target=target)
    with pytest.raises(LoadError, match="no such file"):
        load_draft(tmp_path / "missing", target=target)
