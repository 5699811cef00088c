"""DFlash drafting (`eaglejax.draft.dflash`, methods "dflash" and "dflash_tree").

Oracle: the `speculators` package's own DFlash decoder layer (`Qwen3DFlashDecoderLayer`,
the one its trainer runs; the target's taps injected as keys and values in every layer),
composed with torch's fc, norms and rotary tables into one block proposal the way the
public inference loops run it (the last accepted token, then mask tokens, at the positions
after the context, every block token seeing the context and the whole block). A random
drafter saved in the z-lab layout and in the speculators layout loads through
`load_draft` and proposes the oracle's logits within float32 noise units. Greedy DFlash
speculation is plain decoding; sampled output follows the target's exact distribution;
the layouts' mistakes are refused in one line.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import eaglejax
from eaglejax import ConfigError, SpecConfig
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.draft.dflash import block_logits, context_kv
from eaglejax.draft.draft import new_dflash_draft, new_eagle3_draft
from eaglejax.models import kv_cache
from hf_oracle import make_hf_model
from tolerances import FORWARD_UNITS, assert_close_scaled

V, MASK, BLOCK = 97, 96, 6
TARGET_LAYER_IDS = [0, 1]  # layer outputs tapped (z-lab's ids): entering-layer taps (1, 2)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dflash-target")
    make_hf_model("qwen3", directory, seed=3, vocab_size=V)
    return directory


@pytest.fixture(scope="module")
def target(target_dir):
    return eaglejax.load_target(target_dir)


def _torch_drafter(seed: int):
    """A random DFlash drafter from speculators' layers (2 layers, the target's shapes)."""
    import torch
    from speculators.models.dflash.model_definitions import Qwen3DFlashDecoderLayer
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         vocab_size=V, max_position_embeddings=512, rms_norm_eps=1e-6)
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


def _save(drafter, config, directory, layout: str):
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
    (directory / "config.json").write_text(json.dumps(cfg))


def _oracle_block(drafter, config, hf_target, context: list[int], root: int) -> np.ndarray:
    """speculators' layers over one block after `context`: logits [B-1, V] of slots 1.."""
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
        for layer in drafter.layers:
            h = layer(hidden_states=h, target_hidden=ctx, attention_mask=None,
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
def test_block_proposals_equal_the_oracle(target, target_dir, layout, tmp_path):
    from transformers import AutoModelForCausalLM

    drafter, config = _torch_drafter(seed=4)
    _save(drafter, config, tmp_path / "drafter", layout)
    draft = eaglejax.load_draft(tmp_path / "drafter", target=target)
    assert draft.config.kind == "dflash" and draft.config.block_size == BLOCK
    assert draft.config.tap_layers == (1, 2) and draft.config.mask_token_id == MASK
    hf_target = AutoModelForCausalLM.from_pretrained(target_dir).float().eval()
    rs = np.random.RandomState(0)
    for n in (1, 9):
        context, root = rs.randint(0, MASK, size=n).tolist(), int(rs.randint(0, MASK))
        want = _oracle_block(drafter, config, hf_target, context, root)
        got = _proposals(draft, target, context, root)
        assert_close_scaled(got, want, units=FORWARD_UNITS, depth=2 + 3,
                            what=f"DFlash block logits after {n} tokens ({layout})")


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


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["dflash_config"].pop("target_layer_ids"), "tapped target layers are missing"),
    (lambda c: c["dflash_config"].update(mask_token_id=V), "mask token id must be a token"),
    (lambda c: c.update(block_size=1), "'block_size' must be an integer >= 2"),
    (lambda c: c.update(num_hidden_layers=3), "layers.2"),
])
def test_layout_mistakes_are_refused_in_one_line(target, tmp_path, edit, match):
    drafter, config = _torch_drafter(seed=5)
    _save(drafter, config, tmp_path / "drafter", "z-lab")
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    edit(cfg)
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(eaglejax.EaglejaxError, match=match):
        eaglejax.load_draft(tmp_path / "drafter", target=target)
