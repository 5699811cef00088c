"""`decoding.calibration`: what each smaller tree (with or without a lookup branch in place of
its weakest nodes) would accept, counted on one grafted largest tree, against building each
of those trees for real (`lookup.fit`) and finding its longest path the target agrees with."""

import jax.numpy as jnp
import numpy as np
import pytest

from eaglejax.decoding import calibration, lookup
from eaglejax.decoding.tree import tree_from_parents

VOCAB = 4  # node tokens 0..3; the target's argmax off its own path is token 4, never drafted


def _head_trees(rng, batch, n_nodes, depth):
    """Random trees in node order (parents first, distinct sibling tokens, depth <= depth);
    ranks = node order, so the best s nodes are a subtree, as in EAGLE-2."""
    tokens = np.zeros((batch, n_nodes), np.int32)
    parents = np.full((batch, n_nodes), -1, np.int32)
    for b in range(batch):
        tokens[b, 0] = rng.integers(VOCAB)
        depths, used = [0], {0: set()}
        for i in range(1, n_nodes):
            open_nodes = [j for j in range(i) if depths[j] < depth and len(used[j]) < VOCAB]
            p = int(rng.choice(open_nodes[:4]))  # favour early (high-ranked) parents
            token = int(rng.choice(sorted(set(range(VOCAB)) - used[p])))
            used[p].add(token)
            used[i] = set()
            tokens[b, i], parents[b, i] = token, p
            depths.append(depths[p] + 1)
    return tokens, parents


def _paths(tokens, parents):
    """Per node, its draft tokens from the root down (root excluded)."""
    paths = []
    for i in range(len(tokens)):
        path, j = [], i
        while parents[j] >= 0:
            path.append(int(tokens[j]))
            j = parents[j]
        paths.append(path[::-1])
    return paths


def _target_logits(tree, truth):
    """One-hot logits of a target whose greedy continuation is `truth` [B,L]: at a node whose
    path is a prefix of it, the next truth token; elsewhere the never-drafted token."""
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    argmax = np.full(tokens.shape, VOCAB, np.int32)
    for b in range(tokens.shape[0]):
        for i, path in enumerate(_paths(tokens[b], parents[b])):
            if path == list(truth[b, :len(path)]):
                argmax[b, i] = truth[b, len(path)]
    return jnp.asarray(np.eye(VOCAB + 1, dtype=np.float32)[argmax])


def _accepted(tree, truth):
    """[B]: the longest prefix of truth that is a root path of the tree (greedy acceptance)."""
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    return np.array([max(len(p) for p in _paths(tokens[b], parents[b])
                         if p == list(truth[b, :len(p)])) for b in range(len(tokens))])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_counts_match_the_trees_they_stand_for(seed):
    rng = np.random.default_rng(seed)
    batch, draft_depth, n_lookup, largest = 16, 4, 3, 16
    sizes = (4, 6, 9, 12, 16)
    tokens, parents = _head_trees(rng, batch, largest, draft_depth)
    ranks = jnp.broadcast_to(jnp.arange(largest), (batch, largest))
    head = tree_from_parents(jnp.asarray(tokens), jnp.asarray(parents), draft_depth, ranks)
    # The target's continuation; the copied tokens follow it for a random number of tokens.
    truth = rng.integers(VOCAB, size=(batch, draft_depth + n_lookup + 1))
    agree = rng.integers(0, draft_depth + n_lookup + 1, size=batch)
    copied = np.where(np.arange(draft_depth + n_lookup)[None, :] < agree[:, None],
                      truth[:, :-1], rng.integers(VOCAB, size=(batch, draft_depth + n_lookup)))
    copied = jnp.asarray(copied, jnp.int32)
    use = jnp.asarray(rng.random(batch) < 0.7)

    grafted = lookup.graft(head, copied, draft_depth, n_lookup)
    logits = _target_logits(grafted, truth)
    depth = draft_depth + n_lookup
    plain = np.asarray(calibration.subtree_acceptance(grafted, logits, depth, sizes, largest))
    fitted = np.asarray(calibration.lookup_subtree_acceptance(grafted, logits, depth, sizes,
                                                              copied, use, n_lookup, largest))
    for k, s in enumerate(sizes):
        sub_tokens, sub_parents, sub_ranks = lookup._pruned(head, s)
        subtree = tree_from_parents(sub_tokens, sub_parents, draft_depth, sub_ranks)
        np.testing.assert_array_equal(plain[:, k], _accepted(subtree, truth), err_msg=f"size {s}")
        real = lookup.fit(subtree, copied, use, draft_depth, n_lookup)
        np.testing.assert_array_equal(fitted[:, k], _accepted(real, truth),
                                      err_msg=f"size {s} with lookup")
    # The branch matters in these trees: some rows accept more with it, and none of the
    # trees with a branch is counted as the plain one.
    assert np.any(fitted > plain) and np.any(fitted < plain)
    # Depth-1 trees (the root and its best s - 1 children) with a 1-token branch in place
    # of their weakest child (`auto`'s two-token rounds; one token: size 2).
    shallow = (2, 3)
    plain = np.asarray(calibration.subtree_acceptance(grafted, logits, depth, shallow, largest))
    fitted = np.asarray(calibration.lookup_subtree_acceptance(grafted, logits, depth, shallow,
                                                              copied, use, 1, largest))
    two = np.sum(parents == 0, axis=1) >= 2  # rows whose largest tree kept two children
    assert two.sum() >= batch // 2
    for k, s in enumerate(shallow):
        nodes = np.stack([[0, *np.flatnonzero(parents[b] == 0)[:s - 1]]
                          for b in np.flatnonzero(two)])
        sub_parents = np.where(np.arange(s) == 0, -1, 0)[None].repeat(len(nodes), 0)
        subtree = tree_from_parents(jnp.asarray(np.take_along_axis(tokens[two], nodes, 1)),
                                    jnp.asarray(sub_parents), 1,
                                    jnp.broadcast_to(jnp.arange(s), nodes.shape))
        np.testing.assert_array_equal(plain[two, k], _accepted(subtree, truth[two]),
                                      err_msg=f"depth-1 size {s}")
        real = lookup.fit(subtree, copied[two][:, :2], use[two], 1, 1)
        np.testing.assert_array_equal(fitted[two, k], _accepted(real, truth[two]),
                                      err_msg=f"depth-1 size {s} with lookup")
    assert np.any(plain[:, 1] > plain[:, 0])  # the second child is accepted in some rows


