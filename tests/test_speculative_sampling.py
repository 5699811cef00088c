"""Lossless speculative sampling (sampled chains and deterministic trees), tested
statistically against the exact target distribution of the first generated tokens."""


import jax.numpy as jnp
import numpy as np
import pytest

import eaglejax
from eaglejax.decoding.sampling import SamplingParams, argmax_last, target_log_probs
from eaglejax.decoding.suffix_history import shared_history
from spec_helpers import random_eagle3, self_draft

N = 3000
CHUNK = 1000  # rows a generate call samples at once: its memory grows with its rows
PROMPT = [5, 17, 42, 8, 63, 21]
FALSE_ALARM = 1e-6  # per compared marginal


def sample_rows(prompt: list[int], history: list[list[int]] | None = None, **kwargs) -> list:
    """`eaglejax.generate` of `prompt` N times with seeds 0..N-1 (ignoring EOS), CHUNK rows
    a call (rows sample independently: the same results as one batch of N); with `history`,
    the replies the history of earlier replies holds before each call (cleared after)."""
    results = []
    for start in range(0, N, CHUNK):
        shared_history().clear()
        shared_history().add(history or [])
        results += eaglejax.generate([prompt] * CHUNK, seed=list(range(start, start + CHUNK)),
                                     ignore_eos=True, **kwargs)
    shared_history().clear()
    return results


def _warped(target, sequences, params):
    logits = np.asarray(target.logits(np.asarray(sequences)))[:, -1]
    return np.exp(np.asarray(target_log_probs(logits, params)))


def exact_marginals(target, params, steps, prompt=PROMPT):
    """Exact law of each of the first `steps` new tokens, by enumerating the support."""
    marginals, paths = [], {(): 1.0}
    for _ in range(steps):
        seqs = list(paths)
        probs = _warped(target, [prompt + list(s) for s in seqs], params)
        marginal = np.zeros(probs.shape[-1])
        new_paths = {}
        for seq, weight, p in zip(seqs, paths.values(), probs):
            marginal += weight * p
            for token in np.flatnonzero(p):
                new_paths[seq + (int(token),)] = weight * p[token]
        marginals.append(marginal)
        paths = new_paths
    return marginals


def tv_bound(p, n, delta=FALSE_ALARM):
    """E[TV] <= 0.5 * sum sqrt(p(1-p)/n); McDiarmid adds sqrt(log(1/delta) / (2n))."""
    return 0.5 * np.sum(np.sqrt(p * (1 - p) / n)) + np.sqrt(np.log(1 / delta) / (2 * n))


# (speculation, the good head's minimum AL, the bad head's maximum). A deterministic tree is accepted only as often
# as its few tokens carry target mass, so the trees run on a sharpened target (logits x4)
# where the good head's paths are long; the chain's sampled draft needs no such help.
SPECS = {
    "chain": (eaglejax.SpecConfig.chain(3), 3.2, 2.5),
    "tree": (eaglejax.SpecConfig.tree(top_k=3, depth=3, total_tokens=10), 1.8, 1.5),
    "static": (eaglejax.SpecConfig.static_tree([(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)]),
               1.8, 1.5),
}


def sharpened(target, factor):
    """The same model with every logit multiplied by `factor` (final norm scaled)."""
    params = dict(target.params, final_norm=target.params["final_norm"] * factor)
    return eaglejax.Target(target.config, params, target.tokenizer, target.source,
                           target.eos_token_ids)


# Chains at both warpings; each tree kind at one of them (the trees' acceptance does not
# depend on the warping, which the chains cover; CI time).
WARPINGS = {"chain": [(0.7, 0.9), (1.0, 0.95)], "tree": [(0.7, 0.9)], "static": [(1.0, 0.95)]}


@pytest.mark.parametrize("drafting,temperature,top_p", [
    (drafting, t, p) for drafting, warpings in WARPINGS.items() for t, p in warpings])
@pytest.mark.parametrize("which", ["bad", "good"])
def test_first_tokens_follow_the_target_distribution(drafting, which, temperature, top_p,
                                                     selfdraft_target):
    target = selfdraft_target if drafting == "chain" else sharpened(selfdraft_target, 4.0)
    draft = self_draft(target) if which == "good" else random_eagle3(target, draft_vocab=60)
    params = SamplingParams.make(temperature, 0, top_p)
    spec, good_al, bad_al = SPECS[drafting]
    out = sample_rows(PROMPT, target=target, draft=draft, max_new_tokens=3,
                      temperature=temperature, top_p=top_p, speculative=spec)
    samples = np.array([r.token_ids for r in out])
    assert samples.shape == (N, 3)
    al = np.mean([r.metrics.acceptance_length for r in out])
    # Both the rejection path (bad head) and long acceptances (good head) are exercised.
    assert (al > good_al) if which == "good" else (al < bad_al), al
    assert_follows(samples, exact_marginals(target, params, 3))


