"""Property tests of dynamic draft-tree construction (EAGLE-2 node selection)."""

import jax
import numpy as np
from hypothesis import given, settings, strategies as st

from eaglejax.decoding.spec_config import normalize_paths
from eaglejax.decoding.tree import num_candidates, select_tree, static_shape, tree_from_parents


def expansion_candidates(rs, top_k, depth):
    """Candidates as EAGLE-2's expansion rounds create them: the root's top_k children,
    then each round the top_k children of the best top_k nodes of the previous round."""
    tokens, scores, parents = [], [], []
    round_ids = []
    for r in range(depth):
        if r == 0:
            frontier = [(-1, 0.0)]
            width = top_k
        else:
            prev = sorted(round_ids, key=lambda i: (-scores[i], i))[:top_k]
            frontier = [(i, scores[i]) for i in sorted(prev)]
            width = top_k
        round_ids = []
        for parent, base in frontier:
            logp = np.log(rs.dirichlet(np.ones(width)) + 1e-12)
            # Occasional exact ties and zero log-probs (a sure child) stress tie handling.
            if rs.rand() < 0.3:
                logp[:] = np.round(logp, 1)
            if rs.rand() < 0.1:
                logp[0] = 0.0
            for j in range(width):
                round_ids.append(len(tokens))
                tokens.append(len(tokens))  # unique: a token names its candidate
                scores.append(float(base + min(logp[j], 0.0)))
                parents.append(parent)
    assert len(tokens) == num_candidates(top_k, depth)
    return np.array(tokens), np.array(scores, np.float32), np.array(parents)


# compiled as the loops compile them: one program per shape, not a compile per eager operation
jitted_select_tree = jax.jit(select_tree, static_argnums=(4, 5))
jitted_tree_from_parents = jax.jit(tree_from_parents, static_argnums=2)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(top_k=st.integers(1, 4), depth=st.integers(1, 4), seed=st.integers(0, 10_000),
       keep_fraction=st.floats(0.0, 1.0), batch=st.integers(1, 3))
def test_tree_properties(top_k, depth, seed, keep_fraction, batch):
    rs = np.random.RandomState(seed)
    n_cand = num_candidates(top_k, depth)
    total = 2 + int(keep_fraction * (n_cand - 1))
    rows = [expansion_candidates(rs, top_k, depth) for _ in range(batch)]
    roots = rs.randint(1000, 2000, size=batch)
    tree = jitted_select_tree(roots, *(np.stack([r[i] for r in rows]) for i in range(3)),
                              total, depth)
    tree = [np.asarray(x) for x in tree]
    for b, (tokens, scores, parents) in enumerate(rows):
        t_tokens, t_parents, t_depths, t_mask, t_paths, t_leaf, t_ranks = (x[b] for x in tree)
        assert t_tokens[0] == roots[b] and t_parents[0] == -1 and t_depths[0] == 0
        # Every kept node's parent is kept and comes earlier.
        assert all(0 <= t_parents[i] < i for i in range(1, total))
        # The kept candidates are a best-scoring set.
        kept = t_tokens[1:]
        assert len(set(kept.tolist())) == total - 1
        assert np.all(scores[np.setdiff1d(tokens, kept)] <= scores[kept].min())
        # Ranks order nodes by score: a permutation with every parent ranked above its
        # children, so the best n nodes always form a subtree.
        assert sorted(t_ranks.tolist()) == list(range(total))
        assert all(t_ranks[t_parents[i]] < t_ranks[i] for i in range(1, total))
        assert np.all(np.diff(scores[kept[np.argsort(t_ranks[1:])]]) <= 0)
        # Mask rows are exactly the ancestor-or-self sets; depths count ancestors.
        for i in range(total):
            ancestors, node = {i}, i
            while t_parents[node] >= 0:
                node = t_parents[node]
                ancestors.add(node)
            assert set(np.flatnonzero(t_mask[i])) == ancestors
            assert t_depths[i] == len(ancestors) - 1 <= depth
        # Leaves are the nodes without children; their paths run root -> leaf.
        children = set(t_parents[1:].tolist())
        covered = set()
        for i in range(total):
            assert t_leaf[i] == (i not in children)
            path = [n for n in t_paths[i] if n >= 0]
            if t_leaf[i]:
                assert path[0] == 0 and path[-1] == i and len(path) == t_depths[i] + 1
                assert all(t_parents[c] == p for p, c in zip(path, path[1:]))
                covered.update(path)
            else:
                assert path == []
        assert covered == set(range(total))


def test_selection_keeps_the_highest_scores():
    rs = np.random.RandomState(0)
    tokens, scores, parents = expansion_candidates(rs, 3, 3)
    tree = select_tree(np.array([7]), tokens[None], scores[None], parents[None], 9, 3)
    chosen = np.asarray(tree.tokens)[0, 1:]
    threshold = scores[chosen].min()
    assert np.all(scores[np.setdiff1d(tokens, chosen)] <= threshold)


path_sets = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1,
                     max_size=12)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(raw=path_sets)
def test_static_tree_structure(raw):
    closed = {tuple(p[:i]) for p in raw for i in range(1, len(p) + 1)}
    paths = normalize_paths(sorted(closed))
    shape = static_shape(paths)
    n = len(paths) + 1
    tokens = np.arange(n)[None]
    tree = [np.asarray(x)[0] for x in jitted_tree_from_parents(tokens, shape.parents[None],
                                                               shape.max_depth)]
    _, parents, depths, mask, leaf_paths, is_leaf, _ = tree
    for i, path in enumerate(paths, start=1):
        assert depths[i] == len(path) == shape.depths[i]  # positions = prefix + depth
        assert paths[parents[i] - 1] == path[:-1] if len(path) > 1 else parents[i] == 0
        assert shape.child_rank[i] == path[-1]
        ancestors = {0} | {paths.index(path[:j]) + 1 for j in range(1, len(path) + 1)}
        assert set(np.flatnonzero(mask[i])) == ancestors
    leaves = {i for i in range(n) if i not in set(parents[1:].tolist())}
    assert set(np.flatnonzero(is_leaf)) == leaves
    assert {n for row in leaf_paths for n in row if n >= 0} == set(range(n))
