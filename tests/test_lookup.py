"""Context lookup (prompt lookup) branches: the search against a plain-Python statement of
the rule (over the history of earlier replies too), the graft onto draft trees, and the
compiled loop (greedy identical to plain decoding for chains, dynamic and static trees; more
acceptance where text repeats, and with history where a request repeats an earlier one)."""

import jax.numpy as jnp
import numpy as np
import pytest

import eaglejax
from eaglejax import SpecConfig
from eaglejax.decoding import lookup
from eaglejax.decoding.suffix_history import SEPARATOR
from eaglejax.decoding.tree import chain_tree, tree_from_parents
from eaglejax.errors import InputError
from eaglejax.native import build
from spec_helpers import random_eagle3, self_draft


def reference_continuation(context: list[int], count: int) -> tuple[list[int], int]:
    """The rule, written plainly: the longest suffix match (<= 8 tokens, separators
    matching nothing) ending before the last token and not right before a separator, latest
    first; its followers, repeated with the match's period, the last token from a separator
    on; and the match's length."""
    last = len(context) - 1
    best, best_len = None, -1
    for i in range(last):
        if context[i + 1] == SEPARATOR:
            continue
        length = 0
        while (length < 8 and i - length >= 0 and context[last - length] != SEPARATOR
               and context[i - length] == context[last - length]):
            length += 1
        if length >= best_len:
            best, best_len = i, length
    if best is None:
        return [context[0]] * count, 0
    period = last - best
    copied = [context[best + 1 + t % period] for t in range(count)]
    if SEPARATOR in copied:
        cut = copied.index(SEPARATOR)
        copied = copied[:cut] + [context[last]] * (count - cut)
    return copied, best_len


@pytest.mark.parametrize("seed", range(6))
def test_continuation_follows_the_rule(seed):
    """Odd seeds search a history of earlier replies too (separators among them)."""
    rs = np.random.RandomState(seed)
    vocab = [3, 5, 40][seed % 3]  # few symbols: many and long matches
    lengths = rs.randint(1, 60, size=5)
    width = 64
    context = np.zeros((5, width), np.int32)
    history = np.where(rs.rand(24) < 0.2, SEPARATOR, rs.randint(0, vocab, size=24))
    history = history[:0] if seed % 2 == 0 else np.append(history, SEPARATOR).astype(np.int32)
    rows = []
    for b, n in enumerate(lengths):
        row = rs.randint(0, vocab, size=n).tolist()
        context[b, :n] = row
        context[b, n:] = rs.randint(0, vocab, size=width - n)  # garbage past the end
        rows.append(history.tolist() + row)
    searched, last = lookup.with_history(jnp.asarray(history), jnp.asarray(context),
                                         jnp.asarray(lengths - 1))
    got, matched = lookup.continuation(searched, last, 9)
    want = [reference_continuation(row, 9) for row in rows]
    assert np.asarray(got).tolist() == [tokens for tokens, _ in want]
    assert np.asarray(matched).tolist() == [length for _, length in want]
    if vocab == 3:  # matches longer than the default n-gram occur
        assert max(length for _, length in want) > 3


@pytest.mark.skipif(build.compiler() is None or not build.enabled(),
                    reason="no C++ compiler here (or EAGLEJAX_NATIVE=0): XLA's search is used")
