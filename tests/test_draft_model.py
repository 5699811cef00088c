"""Draft-model speculation (`SpecConfig.draft_model` / `draft_model_tree`, a `DraftModel`
drafting for a target of the same tokenizer).

The drafter contract (a well-formed tree, greedy identity) is `test_drafters`'. Here: a model
drafting for itself accepts every draft token (its cache, committed one row ahead of the
target's and rolled back with it, holds exactly what the target's does), greedy and sampled;
sampled output follows the target's exact distribution with a different draft model (chain
and tree); the vocabulary check refuses models that do not share a tokenizer; SmolLM2
drafts for a wider random model of its tokenizer; `auto`, the engine and the CLI take a
draft model.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import numpy as np
import pytest

import eaglejax
from eaglejax import ConfigError, DraftModel, InputError, SpecConfig
from eaglejax.decoding.sampling import SamplingParams
from hf_oracle import make_hf_model

V = 97


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dm-target")
    make_hf_model("llama", directory, seed=5, num_hidden_layers=2, vocab_size=V)
    return eaglejax.load_target(directory)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A narrower, shallower random model of the same vocabulary (a bad but valid drafter)."""
    directory = tmp_path_factory.mktemp("dm-small")
    make_hf_model("llama", directory, seed=6, num_hidden_layers=1, hidden_size=32,
                  intermediate_size=64, vocab_size=V)
    return eaglejax.load_target(directory)


def _prompts(n: int = 3) -> list[list[int]]:
    rs = np.random.RandomState(1)
    return [rs.randint(0, V, size=rs.randint(2, 20)).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    return [g.token_ids for g in eaglejax.generate(_prompts(), target=target,
                                                   max_new_tokens=13, ignore_eos=True)]


@pytest.mark.parametrize("k", [1, 3])
def test_a_model_drafting_for_itself_accepts_every_token(target, plain, k):
    """Greedy: the draft's argmax is the target's, so every round accepts all K tokens
    (13 new tokens: the first, then rounds of K+1); any row of the draft cache out of step
    with the target's would show as a rejection. Sampled with temperature 1: the draft's
    distribution is the target's, so min(1, p/q) accepts all but (on rounding) a few."""
    itself = DraftModel.of(target, target)
    out = eaglejax.generate(_prompts(), target=target, draft=itself,
                            speculative=SpecConfig.draft_model(k), max_new_tokens=13,
                            ignore_eos=True)
    assert [g.token_ids for g in out] == plain
    assert all(g.metrics.acceptance_length == k + 1 for g in out), [g.metrics for g in out]
    sampled = eaglejax.generate(_prompts() * 4, target=target, draft=itself,
                                speculative=SpecConfig.draft_model(k), max_new_tokens=13,
                                temperature=1.0, seed=list(range(12)), ignore_eos=True)
    assert np.mean([g.metrics.acceptance_length for g in sampled]) > k + 0.9


@pytest.mark.parametrize("spec", [SpecConfig.draft_model(2),
                                  SpecConfig.draft_model_tree(2, 2, 4)],
                         ids=SpecConfig.describe)
def test_sampling_with_a_draft_model_is_exact(target, small, spec):
    from test_speculative_sampling import assert_follows, exact_marginals, sample_rows

    prompt = _prompts(1)[0]
    out = sample_rows(prompt, target=target, draft=DraftModel.of(small, target), speculative=spec,
                      max_new_tokens=2, temperature=1.0, top_k=3)
    assert_follows(np.array([g.token_ids for g in out]),
                   exact_marginals(target, SamplingParams.make(1.0, 3), 2, prompt))


def test_auto_and_the_engine_take_a_draft_model(target, small, plain):
    from eaglejax.serving.engine import Engine, Request

    drafter = DraftModel.of(small, target)
    out = eaglejax.generate(_prompts(), target=target, draft=drafter, speculative="auto",
                            max_new_tokens=13, ignore_eos=True)
    assert [g.token_ids for g in out] == plain
    assert "draft model tree" in out[0].metrics.speculative  # auto's modes: its trees
    engine = Engine(target, drafter, speculative=SpecConfig.draft_model_tree(3, 3, 8),
                    num_slots=2, capacity=64)
    served = engine.run([Request(i, p, 13, ignore_eos=True) for i, p in enumerate(_prompts())])
    assert [served[i].token_ids for i in range(3)] == plain


def test_what_drafts_must_match_the_method(target, small):
    drafter = DraftModel.of(small, target)
    with pytest.raises(InputError, match=r"drafts with a draft model: pass "
                                         r"draft=eaglejax.load_draft_model"):
        eaglejax.generate([[1, 2]], target=target, speculative=SpecConfig.draft_model(2))
    with pytest.raises(InputError, match="drafts with a draft head.*not a draft model"):
        eaglejax.generate([[1, 2]], target=target, draft=drafter,
                          speculative=SpecConfig.chain(2))
    with pytest.raises(InputError, match="a draft model drafts chains and dynamic trees"):
        SpecConfig.parallel(3).drafted_by_model()
    with pytest.raises(ConfigError, match="loaded for target"):
        eaglejax.generate([[1, 2]], target=small, draft=drafter,
                          speculative=SpecConfig.draft_model(2))


def test_models_that_share_no_vocabulary_are_refused(target, tmp_path):
    make_hf_model("llama", tmp_path / "other", seed=7, num_hidden_layers=1, hidden_size=32,
                  intermediate_size=64, vocab_size=V + 3)
    other = eaglejax.load_target(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"vocab_size 100 != 97 \(and neither has a "
                                          r"tokenizer\)"):
        DraftModel.of(other, target)
    with pytest.raises(ConfigError, match="wants two Targets"):
        DraftModel.of(str(tmp_path / "other"), target)


@pytest.fixture(scope="module")
def wider(smollm2, tmp_path_factory):
    """A random Llama wider than SmolLM2-135M (hidden 640 vs 576), saved with SmolLM2's own
    tokenizer."""
    directory = tmp_path_factory.mktemp("dm-wider")
    make_hf_model("llama", directory, seed=8, num_hidden_layers=2, hidden_size=640,
                  intermediate_size=1280, num_attention_heads=10, num_key_value_heads=5,
                  vocab_size=smollm2.config.vocab_size, tie_word_embeddings=True)
    tokenizer = smollm2.tokenizer
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}))
    return eaglejax.load_target(directory)