def test_a_depth_one_count_where_the_largest_tree_kept_one_child_is_a_lower_bound():
    """The largest tree spent its nodes below the root's first child (no second child):
    a depth-1 tree of 3 nodes is counted as its root and first child; a grafted node at
    depth 1 is the branch's, never taken for the head's second child."""
    tokens = jnp.asarray([[9, 1, 2, 3, 0]])  # root 9, child 1, grandchild 2, then 3; graft 0
    parents = jnp.asarray([[-1, 0, 1, 2, 0]])
    tree = tree_from_parents(tokens, parents, 3, jnp.arange(5)[None])
    logits = jnp.asarray(np.eye(VOCAB + 1, dtype=np.float32)[[[0, 2, 3, 4, 4]]])
    # the target wants 0 after the root: only the grafted node holds it
    counts = calibration.subtree_acceptance(tree, logits, 3, (2, 3, 4), 4)
    assert counts.tolist() == [[0, 0, 0]]
    logits = jnp.asarray(np.eye(VOCAB + 1, dtype=np.float32)[[[1, 2, 3, 4, 4]]])
    counts = calibration.subtree_acceptance(tree, logits, 3, (2, 3, 4), 4)
    assert counts.tolist() == [[1, 1, 3]]  # depth-1 trees stop at the child; 4 best: 3 deep


def test_on_copied_path_marks_one_node_per_depth():
    tokens = jnp.asarray([[9, 1, 2, 1, 3]])
    parents = jnp.asarray([[-1, 0, 0, 1, 3]])
    tree = tree_from_parents(tokens, parents, 3, jnp.arange(5)[None])
    marked = calibration.on_copied_path(tree, jnp.asarray([[1, 1, 3, 0]]), 3)
    assert marked.tolist() == [[True, True, False, True, True]]
    marked = calibration.on_copied_path(tree, jnp.asarray([[1, 2, 3, 0]]), 3)
    assert marked.tolist() == [[True, True, False, False, False]]


def test_a_long_copy_column_counts_the_copied_tokens_the_target_agrees_with():
    """`auto`'s depth-1 mode verifies a long copy instead of its tree where some running
    row matched long: its column counts the copied tokens the target agrees with along the
    probe's grafted branch (exact below the branch's end, a lower bound at it), and where no
    row matched long, its own tree's column."""
    from eaglejax.decoding.drafting import Drafted
    from eaglejax.decoding.spec_config import SpecConfig
    from eaglejax.decoding.speculative import Round
    from eaglejax.decoding.tree import chain_tree

    rng = np.random.default_rng(7)
    batch, draft_depth, n_lookup, largest = 16, 4, 4, 8
    sizes = (3, 6, 8)
    probe = SpecConfig.tree(4, draft_depth, largest).with_lookup(n_lookup, 3)
    mode = SpecConfig.tree(4, 1, 3).with_lookup(2, 3, True).with_long_lookup(6, 5)
    tokens, parents = _head_trees(rng, batch, largest, draft_depth)
    ranks = jnp.broadcast_to(jnp.arange(largest), (batch, largest))
    head = tree_from_parents(jnp.asarray(tokens), jnp.asarray(parents), draft_depth, ranks)
    truth = rng.integers(VOCAB, size=(batch, draft_depth + n_lookup + 1))
    agree = rng.integers(0, draft_depth + n_lookup + 1, size=batch)
    copied = jnp.asarray(np.where(np.arange(draft_depth + n_lookup)[None] < agree[:, None],
                                  truth[:, :-1], VOCAB - 1 - truth[:, :-1]), jnp.int32)
    grafted = lookup.graft(head, copied, draft_depth, n_lookup)
    logits = _target_logits(grafted, truth)
    reach = np.max(np.where(calibration.on_copied_path(grafted, copied, probe.max_depth),
                            np.asarray(grafted.depths), 0), axis=1)
    chain = _accepted(chain_tree(jnp.asarray(truth[:, 0] * 0 + 9), copied[:, :6]), truth)
    running = jnp.ones(batch, bool)
    for lengths, copying in ((np.full(batch, 3), False), (np.r_[5, np.full(batch - 1, 2)], True)):
        done = Round(Drafted(grafted, None, (copied, jnp.asarray(lengths >= 3),
                                             jnp.asarray(lengths))), logits, running)
        counts = np.asarray(calibration.round_counts(done, probe, sizes, mode))
        assert counts.shape == (batch, calibration.count_columns(probe, sizes, mode))
        column = counts[:, -1]
        own = counts[:, 2 * len(sizes) + sizes.index(3)]  # depth-1 size 3, 2-token branch
        if not copying:
            np.testing.assert_array_equal(column, own)
            continue
        assert np.all(column <= chain)  # a lower bound...
        exact = chain < reach
        assert exact.sum() >= batch // 2 and np.any(column > own)
        np.testing.assert_array_equal(column[exact], chain[exact])  # ...exact below its end
    with pytest.raises(ValueError, match="cannot count"):
        calibration.check_long_copy(probe, (6, 8), mode)