@pytest.mark.parametrize("vocab", [2, 4, 50])
def test_the_native_search_agrees_with_xlas(vocab):
    """On CPU the search is one native pass per row (`native.lookup_match`): the same
    tokens and lengths as XLA's operations, separators, a row ending at 0 and one ending in
    separators included; exports for accelerators keep XLA's."""
    import jax

    from eaglejax import native
    from eaglejax.native import lookup_match

    rs = np.random.RandomState(vocab)
    context = np.where(rs.rand(7, 300) < 0.05, SEPARATOR, rs.randint(0, vocab, (7, 300)))
    last = np.array([0, 1, 5, 150, 298, 299, 299], np.int32)
    context[6, 290:] = SEPARATOR  # a row ending in separators
    args = (jnp.asarray(context, jnp.int32), jnp.asarray(last))
    search = lambda c, n: lookup.continuation(c, n, 11)  # noqa: E731
    assert lookup_match.TARGET in jax.jit(search).lower(*args).as_text()
    with native.xla_only():
        want = jax.jit(lambda c, n: lookup.continuation(c, n, 11))(*args)
    got = jax.jit(search)(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    text = jax.export.export(jax.jit(search), platforms=["cuda"])(*args).mlir_module()
    assert lookup_match.TARGET not in text


def test_continuation_over_the_history_of_earlier_replies():
    """Longest match, then latest, over [history | own context]: a match only an earlier
    reply holds is copied up to its separator (then the last token), an equally long one
    in the row's own context wins, a longer one in the history wins, and a match right
    before a separator is none."""
    history = jnp.asarray([0, 1, 2, 6, 6, SEPARATOR, 4, 1, 2, 3, 4, SEPARATOR])
    context = jnp.asarray([[5, 6, 7, 4, 1, 2, 0],    # "4 1 2" only in the history
                           [0, 1, 2, 8, 0, 1, 2],    # "0 1 2" in both: its own wins
                           [7, 1, 2, 9, 0, 1, 2],    # own "1 2" shorter than history's "0 1 2"
                           [5, 6, 4, 0, 0, 0, 0]])   # 4: the history's last one ends a reply
    got, matched = lookup.continuation(*lookup.with_history(
        history, context, jnp.asarray([5, 6, 6, 2])), 5)
    assert np.asarray(got).tolist() == [[3, 4, 2, 2, 2], [8, 0, 1, 2, 8], [6, 6, 2, 2, 2],
                                        [1, 2, 3, 4, 4]]
    assert np.asarray(matched).tolist() == [3, 3, 3, 1]


def test_continuation_follows_a_loop_past_the_end():
    context = jnp.asarray([[7, 1, 2, 3, 1, 2, 3, 1, 2]])
    got, matched = lookup.continuation(context, jnp.asarray([8]), 7)
    assert np.asarray(got).tolist() == [[3, 1, 2, 3, 1, 2, 3]] and int(matched[0]) == 5


def test_the_longest_match_wins_over_a_later_shorter_one():
    """"5 1 2 3" occurred before "8 1 2 3": the 4-token match is copied (7), not the latest
    3-token one (6), and the branch counts as a match of 3 or more either way."""
    context = jnp.asarray([[5, 1, 2, 3, 7, 8, 1, 2, 3, 6, 5, 1, 2, 3]])
    got, matched = lookup.continuation(context, jnp.asarray([13]), 3)
    assert np.asarray(got).tolist() == [[7, 8, 1]] and int(matched[0]) == 4


def test_graft_hangs_the_rest_under_the_deepest_held_prefix():
    # root 10 -> (11 -> (12, 13)), 14 ; continuation 11 12 50 51 52 under node 3 (token 12)
    tree = tree_from_parents(jnp.asarray([[10, 11, 14, 12, 13]]),
                             jnp.asarray([[-1, 0, 0, 1, 1]]), 2)
    grafted = lookup.graft(tree, jnp.asarray([[11, 12, 50, 51, 52]]), 2, 3)
    assert np.asarray(grafted.tokens).tolist() == [[10, 11, 14, 12, 13, 50, 51, 52]]
    assert np.asarray(grafted.parents).tolist() == [[-1, 0, 0, 1, 1, 3, 5, 6]]
    assert np.asarray(grafted.depths).tolist() == [[0, 1, 1, 2, 2, 3, 4, 5]]
    # Nothing held: the branch starts at the root, beside the head's children.
    grafted = lookup.graft(tree, jnp.asarray([[99, 11, 12, 13, 14]]), 2, 3)
    assert np.asarray(grafted.parents)[0, 5:].tolist() == [0, 5, 6]
    assert np.asarray(grafted.tokens)[0, 5:].tolist() == [99, 11, 12]


def test_fit_replaces_the_lowest_ranked_nodes_where_asked():
    # root 10 -> 11 (rank 1) -> 12 (rank 3); root -> 14 (rank 2); 11 -> 13 (rank 4)
    tree = tree_from_parents(jnp.asarray([[10, 11, 14, 12, 13]] * 2),
                             jnp.asarray([[-1, 0, 0, 1, 1]] * 2), 2,
                             jnp.asarray([[0, 1, 2, 3, 4]] * 2))
    copied = jnp.asarray([[11, 13, 60, 61]] * 2)  # 11 is held; 13 (rank 4) is pruned away
    fitted = lookup.fit(tree, copied, jnp.asarray([True, False]), 2, 2)
    assert np.asarray(fitted.tokens).tolist() == [[10, 11, 14, 13, 60], [10, 11, 14, 12, 13]]
    assert np.asarray(fitted.parents).tolist() == [[-1, 0, 0, 1, 3], [-1, 0, 0, 1, 1]]
    assert np.asarray(fitted.depths)[0].tolist() == [0, 1, 1, 2, 3]
    assert np.asarray(fitted.paths).shape == (2, 5, 5)  # depth bound 2 + 2 for both rows


def test_graft_onto_a_chain_never_duplicates_a_sibling():
    rs = np.random.RandomState(0)
    drafted = jnp.asarray(rs.randint(0, 3, size=(64, 4)))
    copied = jnp.asarray(rs.randint(0, 3, size=(64, 7)))
    tree = lookup.graft(chain_tree(jnp.zeros((64,), jnp.int32), drafted), copied, 4, 3)
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    for b in range(64):
        for node in range(tree.tokens.shape[1]):
            children = tokens[b][parents[b] == node]
            assert len(set(children.tolist())) == len(children)


def _prompts(seed, n):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, 97, size=rs.randint(2, 40)).tolist() for _ in range(n)]