def test_smollm2_drafts_for_a_wider_model_of_its_tokenizer(smollm2, wider):
    prompts = ["The capital of France is", "def add(a, b):"]
    want = eaglejax.generate(prompts, target=wider, max_new_tokens=8, chat=False,
                             ignore_eos=True)
    drafter = DraftModel.of(smollm2, wider)
    got = eaglejax.generate(prompts, target=wider, draft=drafter,
                            speculative=SpecConfig.draft_model(3), max_new_tokens=8,
                            chat=False, ignore_eos=True)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    from eaglejax import cli

    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli.main(["generate", prompts[1], "--model", str(wider.source), "--draft-model",
                         "smollm2-135m-instruct", "--num-draft-tokens", "3", "--no-chat",
                         "--weight-dtype", "float32", "--max-new-tokens", "8", "--ignore-eos",
                         "--json"]) == 0
    result = json.loads(printed.getvalue())[0]
    assert result["token_ids"] == want[1].token_ids
    assert result["metrics"]["speculative"] == "draft_model K=3"


def test_a_tokenizer_that_differs_is_refused(smollm2, wider, tmp_path):
    """The same vocabulary size, two tokens' ids swapped: refused, naming the difference;
    a model without a tokenizer cannot be checked against one that has one."""
    directory = tmp_path / "swapped"
    shutil.copytree(wider.source, directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["the"], vocab["and"] = vocab["and"], vocab["the"]
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    swapped = eaglejax.load_target(directory)
    with pytest.raises(ConfigError, match=r"cannot draft for .*tokenizers differ in 4 "
                                          r"\(token, id\) pairs"):
        DraftModel.of(swapped, wider)
    (directory / "tokenizer.json").unlink()
    (directory / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="has no tokenizer, so the two vocabularies"):
        DraftModel.of(eaglejax.load_target(directory), wider)
