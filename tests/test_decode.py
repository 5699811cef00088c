"""The compiled plain decode loop: greedy parity, batch invariance, stopping, sampling."""

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import eaglejax
from eaglejax.decoding.sampling import SamplingParams, target_log_probs
from hf_oracle import hf_greedy
from tolerances import SOFTMAX_UNITS, assert_close_scaled

PROMPT_LENGTHS = (5, 23, 2, 40)


def _prompts(seed=0, lengths=PROMPT_LENGTHS):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, 97, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["llama3", "qwen3", "tied"])
def test_greedy_batch_matches_transformers_and_single_rows(family, hf_family, target_of):
    _, model = hf_family(family)
    target = target_of(family)
    prompts = _prompts()
    batch = eaglejax.generate(prompts, target=target, max_new_tokens=48, ignore_eos=True)
    for prompt, result in zip(prompts, batch):
        assert result.token_ids == hf_greedy(model, prompt, 48)
        alone = eaglejax.generate([prompt], target=target, max_new_tokens=48, ignore_eos=True)[0]
        assert alone.token_ids == result.token_ids
        assert result.finish_reason == "length" and len(result.token_ids) == 48


def test_max_new_tokens_is_exact(target_of):
    for n in (1, 2, 17):
        out = eaglejax.generate(_prompts(1), target=target_of("llama"), max_new_tokens=n,
                                ignore_eos=True)
        assert [len(r.token_ids) for r in out] == [n] * len(PROMPT_LENGTHS)
        assert all(r.finish_reason == "length" for r in out)
        assert all(r.metrics.target_forwards == n for r in out)


def test_eos_stops_each_row_where_it_appears(target_of):
    target = target_of("llama")
    prompts = _prompts(2)
    free = eaglejax.generate(prompts, target=target, max_new_tokens=30, ignore_eos=True)
    eos = free[0].token_ids[6]
    target_eos = eaglejax.Target(target.config, target.params, None, target.source, (eos,))
    stopped = eaglejax.generate(prompts, target=target_eos, max_new_tokens=30)
    for f, s in zip(free, stopped):
        if eos in f.token_ids:
            cut = f.token_ids.index(eos) + 1
            assert s.token_ids == f.token_ids[:cut] and s.finish_reason == "eos"
        else:
            assert s.token_ids == f.token_ids and s.finish_reason == "length"
    assert stopped[0].finish_reason == "eos" and len(stopped[0].token_ids) <= 7


def test_top_k_one_equals_greedy(target_of):
    target = target_of("qwen2")
    greedy = eaglejax.generate(_prompts(3), target=target, max_new_tokens=12, ignore_eos=True)
    sampled = eaglejax.generate(_prompts(3), target=target, max_new_tokens=12, ignore_eos=True,
                                temperature=1.3, top_k=1, seed=7)
    assert [g.token_ids for g in greedy] == [s.token_ids for s in sampled]


def test_sampling_is_seeded_and_row_independent(target_of):
    target = target_of("qwen2")
    prompts = _prompts(4)
    kwargs = dict(target=target, max_new_tokens=16, ignore_eos=True, temperature=0.9, top_p=0.95)
    batch = eaglejax.generate(prompts, seed=11, **kwargs)
    again = eaglejax.generate(prompts, seed=11, **kwargs)
    assert [r.token_ids for r in batch] == [r.token_ids for r in again]
    alone = eaglejax.generate([prompts[2]], seed=11, **kwargs)[0]
    assert alone.token_ids == batch[2].token_ids
    other = eaglejax.generate(prompts, seed=12, **kwargs)
    assert [r.token_ids for r in batch] != [r.token_ids for r in other]


def _hf_warped(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    scores = TemperatureLogitsWarper(temperature)(None, torch.tensor(logits))
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, -1).numpy()


