"""Exports of DFlash drafters in the layouts peers load (issue 31).

A random DFlash drafter written in the z-lab layout (`export_dflash`) and in the
speculators dflash layout (`export_speculators`) loads back through `load_draft` with the
same config and bit-identical parameters, in float32 and bfloat16. Oracles: the speculators
package loads our speculators export with its own `DFlashDraftModel.from_pretrained`
(embedding and output head from the verifier, i.e. our target directory), and its modules
composed over one block after a context (as tests/test_dflash.py composes its layers)
propose eaglejax's `block_logits` within float32 noise units; its own z-lab converter turns
our z-lab export into its layout, which eaglejax reads back equal. A drafter with typed
layers writes them as it read them, in both layouts: it loads back equal, and the
consumers' own config classes (transformers' Qwen3Config for z-lab's, speculators'
DFlashSpeculatorConfig) see its layer types, window and causality. The CLI writes both
layouts and refuses the others in one line.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eaglejax
from eaglejax import ConfigError
from eaglejax.cli import main
from eaglejax.draft.config import LayerAttention
from eaglejax.draft.dflash import block_logits, context_kv
from eaglejax.draft.draft import new_dflash_draft, new_eagle3_draft
from eaglejax.draft.formats import export_dflash, export_reference, export_speculators
from eaglejax.models import kv_cache
from hf_oracle import make_hf_model
from tolerances import FORWARD_UNITS, assert_close_scaled

V, MASK, BLOCK, TARGET_LAYERS, DRAFT_LAYERS = 97, 96, 4, 6, 2
WRITERS = {"z-lab": export_dflash, "speculators": export_speculators}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dflash-export-target")
    make_hf_model("qwen3", directory, seed=3, vocab_size=V, num_hidden_layers=TARGET_LAYERS)
    return directory


@pytest.fixture(scope="module")
def target(target_dir):
    return eaglejax.load_target(target_dir)


@pytest.fixture(scope="module")
def draft(target):
    draft = new_dflash_draft(target, num_layers=DRAFT_LAYERS, block_size=BLOCK,
                             mask_token_id=MASK, seed=7, scale=0.1)
    assert draft.config.tap_layers == (2, 4)  # layer outputs 1 and 3 (z-lab's ids)
    return draft


@pytest.fixture(scope="module")
def exported(draft, tmp_path_factory):
    """The drafter in both layouts: {layout: directory}."""
    root = tmp_path_factory.mktemp("dflash-exports")
    return {layout: write(draft, root / layout) for layout, write in WRITERS.items()}


def _assert_same(got, want) -> None:
    assert got.config == want.config
    got_leaves = jax.tree_util.tree_leaves_with_path(got.params)
    want_leaves = jax.tree_util.tree_leaves_with_path(want.params)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), \
            jax.tree_util.keystr(path)


@pytest.mark.parametrize("layout", list(WRITERS))
def test_exports_reload_identical(target, draft, exported, layout):
    cfg = json.loads((exported[layout] / "config.json").read_text())
    if layout == "z-lab":
        assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
        assert cfg["dflash_config"]["target_layer_ids"] == [1, 3]
        assert cfg["num_hidden_layers"] == DRAFT_LAYERS
    else:
        assert cfg["speculators_model_type"] == "dflash"
        assert cfg["aux_hidden_state_layer_ids"] == [2, 4]
    _assert_same(eaglejax.load_draft(exported[layout], target=target), draft)


def _typed(draft, kinds: tuple, window: int | None):
    """The drafter with layer kinds `kinds` under a decoder of sliding window `window`."""
    decoder = dataclasses.replace(draft.config.decoder, sliding_window=window)
    return dataclasses.replace(draft, config=dataclasses.replace(
        draft.config, decoder=decoder, layer_attention=kinds))


SLIDING, FULL = "sliding_attention", "full_attention"


@pytest.mark.parametrize("kinds, window, z_lab_causal, non_causal", [
    ((LayerAttention(4, True), LayerAttention()), 4, None, False),  # the types' defaults
    ((LayerAttention(4), LayerAttention(4)), 4, False, True),  # non-causal sliding layers
    ((), 64, None, True),  # plain layers under a windowed decoder: typed full, not sliding
])
def test_typed_layers_export_as_read(target, draft, tmp_path, kinds, window, z_lab_causal,
                                     non_causal):
    from speculators.models.dflash import DFlashSpeculatorConfig
    from transformers import Qwen3Config

    typed = _typed(draft, kinds, window)
    types = [SLIDING if typed.config.layer(i).window else FULL for i in range(DRAFT_LAYERS)]
    typed.save(str(tmp_path / "native"))
    _assert_same(eaglejax.load_draft(tmp_path / "native", target=target), typed)
    for layout, write in WRITERS.items():
        out = write(typed, tmp_path / layout)
        _assert_same(eaglejax.load_draft(out, target=target), typed)
        if layout == "z-lab":
            layers = Qwen3Config.from_pretrained(out)
            assert getattr(layers, "is_causal", None) == z_lab_causal
        else:
            config = DFlashSpeculatorConfig.from_pretrained(out)
            assert config.sliding_window_non_causal == non_causal
            layers = config.transformer_layer_config
        assert layers.layer_types == types and layers.sliding_window == window, layout


def test_bfloat16_exports_keep_their_dtype(target_dir, draft, tmp_path):
    from safetensors import safe_open

    target = eaglejax.load_target(target_dir, dtype="bfloat16")
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), draft.params)
    bf16 = dataclasses.replace(draft, params=params, target=target)
    for layout, write in WRITERS.items():
        out = write(bf16, tmp_path / layout)
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
        with safe_open(out / "model.safetensors", framework="np") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, layout
        _assert_same(eaglejax.load_draft(out, target=target), bf16)


def _speculators_model(directory):
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"  # full attention, no mask
    return DFlashDraftModel.from_pretrained(directory, config=config).float().eval()


def _oracle_block(model, hf_target, context: list[int], root: int) -> np.ndarray:
    """speculators' DFlashDraftModel modules over one block after `context`: logits
    [B-1, V] of slots 1.. (its taps are hidden-state indices, eaglejax's taps)."""
    import torch

    with torch.no_grad():
        out = hf_target(torch.tensor([context]), output_hidden_states=True)
        taps = torch.cat([out.hidden_states[i] for i in model.target_layer_ids], dim=-1)
        ctx = model.hidden_norm(model.fc(taps))
        h = model.embed_tokens(torch.tensor([[root] + [model.mask_token_id] * (BLOCK - 1)]))
        rope = model.rotary_emb(h, torch.arange(len(context) + BLOCK)[None])
        for layer in model.layers:
            h = layer(hidden_states=h, target_hidden=ctx, attention_mask=None,
                      position_embeddings=rope)
        return model.lm_head(model.norm(h))[0, 1:].numpy()


def test_speculators_loads_the_export_and_proposes_our_blocks(target, target_dir, draft,
                                                              exported):
    import torch
    from transformers import AutoModelForCausalLM

    model = _speculators_model(exported["speculators"])
    hf_target = AutoModelForCausalLM.from_pretrained(target_dir).float().eval()
    assert model.block_size == BLOCK and model.target_layer_ids == [2, 4]
    assert torch.equal(model.embed_tokens.weight, hf_target.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, hf_target.lm_head.weight)
    rs = np.random.RandomState(0)
    for n in (1, 9):
        context, root = rs.randint(0, MASK, size=n).tolist(), int(rs.randint(0, MASK))
        want = _oracle_block(model, hf_target, context, root)
        got = _proposals(draft, target, context, root)
        assert_close_scaled(got, want, units=FORWARD_UNITS, depth=TARGET_LAYERS + DRAFT_LAYERS,
                            what=f"speculators' DFlash block logits after {n} tokens")


def _proposals(draft, target, context: list[int], root: int) -> np.ndarray:
    """eaglejax's `block_logits` for one block after `context` (its context keys and values
    cached first, as tests/test_dflash.py does)."""
    c, d = draft.config, draft.config.decoder
    cache = kv_cache.init_cache(d.num_layers, 1, 64, d.num_kv_heads, d.head_dim, jnp.float32,
                                heads_axis=None)
    keys, values = context_kv(draft.params, c, target.features([context], c.tap_layers),
                              jnp.arange(len(context))[None])
    cache = kv_cache.append(cache, keys, values, jnp.array([len(context)]))
    tokens = jnp.array([[root] + [c.mask_token_id] * (c.block_size - 1)])
    positions = len(context) + jnp.arange(c.block_size)[None]
    logits, _ = block_logits(draft.params, c, target.params, tokens, positions, cache)
    return np.asarray(logits)[0]


def test_speculators_converts_the_z_lab_export(target, target_dir, draft, exported, tmp_path):
    from speculators.convert.dflash import DFlashConverter

    out = tmp_path / "converted"
    DFlashConverter().convert(exported["z-lab"], out, base_model=str(target_dir))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash"
    assert cfg["aux_hidden_state_layer_ids"] == [2, 4] and cfg["mask_token_id"] == MASK
    _assert_same(eaglejax.load_draft(out, target=target), draft)


def test_cli_converts_to_both_layouts_and_refuses_in_one_line(target, target_dir, draft,
                                                              exported, tmp_path, capsys):
    src = tmp_path / "native"
    draft.save(str(src))
    for to, layout in (("dflash", "z-lab"), ("speculators", "speculators")):
        dst = tmp_path / to
        assert main(["convert", str(src), str(dst), "--target", str(target_dir),
                     "--to", to]) == 0
        for name in ("config.json", "model.safetensors"):
            assert (dst / name).read_bytes() == (exported[layout] / name).read_bytes(), name
    capsys.readouterr()
    eagle = tmp_path / "eagle3"
    new_eagle3_draft(target).save(str(eagle))
    for head, to, match in ((src, "reference", "it is a DFlash drafter"),
                            (eagle, "dflash", "it is an eagle3 head")):
        assert main(["convert", str(head), str(tmp_path / f"refused-{to}"), "--target",
                     str(target_dir), "--to", to]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, err


def test_api_refusals_name_the_drafter_and_why(target, draft, tmp_path):
    with pytest.raises(ConfigError, match="new-dflash-seed7 .* it is a DFlash drafter"):
        export_reference(draft, tmp_path / "reference")
    with pytest.raises(ConfigError, match="taps the embeddings"):
        export_dflash(dataclasses.replace(
            draft, config=dataclasses.replace(draft.config, tap_layers=(0, 4))),
            tmp_path / "z-lab")
    biased = dataclasses.replace(draft.config.decoder, attention_bias=True)
    with pytest.raises(ConfigError, match="not Qwen3 layers"):
        export_speculators(dataclasses.replace(
            draft, config=dataclasses.replace(draft.config, decoder=biased)),
            tmp_path / "speculators")
    two_windows = _typed(draft, (LayerAttention(4), LayerAttention(8)), 4)
    for write in WRITERS.values():
        with pytest.raises(ConfigError, match=r"windows of \[4, 8\] positions"):
            write(two_windows, tmp_path / "two-windows")
    causal_full = _typed(draft, (LayerAttention(None, True), LayerAttention()), None)
    with pytest.raises(ConfigError, match="neither the layer types' default"):
        export_dflash(causal_full, tmp_path / "z-lab-causal")
    with pytest.raises(ConfigError, match="its layers are causal full, non-causal full"):
        export_speculators(causal_full, tmp_path / "speculators-causal")