@pytest.mark.parametrize("spec", [
    SpecConfig.chain(3).with_lookup(4),
    SpecConfig.tree(3, 3, 8).with_lookup(5, 2),
    SpecConfig.static_tree([(0,), (1,), (0, 0)]).with_lookup(2, 1),
    SpecConfig.chain(4).with_lookup(3, 2, replaces=True),
    SpecConfig.tree(3, 3, 8).with_lookup(4, 1, replaces=True),
    SpecConfig.chain(3).with_lookup(2).with_long_lookup(6, 3),
    SpecConfig.static_tree([(0,), (1,), (0, 0)]).with_lookup(2, 1).with_long_lookup(5, 2),
], ids=["chain", "tree", "static", "chain-replacing", "tree-replacing", "chain-long",
        "static-long"])
def test_greedy_with_lookup_matches_plain(spec, selfdraft_target):
    prompts = _prompts(5, 6) + [[4, 9, 4, 9, 4, 9, 4, 9]]
    plain = eaglejax.generate(prompts, target=selfdraft_target, max_new_tokens=40,
                              ignore_eos=True)
    out = eaglejax.generate(prompts, target=selfdraft_target, draft=self_draft(selfdraft_target),
                            speculative=spec, max_new_tokens=40, ignore_eos=True)
    assert [o.token_ids for o in out] == [p.token_ids for p in plain]
    for o in out:
        assert 1.0 <= o.metrics.acceptance_length <= spec.max_depth + 1
        assert len(o.metrics.acceptance_by_position) == spec.max_depth
        assert o.metrics.speculative == spec.describe()