def _our_warped(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    return np.exp(np.asarray(target_log_probs(logits, SamplingParams.make(temperature, top_k,
                                                                          top_p))))


def _assert_same_law(got: np.ndarray, want: np.ndarray, logits: np.ndarray, temperature: float):
    """Probabilities equal within float32 noise of the log domain (tolerances.SOFTMAX_UNITS
    units of eps * max|logits / temperature|): measured at most 0.1 units."""
    scale = np.abs(logits[np.isfinite(logits)]).max() / temperature
    assert_close_scaled(got, want, units=SOFTMAX_UNITS, scale=scale, what="probabilities")


WARPINGS = [(0.7, 0, 1.0), (1.0, 0, 0.8), (1.3, 5, 1.0), (0.5, 20, 0.6)]


@pytest.mark.parametrize("temperature,top_k,top_p", WARPINGS)
def test_warped_distribution_matches_transformers_warpers(temperature, top_k, top_p):
    logits = np.random.RandomState(5).randn(3, 200).astype(np.float32) * 3
    want = _hf_warped(logits, temperature, top_k, top_p)
    _assert_same_law(_our_warped(logits, temperature, top_k, top_p), want, logits, temperature)


@pytest.mark.parametrize("temperature,top_k,top_p", WARPINGS)
def test_warper_check_rejects_a_temperature_off_by_a_thousandth(temperature, top_k, top_p):
    """Negative control: a temperature 0.1% off moves the probabilities by 53 units or more
    (1.3e-4 to 3.5e-4)."""
    logits = np.random.RandomState(5).randn(3, 200).astype(np.float32) * 3
    want = _hf_warped(logits, temperature, top_k, top_p)
    with pytest.raises(AssertionError, match="noise units"):
        _assert_same_law(_our_warped(logits, temperature * 1.001, top_k, top_p), want, logits,
                         temperature)


@pytest.mark.parametrize("top_k,top_p", [(7, 1.0), (0, 0.5), (30, 0.9)])
def test_warpers_on_a_full_vocabulary_with_ties_and_masked_tokens(top_k, top_p):
    """A 49,152-token vocabulary with -inf tokens and negative values; integer logits (many
    ties, all kept at the top-k boundary as Hugging Face does) when only top-k is on (at a
    top-p boundary Hugging Face splits ties by sort order): the bisection thresholds keep
    exactly the sort-based warpers' tokens."""
    rng = np.random.RandomState(9)
    if top_p < 1:
        logits = (rng.randn(2, 49152) * 4).astype(np.float32)
    else:
        logits = rng.randint(-40, 12, size=(2, 49152)).astype(np.float32)
    logits[:, rng.choice(49152, 500, replace=False)] = -np.inf
    want = _hf_warped(logits, 1.0, top_k, top_p)
    got = _our_warped(logits, 1.0, top_k, top_p)
    assert ((got > 0) == (want > 0)).all()
    _assert_same_law(got, want, logits, 1.0)


def test_first_token_distribution_matches_exact_probabilities(target_of):
    """4000 seeds of one prompt: the empirical first-token law equals the warped target law
    (total variation below a bound that a correct sampler exceeds with probability < 1e-6)."""
    target = target_of("llama")
    prompt = _prompts(6, (9,))[0]
    n = 4000
    out = eaglejax.generate([prompt] * n, target=target, max_new_tokens=1, temperature=0.8,
                            top_p=0.9, seed=list(range(n)))
    counts = np.bincount([r.token_ids[0] for r in out], minlength=97) / n
    exact = np.exp(np.asarray(target_log_probs(np.asarray(target.logits([prompt]))[0, -1],
                                               SamplingParams.make(0.8, 0, 0.9))))
    support = exact > 0
    assert counts[~support].sum() == 0
    # E[TV] <= 0.5 * sum sqrt(p(1-p)/n); McDiarmid adds sqrt(log(1/delta) / (2n)).
    bound = 0.5 * np.sum(np.sqrt(exact * (1 - exact) / n)) + np.sqrt(np.log(1e6) / (2 * n))
    assert 0.5 * np.abs(counts - exact).sum() < bound


def test_prompts_of_new_lengths_reuse_the_compiled_loop(target_of):
    """On CPU (native attention: a cache slot past a row's length costs nothing) every call
    that fits `SHARED_CAPACITY` runs one decode-loop program, whatever its prompt length;
    where attention reads the whole cache (XLA's operations only) the cache stays sized by
    the call."""
    from eaglejax import native
    from eaglejax.decoding import loops
    from eaglejax.decoding.batch import SHARED_CAPACITY, cache_capacity, capacity_floor

    target = target_of("llama")
    assert capacity_floor(target) == SHARED_CAPACITY
    assert capacity_floor(target.with_weight_dtype("bfloat16")) == SHARED_CAPACITY
    with native.xla_only():
        assert capacity_floor(target) == 0
    assert cache_capacity(300, 128, 16, SHARED_CAPACITY) == SHARED_CAPACITY
    assert cache_capacity(1000, 128, 16, SHARED_CAPACITY) == 1280  # 1024 + 128 + 16, in 128s
    before = loops.decode_loop._cache_size()
    rows = [eaglejax.generate([[3 + i % 90 for i in range(n)]], target=target, max_new_tokens=8,
                              ignore_eos=True)[0] for n in (5, 40, 200)]
    assert all(len(r.token_ids) == 8 for r in rows)
    assert loops.decode_loop._cache_size() - before == 1
