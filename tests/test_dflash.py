"""DFlash drafting (`eaglejax.draft.dflash`, methods "dflash" and "dflash_tree").

Oracle: the `speculators` package's own DFlash decoder layer (`Qwen3DFlashDecoderLayer`,
the one its trainer runs; the target's taps injected as keys and values in every layer),
composed with torch's fc, norms and rotary tables into one block proposal the way the
public inference loops run it (the last accepted token, then mask tokens, at the positions
after the context, every block token seeing the context and the whole block). A random
drafter saved in the z-lab layout and in the speculators layout loads through
`load_draft` and proposes the oracle's logits within float32 noise units. So does one whose
layers are typed (a sliding layer with a window of 4 over 9 context tokens and a block of
6, then a full one), its layers run under speculators' own block mask
(`create_anchor_block_mask_mod`: which layers are causal in the block) and the per-query
window of z-lab's published rule (reimplemented here: `_z_lab_window`). Greedy DFlash
speculation is plain decoding, with typed layers too; sampled output follows the target's
exact distribution; the layouts' mistakes are refused in one line.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import eaglejax
from eaglejax import ConfigError, SpecConfig
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.draft.config import LayerAttention
from eaglejax.draft.dflash import block_logits, context_kv
from eaglejax.draft.draft import new_dflash_draft, new_eagle3_draft
from eaglejax.models import kv_cache
from hf_oracle import make_hf_model
from tolerances import FORWARD_UNITS, assert_close_scaled

V, MASK, BLOCK = 97, 96, 6
TARGET_LAYER_IDS = [0, 1]  # layer outputs tapped (z-lab's ids): entering-layer taps (1, 2)
TYPES, WINDOW = ["sliding_attention", "full_attention"], 4  # the typed drafter's layers


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dflash-target")
    make_hf_model("qwen3", directory, seed=3, vocab_size=V)
    return directory


@pytest.fixture(scope="module")
def target(target_dir):
    return eaglejax.load_target(target_dir)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir).float().eval()


def _torch_drafter(seed: int, layer_types: list[str] | None = None):
    """A random DFlash drafter from speculators' layers (2 layers, the target's shapes);
    with `layer_types`, typed so (sliding layers with a window of WINDOW)."""
    import torch
    from speculators.models.dflash.model_definitions import Qwen3DFlashDecoderLayer
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    typed = {} if layer_types is None else dict(layer_types=layer_types, sliding_window=WINDOW,
                                                use_sliding_window=True)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         vocab_size=V, max_position_embeddings=512, rms_norm_eps=1e-6, **typed)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    drafter = torch.nn.Module()
    drafter.layers = torch.nn.ModuleList(Qwen3DFlashDecoderLayer(config, i) for i in range(2))
    drafter.fc = torch.nn.Linear(len(TARGET_LAYER_IDS) * 64, 64, bias=False)
    drafter.hidden_norm = Qwen3RMSNorm(64, eps=1e-6)
    drafter.norm = Qwen3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.1 * torch.randn_like(p))
    return drafter.float().eval(), config


def _save(drafter, config, directory, layout: str, **top_level):
    """The drafter in `layout`, with `top_level` entries added to its config.json."""
    from safetensors.torch import save_file

    directory.mkdir()
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()},
              str(directory / "model.safetensors"))
    layer = {k: v for k, v in config.to_dict().items() if not k.startswith("_")}
    if layout == "z-lab":
        cfg = {**layer, "architectures": ["DFlashDraftModel"], "block_size": BLOCK,
               "dflash_config": {"mask_token_id": MASK, "target_layer_ids": TARGET_LAYER_IDS}}
    else:
        cfg = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
               "transformer_layer_config": layer, "block_size": BLOCK, "draft_vocab_size": V,
               "aux_hidden_state_layer_ids": [i + 1 for i in TARGET_LAYER_IDS],
               "mask_token_id": MASK}
    (directory / "config.json").write_text(json.dumps({**cfg, **top_level}))


def _z_lab_window(n: int, causal: bool):
    """[B, n+B] bool: the keys (context 0..n-1, then the block) inside the sliding window of
    each block query (at n..n+B-1). A reimplementation, for this test only, of the rule
    z-lab publishes (z-lab/dflash `dflash/model.py`, `_attention_mask`): a key at most
    WINDOW - 1 positions before the query, or after it when the layer is not causal."""
    import torch

    ahead = torch.arange(n + BLOCK)[None, :] - (n + torch.arange(BLOCK))[:, None]
    return (-ahead < WINDOW) & ((ahead < WINDOW) | causal)


def _oracle_masks(n: int, non_causal: bool) -> list:
    """Per layer of the typed drafter, its additive float mask [1, 1, B, n+B] over one block
    after n context tokens: speculators' anchor block mask (its eager path's float mask) for
    the layer's type, the sliding layer's window the per-query one (`_z_lab_window`) in
    place of speculators' anchor-relative one."""
    import torch
    from speculators.models.attention import create_float_mask
    from speculators.models.dflash.attention import create_anchor_block_mask_mod

    masks = []
    for kind in TYPES:
        sliding = kind == "sliding_attention"
        # One document of the n context tokens and the block's anchor token x_n (its
        # features exist only at training time, and its block hides them: key n is dropped).
        mask_mod, q_len, kv_len = create_anchor_block_mask_mod(
            torch.zeros(n + 1, dtype=torch.long), n + 1, torch.tensor([n]), BLOCK,
            sliding_window=n + BLOCK if sliding else None,  # a window that hides nothing
            sliding_window_non_causal=non_causal)
        mask = create_float_mask(mask_mod, Q_LEN=q_len, KV_LEN=kv_len, device="cpu",
                                 dtype=torch.float32)
        assert torch.all(mask[..., n] == float("-inf"))
        mask = torch.cat([mask[..., :n], mask[..., n + 1:]], dim=-1)
        if sliding:
            mask = mask.masked_fill(~_z_lab_window(n, not non_causal), float("-inf"))
        masks.append(mask)
    return masks


