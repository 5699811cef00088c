"""Logits and feature taps against Hugging Face transformers (PyTorch, float32)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eaglejax
from eaglejax.models import kv_cache
from eaglejax.models.llama import forward, lm_head
from hf_oracle import FAMILIES, hf_logits, make_hf_model
from tolerances import BF16_UNITS, FORWARD_UNITS, assert_close_scaled


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, hf_family, target_of):
    _, model = hf_family(family)
    ids = np.random.RandomState(0).randint(0, 97, size=(2, 48))
    target = target_of(family)
    got = np.asarray(target.logits(ids))
    # Logits reach about 2.5: noise is 2e-6 to 3e-6 (at most 5.8 units of 4.9e-7 through 3
    # layers); the bound, 40 units, is about 2e-5.
    assert_close_scaled(got, hf_logits(model, ids), units=FORWARD_UNITS,
                        depth=target.config.num_layers)


@pytest.mark.parametrize("wrong", [dict(rms_norm_eps=1e-5), dict(rope_theta=10000.0)],
                         ids=["rms_norm_eps", "rope_theta"])
def test_logits_check_rejects_a_wrong_norm_epsilon_or_rope_base(wrong, hf_family, target_of):
    """Negative control: the Llama-3 model (rms_norm_eps 1e-6, rope_theta 5e5) run with the
    common defaults 1e-5 (2.3e-3 off: 4,800 units) or 1e4 fails the check above."""
    _, model = hf_family("llama3")
    target = target_of("llama3")
    ids = np.random.RandomState(0).randint(0, 97, size=(2, 48))
    bad = dataclasses.replace(target, config=dataclasses.replace(target.config, **wrong))
    with pytest.raises(AssertionError, match="noise units"):
        assert_close_scaled(np.asarray(bad.logits(ids)), hf_logits(model, ids),
                            units=FORWARD_UNITS, depth=target.config.num_layers)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_features_are_hidden_states_entering_layers(family, hf_family, target_of):
    _, model = hf_family(family)
    ids = np.random.RandomState(1).randint(0, 97, size=(1, 20))
    with torch.no_grad():
        states = model(torch.as_tensor(ids), output_hidden_states=True).hidden_states
    target = target_of(family)
    got = np.asarray(target.features(ids, layer_ids=(0, 1, 2)))
    want = np.concatenate([states[i].numpy() for i in (0, 1, 2)], axis=-1)
    # The deepest tap has been through 2 layers: noise at most 5 units; a wrong epsilon
    # (1e-7 or 1e-5 for 1e-6) 309 units or more.
    assert_close_scaled(got, want, units=FORWARD_UNITS, depth=2)
    # Default taps (2, L//2, L-3) for L=3 layers are (2, 1, 0).
    default = np.asarray(target.features(ids))
    assert_close_scaled(default, np.concatenate([states[i].numpy() for i in (2, 1, 0)], axis=-1),
                        units=FORWARD_UNITS, depth=2)


@pytest.mark.parametrize("layout", ["bin", "sharded"])
def test_other_weight_layouts_load(layout, tmp_path, hf_family):
    _, model = hf_family("llama")
    if layout == "bin":
        model.config.save_pretrained(tmp_path)  # transformers 5 writes no .bin any more
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    else:
        model.save_pretrained(tmp_path, max_shard_size="100KB")
        assert (tmp_path / "model.safetensors.index.json").exists()
    ids = np.random.RandomState(2).randint(0, 97, size=(1, 16))
    got = np.asarray(eaglejax.load_target(tmp_path).logits(ids))
    assert_close_scaled(got, hf_logits(model, ids), units=FORWARD_UNITS,
                        depth=model.config.num_hidden_layers)


def test_cached_chunks_and_tree_mask_agree_with_full_sequence(target_of):
    """Prefill, then a chunk and a tree over the cache: each node's logits equal the logits
    of its root-to-node sequence scored from scratch."""
    target = target_of("llama3")
    cfg, params = target.config, target.params
    rs = np.random.RandomState(3)
    prefix = rs.randint(0, 97, size=(1, 11))
    cache = kv_cache.init_cache(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    out = forward(params, cfg, jnp.asarray(prefix), jnp.arange(11)[None], cache)
    cache = kv_cache.append(cache, out.k_new, out.v_new, jnp.array([11]))
    # Tree: node 0 root child of prefix; 1, 2 children of 0; 3 child of 1.
    parents = [-1, 0, 0, 1]
    tokens = rs.randint(0, 97, size=4)
    depth = np.array([0, 1, 1, 2])
    mask = np.eye(4, dtype=bool)
    for node, parent in enumerate(parents):
        while parent >= 0:
            mask[node, parent] = True
            parent = parents[parent]
    out = forward(params, cfg, jnp.asarray(tokens)[None], jnp.asarray(11 + depth)[None], cache,
                  mask=jnp.asarray(mask)[None])
    tree_logits = np.asarray(lm_head(params, out.hidden))[0]
    for node in range(4):
        path = [n for n in range(4) if mask[node, n]]
        seq = np.concatenate([prefix[0], tokens[path]])[None]
        # Noise at most 3.5 units; a tree node one position off: 550,000 units.
        assert_close_scaled(tree_logits[node], np.asarray(target.logits(seq))[0, -1],
                            units=FORWARD_UNITS, depth=cfg.num_layers)


def test_bfloat16_weights_stay_close(hf_family):
    directory, model = hf_family("qwen2")
    target = eaglejax.load_target(directory, dtype="bfloat16")
    assert target.dtype == jnp.bfloat16
    ids = np.random.RandomState(4).randint(0, 97, size=(1, 16))
    ref = hf_logits(model, ids)
    got = np.asarray(target.logits(ids))
    # bfloat16 weights and activations: 0.91 units of bfloat16 noise through 3 layers
    # (2.5e-2 for logits up to 2); the bound is 4 units.
    assert_close_scaled(got, ref, units=BF16_UNITS, depth=3, dtype=jnp.bfloat16)


def test_untied_random_model_differs_from_tied(tmp_path):
    """Guard against a loader that silently ties or drops lm_head."""
    model = make_hf_model("llama", tmp_path, seed=5)
    target = eaglejax.load_target(tmp_path)
    assert "lm_head" in target.params
    assert not np.allclose(model.lm_head.weight.detach().numpy(),
                           model.model.embed_tokens.weight.detach().numpy())
