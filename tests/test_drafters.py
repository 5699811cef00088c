"""The contract of every registered drafting method (`eaglejax.decoding.drafters`).

A method registered there is checked here on the shapes `EXAMPLES` lists for it (a method
without an entry fails the first test): one round drafted from a real prefilled state is a
well-formed tree of the size its `SpecConfig` states, greedy and sampled; a sampled chain
carries its draft distributions; greedy speculation is plain decoding token for token. Each
method's own properties (oracles, acceptance, sampling exactness) have their own tests.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import eaglejax
from eaglejax import SpecConfig
from eaglejax.decoding.batch import batch_inputs
from eaglejax.decoding.bundle import Bundle
from eaglejax.decoding.drafters import methods
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.draft.draft import new_eagle3_draft
from tolerances import ONE_ROUNDING_UNITS, assert_close_scaled

V, MASK = 97, 96
EXAMPLES = {
    "chain": [SpecConfig.chain(1), SpecConfig.chain(4)],
    "tree": [SpecConfig.tree(3, 3, 8)],
    "parallel": [SpecConfig.parallel(4)],
    "parallel_tree": [SpecConfig.parallel_tree(3, 4, 10)],
    "static": [SpecConfig.static_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])],
}
SHAPES = [spec for shapes in EXAMPLES.values() for spec in shapes]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from conftest import make_hf_model

    directory = tmp_path_factory.mktemp("drafters-target")
    make_hf_model("llama", directory, seed=5, num_hidden_layers=2, vocab_size=V)
    return eaglejax.load_target(directory)


@pytest.fixture(scope="module")
def draft(target):
    """An EAGLE-3 head with a mask token: every method (P-EAGLE's included) drafts with it."""
    return new_eagle3_draft(target, mask_token_id=MASK, seed=1, scale=0.05)


def _prompts(n: int = 3) -> list[list[int]]:
    rs = np.random.RandomState(0)
    return [rs.randint(0, V, size=rs.randint(2, 20)).tolist() for _ in range(n)]


def test_every_registered_method_has_examples():
    assert set(methods()) == set(EXAMPLES)


def _one_round(target, draft, spec: SpecConfig, greedy: bool):
    """Prefill a batch, draft and verify one round; the round's `Drafted` and its root
    tokens (the last accepted ones)."""
    sampling = SamplingParams.make(0.0 if greedy else 0.8, 0, 0.95)
    models = Bundle.of(target, draft, spec)
    prompt, lengths, keys, sampling, max_new = batch_inputs(models, _prompts(), [0, 1, 2],
                                                            sampling, 16)
    loop, common = models.loop, dict(greedy=greedy, stop=StopCriteria())

    @jax.jit
    def run(weights, prompt, lengths, keys, sampling, max_new):
        state = loop.prefill_state(weights, prompt, lengths, keys, sampling, max_new,
                                   capacity=64, max_tokens=16, **common)
        play = loop.verified_step(weights, sampling, max_new, **common)
        return play(state)[1].drafted, state.last_token

    return run(models.weights, prompt, lengths, keys, sampling, max_new)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("spec", SHAPES, ids=SpecConfig.describe)
def test_a_round_drafts_a_well_formed_tree(target, draft, spec, greedy):
    drafted, root_token = _one_round(target, draft, spec, greedy)
    tree = jax.tree.map(np.asarray, drafted.tree)
    batch, n = tree.tokens.shape
    assert n == spec.num_nodes
    assert np.array_equal(tree.tokens[:, 0], np.asarray(root_token))
    assert ((0 <= tree.tokens) & (tree.tokens < V)).all()
    assert (tree.parents[:, 0] == -1).all() and (tree.depths[:, 0] == 0).all()
    for b in range(batch):
        ancestors = np.eye(n, dtype=bool)
        for i in range(1, n):
            parent = tree.parents[b, i]
            assert 0 <= parent < i, "a parent precedes its children"
            assert tree.depths[b, i] == tree.depths[b, parent] + 1
            ancestors[i] |= ancestors[parent]
        assert np.array_equal(tree.mask[b], ancestors), "a node sees itself and its ancestors"
    assert tree.depths.max() <= spec.draft_depth
    if spec.is_chain and not greedy:  # the min(1, p/q) rule's draft distributions
        probs = np.asarray(drafted.probs)
        assert probs.shape == (batch, spec.num_draft_tokens, V)
        # a sum of V probabilities, each off by at most one rounding: V units at worst
        assert_close_scaled(probs.sum(-1), np.ones(probs.shape[:2]), units=ONE_ROUNDING_UNITS,
                            depth=V * V, what="draft distribution sums")
    else:
        assert drafted.probs is None


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    return [g.token_ids for g in eaglejax.generate(_prompts(), target=target, max_new_tokens=12,
                                                   ignore_eos=True)]


@pytest.mark.parametrize("spec", SHAPES, ids=SpecConfig.describe)
def test_greedy_speculation_is_plain_decoding(target, draft, plain, spec):
    out = eaglejax.generate(_prompts(), target=target, draft=draft, speculative=spec,
                            max_new_tokens=12, ignore_eos=True)
    assert [g.token_ids for g in out] == plain
    assert out[0].metrics.speculative == spec.describe()