def _oracle_block(drafter, config, hf_target, context: list[int], root: int,
                  masks: list | None = None) -> np.ndarray:
    """speculators' layers over one block after `context`: logits [B-1, V] of slots 1..;
    layer i under masks[i] (None: every key seen)."""
    import torch
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    with torch.no_grad():
        out = hf_target(torch.tensor([context]), output_hidden_states=True)
        taps = torch.cat([out.hidden_states[i + 1] for i in TARGET_LAYER_IDS], dim=-1)
        ctx = drafter.hidden_norm(drafter.fc(taps))
        block = torch.tensor([[root] + [MASK] * (BLOCK - 1)])
        h = hf_target.model.embed_tokens(block)
        positions = torch.arange(len(context) + BLOCK)[None]
        rope = Qwen3RotaryEmbedding(config)(h, positions)
        for i, layer in enumerate(drafter.layers):
            h = layer(hidden_states=h, target_hidden=ctx,
                      attention_mask=None if masks is None else masks[i],
                      position_embeddings=rope)
        return hf_target.lm_head(drafter.norm(h))[0, 1:].numpy()


def _proposals(draft, target, context: list[int], root: int) -> np.ndarray:
    c = draft.config
    features = target.features([context], c.tap_layers)
    d = c.decoder
    cache = kv_cache.init_cache(d.num_layers, 1, 64, d.num_kv_heads, d.head_dim, jnp.float32,
                                heads_axis=None)
    keys, values = context_kv(draft.params, c, features,
                              jnp.arange(len(context))[None])
    cache = kv_cache.append(cache, keys, values, jnp.array([len(context)]))
    tokens = jnp.array([[root] + [MASK] * (BLOCK - 1)])
    positions = len(context) + jnp.arange(BLOCK)[None]
    logits, _ = block_logits(draft.params, c, target.params, tokens, positions, cache)
    return np.asarray(logits)[0]