def test_lookup_accepts_what_repeats(target_of, monkeypatch):
    """A random head accepts next to nothing; where the target's greedy text loops (small
    random models do), the lookup branch is accepted and the acceptance length rises. With
    history (`lookup_history`; empty the first time: the row's own context alone), a request
    repeating an earlier one copies that reply: longer still, and nothing recompiles as the
    history fills; with $EAGLEJAX_REPLY_HISTORY=0 no reply is added."""
    from eaglejax.decoding import loops
    from eaglejax.decoding.suffix_history import shared_history

    target = target_of("llama")
    draft = random_eagle3(target, seed=3)
    prompts = _prompts(11, 4)
    plain = eaglejax.generate(prompts, target=target, max_new_tokens=64, ignore_eos=True)
    kwargs = dict(target=target, draft=draft, max_new_tokens=64, ignore_eos=True)
    without = eaglejax.generate(prompts, speculative=SpecConfig.chain(2), **kwargs)
    spec = SpecConfig.chain(2).with_lookup(6, history=True)
    shared_history().clear()
    with_lookup = eaglejax.generate(prompts, speculative=spec, **kwargs)
    compiled = loops.decode_loop._cache_size()
    again = eaglejax.generate(prompts, speculative=spec, **kwargs)
    shared_history().clear()
    assert loops.decode_loop._cache_size() == compiled
    assert [o.token_ids for o in with_lookup] == [o.token_ids for o in again] == \
        [p.token_ids for p in plain]
    al = lambda runs: np.mean([r.metrics.acceptance_length for r in runs])  # noqa: E731
    assert al(without) < 1.2 and al(with_lookup) > al(without) + 0.5, (al(without), al(with_lookup))
    assert al(again) > al(with_lookup) + 0.5, (al(with_lookup), al(again))
    assert again[0].metrics.speculative.endswith("(ngram 3, history)")
    monkeypatch.setenv("EAGLEJAX_REPLY_HISTORY", "0")
    eaglejax.generate(prompts, speculative=spec, **kwargs)
    assert (shared_history().tokens == SEPARATOR).all()


def test_long_copies_verify_what_repeats_alone(target_of):
    """`long_lookup`: where some row's context matched long enough, the round verifies the
    root and a chain of copied tokens instead of the shape's own tree. Over ragged rows
    whose greedy text loops (small random models' does), the output is plain decoding's,
    rounds accept more draft tokens than the own shape can hold (a random head's depth-1
    tree with a 2-token branch: 3), and the acceptance length rises; a match threshold no
    context reaches leaves every round the own shape's (the same tokens and acceptance)."""
    target = target_of("llama")
    draft = random_eagle3(target, seed=3)
    prompts = _prompts(11, 4)
    kwargs = dict(target=target, max_new_tokens=64, ignore_eos=True)
    plain = [o.token_ids for o in eaglejax.generate(prompts, **kwargs)]
    own = SpecConfig.tree(3, 1, 3).with_lookup(2, 3, replaces=True)
    runs = {}
    for name, spec in [("own", own), ("long", own.with_long_lookup(8, 4)),
                       ("never", own.with_long_lookup(8, 8))]:
        runs[name] = eaglejax.generate(prompts, draft=draft, speculative=spec, **kwargs)
        assert [o.token_ids for o in runs[name]] == plain, name
    long = own.with_long_lookup(8, 4)
    assert (long.num_nodes, long.most_nodes, long.max_depth, own.max_depth) == (3, 9, 8, 3)
    assert runs["long"][0].metrics.speculative == own.describe() + \
        ", long copy 8 at matches of 4+"
    al = lambda name: np.mean([o.metrics.acceptance_length for o in runs[name]])  # noqa: E731
    assert al("long") > al("own") + 0.5, (al("own"), al("long"))
    assert max(o.metrics.acceptance_by_position[3] for o in runs["long"]) > 0.1
    assert all(len(o.metrics.acceptance_by_position) == 8 for o in runs["long"])
    # the 8-token matches a random context rarely holds: at most a few long rounds
    assert al("never") < al("long")


