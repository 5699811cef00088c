"""DFlash drafters with a reduced draft vocabulary (issue 31): their own `lm_head` [DV, H]
over DV target tokens (`d2t`), as the speculators package trains and saves them.

Oracle: speculators loads our speculators export with its own
`DFlashDraftModel.from_pretrained` (its lm_head, d2t and t2d from the file, the embedding
from the verifier, i.e. our target directory), and its modules over one block after a
context propose eaglejax's `block_logits` (draft-vocabulary logits) within float32 noise
units. The drafter round-trips through eaglejax's format and the speculators layout; the
z-lab layout, which cannot hold it, refuses it. Greedy DFlash speculation (chain and
tree) over the draft vocabulary is plain decoding, sampling follows the target's exact
distribution, and a training run with `draft_vocab_size` < V trains such a drafter over
the most frequent supervised tokens. Files that cannot be right are refused naming the
file and the key.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import eaglejax
from eaglejax import ConfigError, EaglejaxError, SpecConfig
from eaglejax.cli import main
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.draft.draft import new_dflash_draft
from eaglejax.draft.formats import export_dflash, export_speculators
from eaglejax.loading.safetensors_file import save_safetensors
from eaglejax.training.trainer import TrainConfig, train
from eaglejax.training.vocab import select_draft_vocab
from hf_oracle import make_hf_model
from test_dflash_export import BLOCK, DRAFT_LAYERS, MASK, TARGET_LAYERS, V, _assert_same
from test_dflash_export import _oracle_block, _proposals, _speculators_model
from tolerances import FORWARD_UNITS, assert_close_scaled

DV = 40
# A draft vocabulary of every other token and then some: the target's likely tokens fall
# both inside and outside it.
USED = np.sort(np.random.RandomState(5).choice(MASK, DV, replace=False))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dflash-vocab-target")
    make_hf_model("qwen3", directory, seed=3, vocab_size=V, num_hidden_layers=TARGET_LAYERS)
    return directory


@pytest.fixture(scope="module")
def target(target_dir):
    return eaglejax.load_target(target_dir)


@pytest.fixture(scope="module")
def draft(target):
    """A random reduced-vocabulary drafter whose lm_head is its own (the target's rows of
    its tokens, perturbed)."""
    draft = new_dflash_draft(target, num_layers=DRAFT_LAYERS, block_size=BLOCK,
                             mask_token_id=MASK, used_tokens=USED, seed=7, scale=0.1)
    c = draft.config
    assert c.reduced_vocab and c.draft_vocab_size == DV
    rows = np.asarray(target.params.get("lm_head", target.params["embed"]))[USED]
    assert np.array_equal(np.asarray(draft.params["lm_head"]), rows)
    noise = 0.05 * np.random.RandomState(8).randn(*rows.shape).astype(np.float32)
    params = dict(draft.params, lm_head=jnp.asarray(rows + noise))
    return dataclasses.replace(draft, params=params)


@pytest.fixture(scope="module")
def exported(draft, tmp_path_factory):
    return export_speculators(draft, tmp_path_factory.mktemp("dflash-vocab") / "speculators")


def test_full_vocabulary_drafters_have_no_head_of_their_own(target):
    full = new_dflash_draft(target, num_layers=DRAFT_LAYERS, block_size=BLOCK,
                            mask_token_id=MASK, used_tokens=np.arange(V))
    assert not full.config.reduced_vocab and "lm_head" not in full.params
    assert not np.asarray(full.d2t).any() and full.d2t.shape == (V,)


def test_round_trips_through_eaglejax_and_speculators_layouts(target, draft, exported,
                                                             tmp_path):
    from safetensors import safe_open

    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["draft_vocab_size"] == DV
    with safe_open(exported / "model.safetensors", framework="np") as f:
        assert f.get_tensor("lm_head.weight").shape == (DV, 64)
        assert np.array_equal(np.arange(DV) + f.get_tensor("d2t"), USED)
        assert np.array_equal(np.flatnonzero(f.get_tensor("t2d")), USED)
    draft.save(str(tmp_path / "native"))
    for directory in (tmp_path / "native", exported):
        loaded = eaglejax.load_draft(directory, target=target)
        _assert_same(loaded, draft)
        assert np.array_equal(np.asarray(loaded.d2t), np.asarray(draft.d2t))


def test_speculators_loads_the_export_and_proposes_our_blocks(target, target_dir, draft,
                                                              exported):
    import torch
    from transformers import AutoModelForCausalLM

    model = _speculators_model(exported)
    hf_target = AutoModelForCausalLM.from_pretrained(target_dir).float().eval()
    assert model.use_draft_vocab and model.draft_vocab_size == DV
    assert np.array_equal(model.lm_head.weight.numpy(), np.asarray(draft.params["lm_head"]))
    assert np.array_equal(np.arange(DV) + model.d2t.numpy(), USED)
    assert torch.equal(model.embed_tokens.weight, hf_target.model.embed_tokens.weight)
    rs = np.random.RandomState(0)
    for n in (1, 9):
        context, root = rs.randint(0, MASK, size=n).tolist(), int(rs.randint(0, MASK))
        want = _oracle_block(model, hf_target, context, root)
        got = _proposals(draft, target, context, root)
        assert got.shape == want.shape == (BLOCK - 1, DV)
        assert_close_scaled(got, want, units=FORWARD_UNITS, depth=TARGET_LAYERS + DRAFT_LAYERS,
                            what=f"speculators' reduced-vocabulary DFlash block after {n}")


def _prompts(n: int = 3) -> list[list[int]]:
    rs = np.random.RandomState(2)
    return [rs.randint(0, MASK, size=rs.randint(2, 20)).tolist() for _ in range(n)]


def test_greedy_dflash_is_plain_decoding(target, draft):
    plain = eaglejax.generate(_prompts(), target=target, max_new_tokens=12, ignore_eos=True)
    for spec in (SpecConfig.dflash(3), SpecConfig.dflash_tree(3, 3, 8)):
        out = eaglejax.generate(_prompts(), target=target, draft=draft, speculative=spec,
                                max_new_tokens=12, ignore_eos=True)
        assert [g.token_ids for g in out] == [g.token_ids for g in plain], spec


def test_sampling_with_a_reduced_vocabulary_is_exact(target, draft):
    """A sampled chain drafts only tokens of the draft vocabulary; the target's mass
    outside it comes from the residual distribution."""
    from test_speculative_sampling import assert_follows, exact_marginals, sample_rows

    prompt = _prompts(1)[0]
    out = sample_rows(prompt, target=target, draft=draft, speculative=SpecConfig.dflash(2),
                      max_new_tokens=2, temperature=1.0, top_k=3)
    samples = np.array([g.token_ids for g in out])
    marginals = exact_marginals(target, SamplingParams.make(1.0, 3), 2, prompt)
    assert any(np.isin(np.flatnonzero(m), USED).any() and not np.isin(np.flatnonzero(m), USED).all()
               for m in marginals)  # the target's support lies partly outside the vocabulary
    assert_follows(samples, marginals)


def _rewrite(directory, tensors=None, **config):
    """The speculators export in `directory` with `tensors` replaced (None: removed) and
    `config` entries set."""
    from safetensors.numpy import load_file

    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, **config}))
    weights = load_file(directory / "model.safetensors")
    for name, value in (tensors or {}).items():
        weights.pop(name)
        if value is not None:
            weights[name] = value
    save_safetensors(directory / "model.safetensors", weights)


@pytest.mark.parametrize("tensors, config, match", [
    (dict(d2t=None), {}, "model.safetensors: draft_vocab_size 40 < vocab_size 97 but the "
                         "head has no 'd2t' tensor"),
    (dict(d2t=np.full(DV, V, np.int64)), {}, r"model.safetensors: 'd2t' maps draft ids to "
                                              r"target ids in \[97, 136\], outside \[0, 97\)"),
    (dict(d2t=np.zeros(DV + 1, np.int64)), {}, r"'d2t' must be an integer tensor of shape "
                                                r"\(40,\)"),
    (dict(t2d=np.ones(V - 1, bool)), {}, r"model.safetensors: tensor 't2d' has shape \(96,\)"),
    ({"lm_head.weight": None}, {}, "lm_head.weight"),
    ({"lm_head.weight": np.zeros((DV + 1, 64), np.float32)}, {}, "lm_head.weight"),
    ({}, dict(draft_vocab_size=V + 1), r"config.json: 'draft_vocab_size' must be an integer "
                                       r"in \[1, vocab_size 97\], got 98"),
])
def test_files_that_cannot_be_right_are_refused(target, exported, tmp_path, tensors, config,
                                                 match):
    import shutil

    directory = tmp_path / "drafter"
    shutil.copytree(exported, directory)
    _rewrite(directory, tensors, **config)
    with pytest.raises(EaglejaxError, match=match) as err:
        eaglejax.load_draft(directory, target=target)
    assert str(directory) in str(err.value)


def test_the_z_lab_layout_refuses_in_one_line(target_dir, draft, tmp_path, capsys):
    with pytest.raises(ConfigError, match="draft vocabulary is reduced .40 of 97 tokens.*"
                                          "use the speculators layout"):
        export_dflash(draft, tmp_path / "z-lab")
    draft.save(str(tmp_path / "native"))
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "out"), "--target",
                 str(target_dir), "--to", "dflash"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "draft vocabulary is reduced" in err, err


def test_training_with_a_draft_vocabulary_size_trains_a_reduced_drafter(tmp_path):
    from test_training import V as TINY_V
    from test_training import make_tiny_target, sample_rows

    target = make_tiny_target()
    rows = sample_rows(target, 16)
    common = dict(seq_len=64, batch_size=2, steps=2, lr=1e-3, block_size=BLOCK,
                  mask_token_id=TINY_V - 1, num_layers=1, num_anchors=4, eval_every=0,
                  checkpoint_every=2)
    full, reduced = TrainConfig(**common), TrainConfig(**common, draft_vocab_size=24)
    assert full.draft_vocab(TINY_V) == TINY_V and "draft_vocab_size" not in full.identity()
    assert reduced.identity()["draft_vocab_size"] == 24
    assert TrainConfig().identity()["draft_vocab_size"] == 8192  # EAGLE-3's, as before
    result = train(target, rows, tmp_path / "run", reduced, progress=False)
    head = eaglejax.load_draft(result.out / "head", target=target)
    assert head.dflash and head.config.draft_vocab_size == 24
    want = select_draft_vocab(rows, TINY_V, 24).used
    assert np.array_equal(np.arange(24) + np.asarray(head.d2t), want)
    assert head.params["lm_head"].shape == (24, target.config.hidden_size)
    losses = [e["loss"] for e in result.log if "loss" in e]
    assert losses and np.isfinite(losses).all()


@pytest.mark.parametrize("flags, want", [([], None), (["--draft-vocab-size", "24"], 24)])
def test_cli_trains_dflash_over_the_draft_vocabulary_size_given(target, tmp_path, monkeypatch,
                                                                flags, want):
    """`train-draft --method dflash` reads out through the target's head unless given
    `--draft-vocab-size` (the run itself: the test above)."""
    import types

    import eaglejax.cli as cli

    seen = []
    monkeypatch.setattr(cli, "load_target", lambda *args, **kwargs: target)
    monkeypatch.setattr(cli, "prepare_rows", lambda *args, **kwargs: "the rows")
    monkeypatch.setattr(cli, "train", lambda target, rows, out, config, **kwargs: (
        seen.append(config) or types.SimpleNamespace(log=[], out=tmp_path)))
    data = tmp_path / "data.jsonl"
    data.write_text("")
    assert main(["train-draft", "--data", str(data), "--out", str(tmp_path / "run"),
                 "--method", "dflash", "--mask-token-id", "3", "--eval-questions", "0",
                 *flags]) == 0
    assert seen[0].method == "dflash" and seen[0].draft_vocab_size == want
    assert seen[0].draft_vocab(V) == (want or V)
