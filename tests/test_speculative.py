"""The compiled speculative loop (chain drafting): greedy output equals plain decoding."""

import numpy as np
import pytest

import eaglejax
from eaglejax.decoding.speculative import SpecConfig
from spec_helpers import random_eagle3, self_draft

LENGTHS = (7, 19, 3, 33)


def _prompts(seed, lengths=LENGTHS):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, 97, size=n).tolist() for n in lengths]


def _plain_and_spec(target, draft, prompts, k, **kwargs):
    plain = eaglejax.generate(prompts, target=target, **kwargs)
    spec = eaglejax.generate(prompts, target=target, draft=draft,
                             speculative=SpecConfig(num_draft_tokens=k), **kwargs)
    return plain, spec


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_random_head_matches_plain_greedy(k, target_of):
    target = target_of("llama")
    draft = random_eagle3(target, seed=k, draft_vocab=60)
    plain, spec = _plain_and_spec(target, draft, _prompts(k), k, max_new_tokens=40,
                                  ignore_eos=True)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert s.finish_reason == "length"
        assert 1.0 <= s.metrics.acceptance_length <= k + 1
        assert len(s.metrics.acceptance_by_position) == k
        assert s.metrics.target_forwards <= p.metrics.target_forwards


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_self_draft_accepts_much_and_matches_plain(k, selfdraft_target):
    draft = self_draft(selfdraft_target)
    plain, spec = _plain_and_spec(selfdraft_target, draft, _prompts(10 + k), k,
                                  max_new_tokens=48, ignore_eos=True)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    mean_al = np.mean([s.metrics.acceptance_length for s in spec])
    assert mean_al > 1 + 0.6 * k, mean_al  # a random head stays near 1
    assert all(s.metrics.target_forwards < p.metrics.target_forwards
               for s, p in zip(spec, plain)) or k == 1
    for s in spec:  # a row's own rounds produced its 47 decode tokens (the last may overrun)
        m = s.metrics
        assert m.verify_rounds <= m.target_forwards - 1
        assert 47 <= round(m.acceptance_length * m.verify_rounds) <= 47 + k


def test_multi_layer_head_and_tied_target(target_of):
    target = target_of("tied")
    draft = random_eagle3(target, seed=4, num_layers=2)
    plain, spec = _plain_and_spec(target, draft, _prompts(4), 4, max_new_tokens=24,
                                  ignore_eos=True)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]


@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_never_more_than_max_new_tokens(max_new, selfdraft_target):
    draft = self_draft(selfdraft_target)
    plain, spec = _plain_and_spec(selfdraft_target, draft, _prompts(5), 5,
                                  max_new_tokens=max_new, ignore_eos=True)
    for p, s in zip(plain, spec):
        assert len(s.token_ids) == max_new and s.token_ids == p.token_ids


def test_eos_inside_an_accepted_block_cuts_there(selfdraft_target):
    draft = self_draft(selfdraft_target)
    prompts = _prompts(6)
    free = eaglejax.generate(prompts, target=selfdraft_target, max_new_tokens=40,
                             ignore_eos=True)
    eos = free[1].token_ids[9]
    target = eaglejax.Target(selfdraft_target.config, selfdraft_target.params, None,
                             selfdraft_target.source, (eos,))
    draft = self_draft(target)
    plain, spec = _plain_and_spec(target, draft, prompts, 6, max_new_tokens=40)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids and s.finish_reason == p.finish_reason
    assert spec[1].finish_reason == "eos" and spec[1].token_ids[-1] == eos
    assert spec[1].metrics.acceptance_length > 2  # the cut really fell inside a block


def test_draft_for_another_target_is_refused(target_of):
    draft = random_eagle3(target_of("llama"))
    with pytest.raises(eaglejax.ConfigError, match="loaded for target"):
        eaglejax.generate([[1, 2, 3]], target=target_of("qwen2"), draft=draft)


def test_invalid_num_draft_tokens():
    with pytest.raises(eaglejax.InputError, match="num_draft_tokens"):
        SpecConfig(num_draft_tokens=0)
