"""The default real model, SmolLM2-135M-Instruct from its GGUF, against transformers."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import eaglejax
from conftest import share_native_builds
from tolerances import FORWARD_UNITS, assert_close_scaled

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
]


def _logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_logits_match_transformers(prompt, smollm2, smollm2_hf):
    """eaglejax's logits are within float32 noise (tolerances.FORWARD_UNITS through 30
    layers) of transformers' float64 forward and of its float32 one. Logits reach about 40
    and residual streams 25,000: the largest differences, 9e-5 here and 1.6e-4 on an Intel
    Xeon, are 4 to 6 units of 2.6e-5; the bound is 40 units, 1.05e-3."""
    ids = np.array([smollm2.tokenizer.render_prompt(prompt, chat=True)])
    want = _logits(smollm2_hf, ids)
    exact = _logits(smollm2_hf.double(), ids)
    smollm2_hf.float()
    got = np.asarray(smollm2.logits(ids))
    depth = smollm2.config.num_layers
    assert_close_scaled(got, exact, units=FORWARD_UNITS, depth=depth, what="vs float64")
    assert_close_scaled(got, want, units=FORWARD_UNITS, depth=depth, what="vs float32")


@pytest.mark.parametrize("wrong", [dict(rms_norm_eps=1e-6), dict(rope_theta=10000.0)],
                         ids=["rms_norm_eps", "rope_theta"])
def test_logits_check_rejects_a_wrong_norm_epsilon_or_rope_base(wrong, smollm2, smollm2_hf):
    """Negative control: the check above fails for SmolLM2 run with Llama's usual defaults
    instead of its own rms_norm_eps 1e-5 (3.1e-2 off: 1,270 units) or rope_theta 1e5 (10 off:
    about 400,000 units)."""
    ids = np.array([smollm2.tokenizer.render_prompt(CHAT_PROMPTS[0], chat=True)])
    config = dataclasses.replace(smollm2.config, **wrong)
    bad = np.asarray(dataclasses.replace(smollm2, config=config).logits(ids))
    with pytest.raises(AssertionError, match="noise units"):
        assert_close_scaled(bad, _logits(smollm2_hf, ids), units=FORWARD_UNITS,
                            depth=smollm2.config.num_layers)


def test_greedy_chat_continuations_match_transformers_for_64_tokens(smollm2, smollm2_hf):
    smollm2_hf.generation_config.eos_token_id = None  # like ignore_eos: decode through EOS
    results = eaglejax.generate(CHAT_PROMPTS, target=smollm2, max_new_tokens=64, ignore_eos=True)
    for prompt, result in zip(CHAT_PROMPTS, results):
        ids = torch.tensor([smollm2.tokenizer.render_prompt(prompt, chat=True)])
        with torch.no_grad():
            out = smollm2_hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                                      do_sample=False, pad_token_id=0)
        assert result.token_ids == out[0, ids.shape[1]:].tolist(), prompt
        assert len(result.token_ids) == 64


def test_chat_answer_stops_at_end_of_turn(smollm2):
    result = eaglejax.generate("What is the capital of France?", target=smollm2,
                               max_new_tokens=64)[0]
    assert result.finish_reason == "eos"
    assert "Paris" in result.text
    assert result.token_ids[-1] in smollm2.eos_token_ids


def test_stop_string_cuts_text_and_tokens(smollm2):
    free = eaglejax.generate(CHAT_PROMPTS[2], target=smollm2, max_new_tokens=48)[0]
    word = free.text.split()[5]
    stopped = eaglejax.generate(CHAT_PROMPTS[2], target=smollm2, max_new_tokens=48,
                                stop=[word])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:free.text.index(word)]
    assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)]
    assert word in smollm2.tokenizer.decode(stopped.token_ids)


def test_cli_generate_json(tmp_path):
    """Plain (`--no-draft`) and the default (the shipped head with `auto`, which speculates
    where that is faster as it decodes: the same tokens either way)."""
    env = {**os.environ, "EAGLEJAX_CACHE": str(share_native_builds(tmp_path / "cache")),
           "EAGLEJAX_AUTOTUNE_CACHE": "1"}
    command = [sys.executable, "-m", "eaglejax.cli", "generate", "Name a color.",
               "--max-new-tokens", "8", "--json"]
    proc = subprocess.run(command + ["--no-draft", "--logprobs", "2"], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads(proc.stdout)
    assert [e["token_id"] for e in result["logprobs"]] == result["token_ids"]
    assert all(len(e["top"]) == 2 and e["top"][0][0] == e["token_id"]  # greedy: the argmax
               and e["logprob"] == e["top"][0][1] <= 0 for e in result["logprobs"])
    assert result["finish_reason"] in ("eos", "length")
    assert 1 <= len(result["token_ids"]) <= 8
    assert result["metrics"]["prompt_tokens"] > 5
    assert result["metrics"]["speculative"] is None
    default = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert default.returncode == 0, default.stderr
    (chosen,) = json.loads(default.stdout)
    assert chosen["token_ids"] == result["token_ids"]
    shape = chosen["metrics"]["speculative"]
    assert shape.startswith("auto: ") and "%" in shape, shape  # the modes it ran, by share
    assert (tmp_path / "cache" / "autotune.json").is_file()  # what it learnt, for the next call
    # (an explicit shape from the command line: tests/test_roofline.py's bench run)


@pytest.mark.parametrize("spec,rows", [
    (eaglejax.SpecConfig.chain(3), 3),
    (eaglejax.SpecConfig.tree(top_k=4, depth=3, total_tokens=10), 1),
    (eaglejax.SpecConfig.static_tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]), 8),
], ids=["chain-batch3", "tree-batch1", "static-batch8"])
def test_speculative_with_random_head_equals_plain(spec, rows, smollm2):
    """SmolLM2 with a freshly initialised EAGLE-3 head: acceptance near 1, output identical."""
    from eaglejax.draft.draft import new_eagle3_draft

    draft = new_eagle3_draft(smollm2, seed=1)
    prompts = (CHAT_PROMPTS * 2)[:rows]
    kwargs = dict(target=smollm2, max_new_tokens=24, ignore_eos=True)
    plain = eaglejax.generate(prompts, **kwargs)
    out = eaglejax.generate(prompts, draft=draft, speculative=spec, **kwargs)
    assert [s.token_ids for s in out] == [p.token_ids for p in plain]
    assert all(s.metrics.acceptance_length < 1.5 for s in out)


def two_questions(questions):
    """The first MT-bench question and the next in its prompt-length bucket (53 and 52
    tokens: 64), so the benches compile each program once, not once per bucket."""
    return [questions[0], questions[4]]


def test_bench_reports_side_by_side_and_what_auto_ran(smollm2):
    """Plain decoding, a chain and speculative="auto" timed in one run (greedy), then a
    sampled chain: machine, memory floor, acceptance by category; each row names the modes
    it ran (rows that ran no speculative round, as `auto` soon decodes plainly with a
    random head, count as AL 1, a round per decode step)."""
    from eaglejax.bench import bench_speculative, compare_speculative
    from eaglejax.datasets import mt_bench_questions
    from eaglejax.draft.draft import new_eagle3_draft

    questions = two_questions(mt_bench_questions())
    head = new_eagle3_draft(smollm2, seed=2)
    chain, auto = compare_speculative(smollm2, head, questions,
                                      [eaglejax.SpecConfig.chain(2), "auto"], max_new_tokens=12)
    for report in (chain, auto):
        assert report["identical_tokens"] is True and report["sampling"] == "greedy"
        assert report["machine"]["cpu"] and report["machine"]["copy_bandwidth_gb_s"] > 0
        assert report["memory_floor_ms"] > 0 and report["plain_step_over_memory_floor"] > 0
        assert set(report["acceptance_length_by_category"]) == {q.category for q in questions}
    assert chain["speculative_shapes"] == {"chain K=2": 2}
    assert chain["acceptance_length"] >= 1.0
    assert sum(auto["speculative_shapes"].values()) == 2
    assert all(name.startswith("auto: ") for name in auto["speculative_shapes"])
    assert 1.0 <= auto["acceptance_length"] < 1.5  # a random head: the lookup branch at most
    sampling = dict(temperature=0.8, top_p=0.9, top_k=0, seed=3)
    sampled = bench_speculative(smollm2, head, questions, max_new_tokens=6,
                                speculative=eaglejax.SpecConfig.chain(2), sampling=sampling)
    assert sampled["sampling"] == sampling and "identical_tokens" not in sampled
    assert sampled["acceptance_length"] >= 1.0 and sampled["spec_decode_tokens_per_s"] > 0