@pytest.mark.parametrize("layout", ["z-lab", "speculators"])
def test_block_proposals_equal_the_oracle(target, hf_target, layout, tmp_path):
    drafter, config = _torch_drafter(seed=4)
    _save(drafter, config, tmp_path / "drafter", layout)
    draft = eaglejax.load_draft(tmp_path / "drafter", target=target)
    assert draft.config.kind == "dflash" and draft.config.block_size == BLOCK
    assert draft.config.tap_layers == (1, 2) and draft.config.mask_token_id == MASK
    assert draft.config.layer_attention == ()  # every layer "full_attention": plain
    rs = np.random.RandomState(0)
    for n in (1, 9):
        context, root = rs.randint(0, MASK, size=n).tolist(), int(rs.randint(0, MASK))
        want = _oracle_block(drafter, config, hf_target, context, root)
        got = _proposals(draft, target, context, root)
        assert_close_scaled(got, want, units=FORWARD_UNITS, depth=2 + 3,
                            what=f"DFlash block logits after {n} tokens ({layout})")


@pytest.mark.parametrize("layout, causality", [
    ("z-lab", {}), ("z-lab", {"is_causal": False}),
    ("speculators", {}), ("speculators", {"sliding_window_non_causal": True})])
def test_typed_layers_propose_what_their_masks_give(target, hf_target, layout, causality,
                                                    tmp_path):
    """A sliding layer (causal in the block by each layout's default) and a full one: the
    window hides context keys and, as WINDOW < BLOCK, block keys."""
    drafter, config = _torch_drafter(seed=6, layer_types=TYPES)
    _save(drafter, config, tmp_path / "drafter", layout, **causality)
    draft = eaglejax.load_draft(tmp_path / "drafter", target=target)
    non_causal = bool(causality)
    assert draft.config.layer_attention == (LayerAttention(WINDOW, not non_causal),
                                            LayerAttention())
    rs = np.random.RandomState(1)
    context, root = rs.randint(0, MASK, size=9).tolist(), int(rs.randint(0, MASK))
    want = _oracle_block(drafter, config, hf_target, context, root,
                         _oracle_masks(len(context), non_causal))
    assert_close_scaled(_proposals(draft, target, context, root), want, units=FORWARD_UNITS,
                        depth=2 + 3, what=f"typed DFlash block logits ({layout}, {causality})")


@pytest.fixture(scope="module")
def dflash(target):
    return new_dflash_draft(target, num_layers=2, block_size=BLOCK, mask_token_id=MASK,
                            seed=2, scale=0.05)


def _prompts(n: int = 3) -> list[list[int]]:
    rs = np.random.RandomState(2)
    return [rs.randint(0, MASK, size=rs.randint(2, 20)).tolist() for _ in range(n)]


def test_greedy_dflash_is_plain_decoding(target, dflash):
    plain = eaglejax.generate(_prompts(), target=target, max_new_tokens=12, ignore_eos=True)
    for spec in (SpecConfig.dflash(5), SpecConfig.dflash_tree(3, 4, 10), None, "auto"):
        out = eaglejax.generate(_prompts(), target=target, draft=dflash, speculative=spec,
                                max_new_tokens=12, ignore_eos=True)
        assert [g.token_ids for g in out] == [g.token_ids for g in plain], spec
    assert out[0].metrics.speculative.startswith("auto")
    typed = dataclasses.replace(dflash, config=dataclasses.replace(
        dflash.config, layer_attention=(LayerAttention(4, True), LayerAttention())))
    out = eaglejax.generate(_prompts(), target=target, draft=typed, max_new_tokens=12,
                            speculative=SpecConfig.dflash_tree(3, 4, 10), ignore_eos=True)
    assert [g.token_ids for g in out] == [g.token_ids for g in plain], "typed layers"


def test_sampling_with_dflash_is_exact(target, dflash):
    """A sampled chain of the block's proposals (trees over them sample as every lattice
    tree does: tests/test_peagle.py)."""
    from test_speculative_sampling import assert_follows, exact_marginals, sample_rows

    spec = SpecConfig.dflash(2)
    prompt = _prompts(1)[0]
    out = sample_rows(prompt, target=target, draft=dflash, speculative=spec, max_new_tokens=2,
                      temperature=1.0, top_k=3)
    assert_follows(np.array([g.token_ids for g in out]),
                   exact_marginals(target, SamplingParams.make(1.0, 3), 2, prompt))


