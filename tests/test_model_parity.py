"""Logits and feature taps against Hugging Face transformers (PyTorch, float32)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eaglejax
from eaglejax.models import kv_cache
from eaglejax.models.llama import forward, lm_head
from hf_oracle import FAMILIES, hf_logits, make_hf_model

TOL = 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, hf_family, target_of):
    _, model = hf_family(family)
    ids = np.random.RandomState(0).randint(0, 97, size=(2, 48))
    got = np.asarray(target_of(family).logits(ids))
    np.testing.assert_allclose(got, hf_logits(model, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_features_are_hidden_states_entering_layers(family, hf_family, target_of):
    _, model = hf_family(family)
    ids = np.random.RandomState(1).randint(0, 97, size=(1, 20))
    with torch.no_grad():
        states = model(torch.as_tensor(ids), output_hidden_states=True).hidden_states
    target = target_of(family)
    got = np.asarray(target.features(ids, layer_ids=(0, 1, 2)))
    want = np.concatenate([states[i].numpy() for i in (0, 1, 2)], axis=-1)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    # Default taps (2, L//2, L-3) for L=3 layers are (2, 1, 0).
    default = np.asarray(target.features(ids))
    np.testing.assert_allclose(default, np.concatenate(
        [states[i].numpy() for i in (2, 1, 0)], axis=-1), atol=TOL, rtol=0)


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
    np.testing.assert_allclose(got, hf_logits(model, ids), atol=TOL, rtol=0)


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
        np.testing.assert_allclose(tree_logits[node], np.asarray(target.logits(seq))[0, -1],
                                   atol=TOL, rtol=0)


def test_bfloat16_weights_stay_close(hf_family):
    directory, model = hf_family("qwen2")
    target = eaglejax.load_target(directory, dtype="bfloat16")
    assert target.dtype == jnp.bfloat16
    ids = np.random.RandomState(4).randint(0, 97, size=(1, 16))
    ref = hf_logits(model, ids)
    got = np.asarray(target.logits(ids))
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()


def test_untied_random_model_differs_from_tied(tmp_path):
    """Guard against a loader that silently ties or drops lm_head."""
    model = make_hf_model("llama", tmp_path, seed=5)
    target = eaglejax.load_target(tmp_path)
    assert "lm_head" in target.params
    assert not np.allclose(model.lm_head.weight.detach().numpy(),
                           model.model.embed_tokens.weight.detach().numpy())