def test_long_copies_sample_the_target_exactly(target_of):
    """Sampled rows through rounds that verify a long copy (a prompt repeated: its second
    copy matches the first) follow the target's exact distribution (recursive rejection of
    the copied chain); rows whose own match is short ride along in those rounds."""
    from eaglejax.decoding.sampling import SamplingParams
    from test_speculative_sampling import assert_follows, exact_marginals, sample_rows

    target = target_of("llama")
    draft = random_eagle3(target, seed=3)
    prompt = _prompts(11, 1)[0]
    reply = eaglejax.generate([prompt], target=target, max_new_tokens=12,
                              ignore_eos=True)[0].token_ids
    echo = prompt + reply + prompt
    spec = SpecConfig.tree(3, 1, 3).with_lookup(2, 3, replaces=True).with_long_lookup(8, 3)
    out = sample_rows(echo, target=target, draft=draft, speculative=spec, max_new_tokens=2,
                      temperature=1.0, top_k=3)
    assert_follows(np.array([g.token_ids for g in out]),
                   exact_marginals(target, SamplingParams.make(1.0, 3), 2, echo))


def test_lookup_is_refused_for_a_sampled_chain_and_out_of_range(selfdraft_target):
    with pytest.raises(InputError, match="lookup branch with sampling needs a tree"):
        eaglejax.generate([[1, 2, 3]], target=selfdraft_target,
                          draft=self_draft(selfdraft_target), temperature=0.8,
                          speculative=SpecConfig.chain(3).with_lookup(2))
    with pytest.raises(InputError, match="lookup must be an integer in"):
        SpecConfig.chain(3).with_lookup(33)
    with pytest.raises(InputError, match="lookup_ngram"):
        SpecConfig.tree().with_lookup(3, 0)
    with pytest.raises(InputError, match="lookup_history: the history is searched by a lookup"):
        SpecConfig(lookup_history=True)
    with pytest.raises(InputError, match="lookup_history must be True or False"):
        SpecConfig.tree().with_lookup(3, history=1)
    with pytest.raises(InputError, match="must leave the head at least its root"):
        SpecConfig.chain(3).with_lookup(4, replaces=True)
    assert SpecConfig.tree(4, 4, 8).with_lookup(4, replaces=True).num_nodes == 8
    with pytest.raises(InputError, match="long_lookup=8: a longer copied chain than the lookup "
                                         "branch's \\(0 tokens\\) needs that branch"):
        SpecConfig.tree().with_long_lookup(8)
    with pytest.raises(InputError, match="long_lookup=3: a longer copied chain"):
        SpecConfig.tree().with_lookup(4).with_long_lookup(3)
    with pytest.raises(InputError, match="long_ngram=2: a long copy needs a match at least"):
        SpecConfig.tree().with_lookup(2, 3).with_long_lookup(8, 2)
    for bad, named in (((33, 8), "long_lookup must be an integer in"),
                       ((8, 9), "long_ngram must be an integer in")):
        with pytest.raises(InputError, match=named):
            SpecConfig.tree().with_lookup(2).with_long_lookup(*bad)


def test_cli_lookup_needs_an_explicit_shape(capsys):
    from eaglejax.cli import main

    assert main(["generate", "hi", "--draft", "random", "--lookup", "3"]) == 2
    assert "--lookup needs the shape it extends" in capsys.readouterr().err
    assert main(["generate", "hi", "--lookup", "3"]) == 2
    assert "--lookup needs --draft" in capsys.readouterr().err
    assert main(["generate", "hi", "--draft", "random", "--tree", "4,4,8",
                 "--lookup-replaces"]) == 2
    assert "--lookup-replaces needs --lookup N" in capsys.readouterr().err
    assert main(["generate", "hi", "--draft", "random", "--tree", "4,4,8",
                 "--lookup-history"]) == 2
    assert "--lookup-history needs --lookup N" in capsys.readouterr().err
    assert main(["generate", "hi", "--draft", "random", "--tree", "4,4,8",
                 "--long-copy", "8"]) == 2
    assert "--long-copy needs --lookup N" in capsys.readouterr().err
    assert main(["generate", "hi", "--draft", "random", "--tree", "4,4,8", "--lookup", "2",
                 "--long-copy", "8,x"]) == 2
    assert "--long-copy wants T,G (2 integers), got '8,x'" in capsys.readouterr().err