def assert_follows(samples: np.ndarray, marginals: list[np.ndarray]) -> None:
    for position, exact in enumerate(marginals):
        empirical = np.bincount(samples[:, position], minlength=exact.size) / N
        assert empirical[exact == 0].sum() == 0, f"token {position} left the support"
        tv = 0.5 * np.abs(empirical - exact).sum()
        assert tv < tv_bound(exact, N), (position, tv, tv_bound(exact, N))


@pytest.mark.parametrize("which,branch", [("bad", "added, history"), ("good", "added"),
                                          ("bad", "replacing"), ("good", "replacing")])
def test_lookup_branch_keeps_sampling_exact(which, branch, selfdraft_target):
    """A tree with a context-lookup branch, on a prompt that repeats itself so the branch
    is often right (with history: the prompt once, an earlier reply holding it and what
    followed): with a random head (which drafts nothing the target takes) every acceptance
    above ~1.0 comes from the branch."""
    target = sharpened(selfdraft_target, 4.0)
    greedy = eaglejax.generate([PROMPT], target=target, max_new_tokens=3,
                               ignore_eos=True)[0].token_ids
    history = "history" in branch
    prompt = PROMPT if history else PROMPT + greedy + PROMPT
    draft = self_draft(target) if which == "good" else random_eagle3(target, draft_vocab=60)
    params = SamplingParams.make(0.7, 0, 0.9)
    spec = eaglejax.SpecConfig.tree(3, 2, 6).with_lookup(2, 1, branch == "replacing", history)
    out = sample_rows(prompt, [PROMPT + greedy] if history else None, target=target,
                      draft=draft, max_new_tokens=3, temperature=0.7, top_p=0.9,
                      speculative=spec)
    al = np.mean([r.metrics.acceptance_length for r in out])
    assert al > (1.8 if which == "good" else 1.25), al  # measured 1.45-1.52 with the random head
    assert_follows(np.array([r.token_ids for r in out]), exact_marginals(target, params, 3, prompt))


def test_speculative_sampling_is_seeded_and_row_independent(selfdraft_target):
    draft = self_draft(selfdraft_target)
    prompts = [PROMPT, PROMPT[:3], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    kwargs = dict(target=selfdraft_target, draft=draft, max_new_tokens=12, temperature=0.9,
                  ignore_eos=True, speculative=eaglejax.SpecConfig.chain(3))
    batch = eaglejax.generate(prompts, seed=[3, 4, 5], **kwargs)
    alone = eaglejax.generate([prompts[1]], seed=4, **kwargs)
    assert alone[0].token_ids == batch[1].token_ids
    assert batch[0].token_ids == eaglejax.generate(prompts, seed=[3, 4, 5], **kwargs)[0].token_ids


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("which", ["random", "uniform"])
def test_parallel_drafts_keep_sampling_exact(which, shape, selfdraft_target):
    """P-EAGLE (K tokens from one forward, each slot's distribution its own q), as a
    sampled chain (min(1, p/q)) and as a deterministic tree over the slots' top tokens
    (recursive rejection): a random head over 60 draft tokens (mostly rejected) and a head
    proposing the uniform distribution at every slot (often accepted on this flat target)."""
    import jax.numpy as jnp

    from eaglejax.draft.draft import new_eagle3_draft

    draft = new_eagle3_draft(selfdraft_target, mask_token_id=3, seed=4,
                             scale=0.05 if which == "uniform" else 1.0,  # peaked: rejected
                             used_tokens=None if which == "uniform" else
                             np.sort(np.random.RandomState(4).choice(97, 60, replace=False)))
    if which == "uniform":
        draft.params["lm_head"] = jnp.zeros_like(draft.params["lm_head"])
    spec = (eaglejax.SpecConfig.parallel(3) if shape == "chain" else
            eaglejax.SpecConfig.parallel_tree(top_k=4, depth=3, total_tokens=12))
    out = sample_rows(PROMPT, target=selfdraft_target, draft=draft, max_new_tokens=3,
                      temperature=1.0, top_p=0.95, speculative=spec)
    al = np.mean([r.metrics.acceptance_length for r in out])
    if shape == "chain":  # the sampled chain: long paths with the uniform proposals
        assert (al > 1.8) if which == "uniform" else (al < 1.5), al
    assert_follows(np.array([r.token_ids for r in out]),
                   exact_marginals(selfdraft_target, SamplingParams.make(1.0, 0, 0.95), 3))


def test_argmax_last_is_jnp_argmax():
    """The greedy token everywhere (plain steps, verification, drafting): the first maximum,
    ties and infinities included, and the first NaN where a row has one, as jnp.argmax."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 3, 300)).astype(np.float32)
    x[0, 0, [4, 17, 250]] = 9.0  # a tie: the first wins
    x[1, 1] = -np.inf  # every entry -inf
    x[2, 2, 40] = np.inf
    x[3, 0, [8, 90]] = np.nan
    x[4] = np.round(x[4])  # many ties
    np.testing.assert_array_equal(np.asarray(argmax_last(jnp.asarray(x))),
                                  np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert argmax_last(jnp.asarray(x)).dtype == jnp.int32
