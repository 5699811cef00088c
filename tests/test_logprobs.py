"""Log-probabilities of generated tokens (`generate(logprobs=)`, the engine's): the target
model's own distribution at each token, against transformers' log-softmax of the same
sequence, equal with and without speculation (chains, trees, `auto`, sampling)."""

import numpy as np
import pytest
import torch
import transformers

import eaglejax
from eaglejax.serving.engine import Engine, Request
from spec_helpers import self_draft
from tolerances import FORWARD_UNITS, assert_close_scaled

PROMPTS = [[1, 5, 9, 20, 17, 33], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
NEW = 24
TOP = 4


@pytest.fixture(scope="module")
def oracle(selfdraft_target):
    return transformers.AutoModelForCausalLM.from_pretrained(
        selfdraft_target.source, dtype=torch.float32).eval()


def _oracle_log_probs(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """[len(generated), V]: transformers' log-softmax at each generated token's position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:-1].numpy()


def _check(model, target, prompt, result, top):
    """`result.logprobs` hold each token's and the `top` most likely tokens' log-probabilities
    of the oracle's distribution."""
    want = _oracle_log_probs(model, prompt, result.token_ids)
    entries = result.logprobs
    assert [e.token_id for e in entries] == result.token_ids
    depth = target.config.num_layers
    scale = float(np.abs(want).max())
    chosen = want[np.arange(len(entries)), result.token_ids]
    assert_close_scaled([e.logprob for e in entries], chosen, units=FORWARD_UNITS, depth=depth,
                        scale=scale, what="chosen log-probabilities")
    for e, row in zip(entries, want):
        ids = [t for t, _ in e.top]
        assert len(ids) == top and len(set(ids)) == top
        values = [v for _, v in e.top]
        assert values == sorted(values, reverse=True)
        assert_close_scaled(values, row[ids], units=FORWARD_UNITS, depth=depth, scale=scale,
                            what="top log-probabilities")
        if top:  # the k most likely, up to ties within the noise
            assert values[-1] >= np.sort(row)[-top] - 1e-4 * scale


@pytest.mark.parametrize("speculative", [None, eaglejax.SpecConfig.tree(4, 3, 8), "auto"])
def test_greedy_logprobs_match_transformers_with_and_without_speculation(
        selfdraft_target, oracle, speculative):
    draft = None if speculative is None else self_draft(selfdraft_target)
    results = eaglejax.generate(PROMPTS, target=selfdraft_target, draft=draft,
                                max_new_tokens=NEW, ignore_eos=True, logprobs=TOP,
                                speculative=speculative)
    plain = eaglejax.generate(PROMPTS, target=selfdraft_target, max_new_tokens=NEW,
                              ignore_eos=True)
    for prompt, result, alone in zip(PROMPTS, results, plain):
        assert result.token_ids == alone.token_ids and alone.logprobs is None
        _check(oracle, selfdraft_target, prompt, result, TOP)
        assert all(e.top[0][0] == e.token_id for e in result.logprobs)  # greedy: the argmax
    if speculative is not None and speculative != "auto":  # rounds accepted whole paths
        assert results[0].metrics.acceptance_length > 1.5


def test_sampled_tokens_report_the_unwarped_target_distribution(selfdraft_target, oracle):
    """Sampled at temperature 0.7 with top-k 20 through a tree: each token's entry is the
    model's log-softmax there (before temperature and truncation), no alternatives asked."""
    results = eaglejax.generate(PROMPTS, target=selfdraft_target,
                                draft=self_draft(selfdraft_target), max_new_tokens=NEW,
                                ignore_eos=True, temperature=0.7, top_k=20, seed=[3, 4],
                                logprobs=0, speculative=eaglejax.SpecConfig.tree(4, 3, 8))
    for prompt, result in zip(PROMPTS, results):
        _check(oracle, selfdraft_target, prompt, result, 0)


def test_engine_rows_report_logprobs_only_when_asked(selfdraft_target):
    want = eaglejax.generate(PROMPTS, target=selfdraft_target, max_new_tokens=NEW,
                             ignore_eos=True, logprobs=2)
    engine = Engine(selfdraft_target, num_slots=2, capacity=64, max_logprobs=3)
    done = engine.run([Request("asks", PROMPTS[0], NEW, ignore_eos=True, logprobs=2),
                       Request("does not", PROMPTS[1], NEW, ignore_eos=True)])
    asks = done["asks"]
    assert asks.token_ids == want[0].token_ids and done["does not"].logprobs is None
    assert [e.token_id for e in asks.logprobs] == asks.token_ids
    assert_close_scaled([e.logprob for e in asks.logprobs],
                        [e.logprob for e in want[0].logprobs], units=FORWARD_UNITS,
                        depth=selfdraft_target.config.num_layers,
                        what="the engine's log-probabilities against generate's")
    assert [[t for t, _ in e.top] for e in asks.logprobs] == \
        [[t for t, _ in e.top] for e in want[0].logprobs]


def test_bad_logprobs_requests_are_refused(selfdraft_target):
    with pytest.raises(eaglejax.InputError, match="logprobs must be an integer in \\[0, 20\\]"):
        eaglejax.generate(PROMPTS, target=selfdraft_target, max_new_tokens=2, logprobs=21)
    with pytest.raises(eaglejax.InputError, match="logprobs"):
        eaglejax.generate(PROMPTS, target=selfdraft_target, max_new_tokens=2, logprobs=True)
    plain = Engine(selfdraft_target, num_slots=1, capacity=64)
    with pytest.raises(eaglejax.InputError, match="'r': logprobs: this engine keeps no"):
        plain.submit(Request("r", PROMPTS[0], 2, logprobs=0))
    keeping = Engine(selfdraft_target, num_slots=1, capacity=64, max_logprobs=2)
    with pytest.raises(eaglejax.InputError, match="'r': logprobs must be an integer in "
                                                  "\\[0, 2\\]"):
        keeping.submit(Request("r", PROMPTS[0], 2, logprobs=3))
    with pytest.raises(eaglejax.InputError, match="max_logprobs"):
        Engine(selfdraft_target, num_slots=1, capacity=64, max_logprobs=21)