def test_shapes_and_heads_must_agree(target, dflash):
    eagle = new_eagle3_draft(target)
    with pytest.raises(ConfigError, match="do not go together"):
        eaglejax.generate([[1, 2]], target=target, draft=eagle, speculative=SpecConfig.dflash(3))
    with pytest.raises(ConfigError, match="do not go together"):
        eaglejax.generate([[1, 2]], target=target, draft=dflash, speculative=SpecConfig.chain(3))
    with pytest.raises(ConfigError, match=f"fills blocks of {BLOCK} tokens"):
        eaglejax.generate([[1, 2]], target=target, draft=dflash,
                          speculative=SpecConfig.dflash(BLOCK))


def _layers(cfg: dict) -> dict:
    """The layer entries of a config.json of either layout."""
    return cfg.get("transformer_layer_config", cfg)


def test_neutral_dflash2_scalars_read_as_absent(target, tmp_path):
    drafter, config = _torch_drafter(seed=5)
    _save(drafter, config, tmp_path / "drafter", "z-lab")
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    cfg["dflash_config"].update(input_embedding_scale=1.0, output_multiplier=1,
                                final_logit_softcapping=None)
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(cfg))
    assert eaglejax.load_draft(tmp_path / "drafter", target=target).dflash


@pytest.mark.parametrize("layout, edit, match", [
    ("z-lab", lambda c: c["dflash_config"].pop("target_layer_ids"),
     "tapped target layers are missing"),
    ("z-lab", lambda c: c["dflash_config"].update(mask_token_id=V),
     "mask token id must be a token"),
    ("z-lab", lambda c: c.update(block_size=1), "'block_size' must be an integer >= 2"),
    ("z-lab", lambda c: c.update(num_hidden_layers=3, layer_types=None), "layers.2"),
    ("z-lab", lambda c: c.update(layer_types=TYPES[:1]),
     "config.json: 'layer_types' must list one type for each of the 2 layers"),
    ("speculators", lambda c: _layers(c).update(layer_types=["full_attention", "chunked"]),
     r"\(transformer_layer_config\): 'layer_types'\[1\] is 'chunked'"),
    ("z-lab", lambda c: c.update(layer_types=TYPES),  # use_sliding_window false: no window
     "layer 0 is 'sliding_attention' but the config holds no window"),
    ("speculators", lambda c: _layers(c).update(layer_types=TYPES, use_sliding_window=True,
                                                sliding_window=0),
     "'sliding_window' must be a positive integer"),
    ("z-lab", lambda c: c.update(is_causal="yes"), "'is_causal' must be true or false"),
    ("speculators", lambda c: c.update(sliding_window_non_causal=1),
     "'sliding_window_non_causal' must be true or false"),
    ("z-lab", lambda c: c["dflash_config"].update(is_causal=True),
     "'dflash_config.is_causal' is True but the top level's 'is_causal' reads as None"),
    ("z-lab", lambda c: c["dflash_config"].update(use_swa=True),
     "'dflash_config.use_swa' \\(vLLM's switch\\) is not read"),
    ("z-lab", lambda c: c["dflash_config"].update(conv_kernel_size=2, selector_rank=256),
     "'dflash_config.conv_kernel_size' belongs to a DFlash2 drafter"),
    ("z-lab", lambda c: c["dflash_config"].update(input_embedding_scale=2.5),
     "'dflash_config.input_embedding_scale' is 2.5; eaglejax's DFlash drafter does not apply"),
    ("speculators", lambda c: c.update(final_logit_softcapping=30.0),
     "'final_logit_softcapping' is 30.0"),
])
def test_layout_mistakes_are_refused_in_one_line(target, tmp_path, layout, edit, match):
    drafter, config = _torch_drafter(seed=5)
    _save(drafter, config, tmp_path / "drafter", layout)
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    edit(cfg)
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(eaglejax.EaglejaxError, match=match):
        eaglejax.load_draft(tmp_path / "drafter", target=target)
