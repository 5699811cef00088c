"""The contract of every registered drafting method (`eaglejax.decoding.drafters`).

A method registered there is checked here on the shapes `EXAMPLES` lists for it (a method
without an entry fails the first test): one round drafted from a real prefilled state is a
well-formed tree of the size its `SpecConfig` states, greedy and sampled; a sampled chain
carries its draft distributions; greedy speculation is plain decoding token for token.
`LastSuccessor` (examples/custom_drafter.py) is the extension point's example: a drafter with
a state of its own and no model, registered from outside the package, decoding through
`generate` and the serving engine, greedy identical and sampled exactly. Each method's own
properties (oracles, acceptance, sampling exactness) have their own tests.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eaglejax
from eaglejax import SpecConfig
from eaglejax.decoding.batch import batch_inputs
from eaglejax.decoding.bundle import Bundle
from eaglejax.decoding.drafters import methods, register, unregister
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.draft.draft import new_dflash_draft, new_eagle3_draft
from tolerances import ONE_ROUNDING_UNITS, assert_close_scaled

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from custom_drafter import LastSuccessor, main as custom_drafter_main  # noqa: E402

V, MASK = 97, 96
EXAMPLES = {
    "chain": [SpecConfig.chain(1), SpecConfig.chain(4)],
    "tree": [SpecConfig.tree(3, 3, 8)],
    "parallel": [SpecConfig.parallel(4)],
    "parallel_tree": [SpecConfig.parallel_tree(3, 4, 10)],
    "static": [SpecConfig.static_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])],
    "suffix": [SpecConfig.suffix(3, 4, 10, 0), SpecConfig.suffix(2, 3, 8, 0),  # padded
               SpecConfig.suffix(3, 4, 10, min_match=2)],
    "draft_model": [SpecConfig.draft_model(1), SpecConfig.draft_model(3)],
    "draft_model_tree": [SpecConfig.draft_model_tree(3, 3, 8)],
    "dflash": [SpecConfig.dflash(1), SpecConfig.dflash(4)],
    "dflash_tree": [SpecConfig.dflash_tree(3, 4, 10)],
}
SHAPES = [spec for shapes in EXAMPLES.values() for spec in shapes]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from conftest import make_hf_model

    directory = tmp_path_factory.mktemp("drafters-target")
    make_hf_model("llama", directory, seed=5, num_hidden_layers=2, vocab_size=V)
    return eaglejax.load_target(directory)


@pytest.fixture(scope="module")
def head(target):
    """An EAGLE-3 head with a mask token: every head method (P-EAGLE's included) drafts
    with it."""
    return new_eagle3_draft(target, mask_token_id=MASK, seed=1, scale=0.05)


@pytest.fixture(scope="module")
def draft_model(target, tmp_path_factory):
    """A smaller random model of the target's vocabulary."""
    from conftest import make_hf_model

    directory = tmp_path_factory.mktemp("drafters-model")
    make_hf_model("llama", directory, seed=6, num_hidden_layers=1, hidden_size=32,
                  intermediate_size=64, vocab_size=V)
    return eaglejax.DraftModel.of(eaglejax.load_target(directory), target)


@pytest.fixture(scope="module")
def dflash_head(target):
    return new_dflash_draft(target, block_size=8, mask_token_id=MASK, seed=3, scale=0.05)


@pytest.fixture
def draft(head, draft_model, dflash_head, spec):
    """What `spec`'s method drafts with."""
    if spec.is_dflash:
        return dflash_head
    return {"head": head, "model": draft_model, None: None}[spec.drafts_with]


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


@pytest.fixture
def last_successor():
    """The method "last_successor" registered for one test."""
    register("last_successor")(LastSuccessor(V))
    yield SpecConfig(method="last_successor", num_draft_tokens=3)
    unregister("last_successor")


def test_a_drafter_with_its_own_state_plugs_into_every_driver(target, plain, last_successor):
    from eaglejax.serving.engine import Engine, Request

    spec = last_successor
    assert spec.is_chain and spec.num_nodes == 4 and spec.describe() == "last_successor K=3"
    assert spec.drafts_with is None  # it runs without draft weights
    out = eaglejax.generate(_prompts(), target=target, speculative=spec, max_new_tokens=12,
                            ignore_eos=True)
    assert [g.token_ids for g in out] == plain
    # A prompt that holds its own continuation: the table drafts it, rounds accept it.
    prompt = _prompts(1)[0]
    echo = prompt + plain[0] + prompt
    want = eaglejax.generate([echo], target=target, max_new_tokens=12, ignore_eos=True)
    got = eaglejax.generate([echo], target=target, speculative=spec, max_new_tokens=12,
                            ignore_eos=True)
    assert got[0].token_ids == want[0].token_ids
    assert got[0].metrics.acceptance_length > 2.0, got[0].metrics
    engine = Engine(target, None, speculative=spec, num_slots=2, capacity=96)
    assert engine.speculation == "last_successor K=3"
    served = engine.run([Request(i, p, 12, ignore_eos=True) for i, p in
                         enumerate(_prompts() + [echo])])
    assert [served[i].token_ids for i in range(4)] == plain + [want[0].token_ids]


def test_a_drafter_with_its_own_state_samples_the_target_exactly(target, last_successor):
    from test_speculative_sampling import assert_follows, exact_marginals, sample_rows

    prompt = _prompts(1)[0]
    out = sample_rows(prompt, target=target, speculative=last_successor, max_new_tokens=2,
                      temperature=1.0, top_k=3)
    assert_follows(np.array([g.token_ids for g in out]),
                   exact_marginals(target, SamplingParams.make(1.0, 3), 2, prompt))


def test_the_custom_drafter_example_runs(target):
    result = custom_drafter_main(["--model", str(target.source), "--max-new-tokens", "12"])
    assert result["identical"] and result["acceptance_length"] >= 1.0
    assert "last_successor" not in methods()  # it unregisters what it registered


def test_suffix_drafting_needs_no_head_and_drafts_what_repeats(target, plain):
    """Method "suffix" runs with no draft head; where the context repeats itself its tree
    is accepted (AL well above plain decoding's 1.0), greedy output stays plain decoding's, and
    sampled output follows the target's exact distribution."""
    from test_speculative_sampling import assert_follows, exact_marginals, sample_rows

    spec = SpecConfig.suffix(4, 6, 12, min_match=0)
    assert spec.drafts_with is None and spec.describe() == "suffix top_k=4 depth=6 total=12"
    out = eaglejax.generate(_prompts(), target=target, speculative=spec, max_new_tokens=12,
                            ignore_eos=True)
    assert [g.token_ids for g in out] == plain
    prompt = _prompts(1)[0]
    echo = prompt + plain[0] + prompt
    want = eaglejax.generate([echo], target=target, max_new_tokens=12, ignore_eos=True)[0]
    got = eaglejax.generate([echo], target=target, speculative=spec, max_new_tokens=12,
                            ignore_eos=True)[0]
    assert got.token_ids == want.token_ids
    assert got.metrics.acceptance_length > 1.5, got.metrics  # 2.2 when written
    out = sample_rows(echo, target=target, speculative=spec, max_new_tokens=2, temperature=1.0,
                      top_k=3)
    assert_follows(np.array([g.token_ids for g in out]),
                   exact_marginals(target, SamplingParams.make(1.0, 3), 2, echo))


def test_suffix_rounds_gated_by_match_length_are_plain_steps_where_nothing_repeats(target,
                                                                                  plain):
    """With `min_match`, a round whose longest match is shorter is a plain step: where no
    8 tokens repeat (the first two prompts' rows; the third repeats one token) every round
    accepts nothing (AL exactly 1) and sampling is the target's; where the context repeats
    itself the tree still runs and is accepted; greedy output is plain decoding's either
    way."""
    from test_speculative_sampling import assert_follows, exact_marginals, sample_rows

    never = SpecConfig.suffix(4, 6, 12, min_match=8)
    assert never.describe() == "suffix top_k=4 depth=6 total=12, matches of 8+"
    out = eaglejax.generate(_prompts()[:2], target=target, speculative=never,
                            max_new_tokens=12, ignore_eos=True)
    assert [g.token_ids for g in out] == plain[:2]
    assert all(g.metrics.acceptance_length == 1.0 for g in out), [g.metrics for g in out]
    prompt = _prompts(1)[0]
    marginals = exact_marginals(target, SamplingParams.make(1.0, 3), 2, prompt)
    sampled = sample_rows(prompt, target=target, speculative=never, max_new_tokens=2,
                          temperature=1.0, top_k=3)
    assert_follows(np.array([g.token_ids for g in sampled]), marginals)

    echo = prompt + plain[0] + prompt
    want = eaglejax.generate([echo], target=target, max_new_tokens=12, ignore_eos=True)[0]
    gated = SpecConfig.suffix(4, 6, 12, min_match=2)
    got = eaglejax.generate([echo], target=target, speculative=gated, max_new_tokens=12,
                            ignore_eos=True)[0]
    assert got.token_ids == want.token_ids
    assert got.metrics.acceptance_length > 1.5, got.metrics
    for bad, named in ((dict(method="tree", min_match=2), "method 'tree'"),
                       (dict(method="suffix", min_match=9), "min_match")):
        with pytest.raises(eaglejax.InputError, match=named):
            SpecConfig(**bad)


def test_smaller_suffix_trees_are_the_best_ranked_nodes_of_a_larger_one():
    """`auto`'s probe counts what a smaller suffix tree would have accepted from the larger
    tree's best-ranked nodes (`decoding.calibration`): a suffix tree of s nodes must be
    exactly those nodes, with the same paths."""
    from eaglejax.decoding.drafters import drafter

    rs = np.random.RandomState(3)
    contexts = [np.tile(rs.randint(0, 5, 7), 6), rs.randint(0, 3, 40), rs.randint(0, 50, 40)]
    width = 48
    context = np.zeros((len(contexts), width), np.int32)
    for row, tokens in enumerate(contexts):
        context[row, :len(tokens)] = tokens
    state = (jnp.asarray(context), jnp.array([len(c) for c in contexts], jnp.int32))
    root = state[0][jnp.arange(len(contexts)), state[1] - 1]

    def tree(total: int):
        spec = SpecConfig.suffix(4, 6, total)
        draft = jax.jit(lambda s, r: drafter("suffix").draft(None, s, r, spec, True,
                                                             SamplingParams.make(), None, 64)[0])
        return jax.device_get(draft(state, root))

    def paths(made, row: int, keep) -> list[tuple[int, ...]]:
        out = []
        for node in range(len(made.tokens[row])):
            if not keep(node):
                continue
            path, j = [], node
            while j >= 0:
                path.append(int(made.tokens[row, j]))
                j = int(made.parents[row, j])
            out.append(tuple(path[::-1]))
        return sorted(out)

    largest = tree(12)
    for total in (6, 8):
        smaller = tree(total)
        for row in range(len(contexts)):
            assert paths(smaller, row, lambda n: True) == paths(
                largest, row, lambda n, row=row: largest.ranks[row, n] < total), (total, row)


def test_suffix_drafting_searches_the_replies_decoded_before(target, head, plain):
    """Suffix drafters read the process's history of earlier replies (`generate` and the
    engine add theirs), and so does a head's lookup branch with history in the engine: a
    prompt answered before is drafted from its earlier reply, with the same tokens; the
    history keeps the newest tokens in a fixed size."""
    from eaglejax.decoding.suffix_history import SEPARATOR, SuffixHistory, shared_history
    from eaglejax.serving.engine import Engine, Request

    spec = SpecConfig.suffix(4, 6, 12)
    shared_history().clear()
    first = eaglejax.generate(_prompts(), target=target, speculative=spec, max_new_tokens=12,
                              ignore_eos=True)
    again = eaglejax.generate(_prompts(), target=target, speculative=spec, max_new_tokens=12,
                              ignore_eos=True)
    assert [g.token_ids for g in first] == [g.token_ids for g in again] == plain
    before = [g.metrics.acceptance_length for g in first]
    after = [g.metrics.acceptance_length for g in again]
    assert all(a >= b for a, b in zip(after, before)), (before, after)
    assert np.mean(after) > np.mean(before) + 0.5, (before, after)

    request = Request("a", _prompts(1)[0], 12, ignore_eos=True)
    for draft, shape in ((None, spec), (head, SpecConfig.chain(2).with_lookup(4, history=True))):
        shared_history().clear()
        engine = Engine(target, draft, speculative=shape, num_slots=1, capacity=64)
        once, twice = (engine.run([dataclasses.replace(request, key=key)])[key]
                       for key in ("a", "b"))
        assert once.generated == twice.generated == 12
        assert twice.acceptance_length > once.acceptance_length + 1, (shape, once, twice)

    history = SuffixHistory(size=6)
    history.add([[1, 2], [3, 4, 5], []])
    assert history.tokens.tolist() == [2, SEPARATOR, 3, 4, 5, SEPARATOR]
    history.add([[6, 7, 8, 9, 10, 11, 12]])
    assert history.tokens.tolist() == [8, 9, 10, 11, 12, SEPARATOR]
    shared_history().clear()
