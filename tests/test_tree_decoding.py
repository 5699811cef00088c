"""Tree speculation (EAGLE-2 dynamic trees, static trees) in the compiled loop: greedy
output equals plain decoding for many tree shapes, batch 1 and 8."""

import numpy as np
import pytest

import eaglejax
from eaglejax import SpecConfig
from eaglejax.errors import InputError
from spec_helpers import random_eagle3, self_draft

# (top_k, depth, total_tokens) drawn at random once, plus the edge shapes: a star (depth 1),
# a chain (top_k 1) and the largest tree the shape allows.
_rs = np.random.RandomState(2026)
RANDOM_SHAPES = [(int(k), int(d), int(2 + _rs.randint(k + (d - 1) * k * k)))
                 for k, d in zip(_rs.randint(1, 6, 3), _rs.randint(1, 6, 3))]
SHAPES = RANDOM_SHAPES + [(5, 1, 6), (1, 6, 7), (3, 3, 22)]
STATIC = [((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)),
          ((0,), (2,), (0, 0), (0, 0, 0))]


def _prompts(seed, n):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, 97, size=rs.randint(2, 40)).tolist() for _ in range(n)]


def _check_identical(target, draft, spec, prompts, max_new=32):
    plain = eaglejax.generate(prompts, target=target, max_new_tokens=max_new, ignore_eos=True)
    spec_out = eaglejax.generate(prompts, target=target, draft=draft, speculative=spec,
                                 max_new_tokens=max_new, ignore_eos=True)
    assert [s.token_ids for s in spec_out] == [p.token_ids for p in plain]
    for s in spec_out:
        assert 1.0 <= s.metrics.acceptance_length <= spec.max_depth + 1
        assert len(s.metrics.acceptance_by_position) == spec.max_depth
        assert s.metrics.speculative == spec.describe()
    return spec_out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "k{}-d{}-n{}".format(*s))
def test_dynamic_tree_greedy_matches_plain_with_self_draft(shape, selfdraft_target):
    spec = SpecConfig.tree(*shape)
    out = _check_identical(selfdraft_target, self_draft(selfdraft_target), spec,
                           _prompts(sum(shape), 8))
    if shape[1] > 1 and shape[2] > shape[1]:
        assert np.mean([s.metrics.acceptance_length for s in out]) > 1.5


@pytest.mark.parametrize("paths", STATIC, ids=["medusa-like", "gapped-ranks"])
def test_static_tree_greedy_matches_plain(paths, selfdraft_target):
    spec = SpecConfig.static_tree(paths)
    _check_identical(selfdraft_target, self_draft(selfdraft_target), spec, _prompts(3, 8))


def test_random_head_tree_single_row_and_draft_vocab(target_of):
    target = target_of("llama")
    draft = random_eagle3(target, seed=7, draft_vocab=60)
    _check_identical(target, draft, SpecConfig.tree(4, 3, 10), _prompts(7, 1), max_new=40)


def check_calibration_counts(target):
    """The best s nodes of a tree form the tree `total_tokens=s` would draft; what they
    would accept is non-decreasing in s and equals the real acceptance at full size."""
    from eaglejax.decoding.sampling import SamplingParams
    from eaglejax.decoding.stopping import StopCriteria
    from eaglejax.decoding.batch import decode

    draft = self_draft(target)
    sizes = (2, 5, 8, 14, 22)
    run = decode(target, draft, _prompts(11, 4), [0] * 4, SamplingParams.make(), 40,
                 StopCriteria(), SpecConfig.tree(3, 3, 22), calibration_sizes=sizes)
    per_size = np.asarray(run.calibration)  # [B,S]
    hist = np.asarray(run.state.accept_hist)  # [B,D+1]
    assert np.all(np.diff(per_size, axis=1) >= 0)
    np.testing.assert_array_equal(per_size[:, -1], hist @ np.arange(hist.shape[1]))
    assert np.all(per_size[:, 0] <= hist.sum(axis=1))  # one node: at most one token a round
    assert per_size[:, -1].sum() > per_size[:, 1].sum()  # deep nodes do get accepted
    # With a grafted lookup branch of 3 tokens: 3 more blocks of S columns (the sizes with 1,
    # 2, 3 of those tokens in place of their weakest nodes; exactness per round:
    # tests/test_calibration.py), none of them
    # more than the grafted tree itself accepted, each family non-decreasing in s.
    run = decode(target, draft, _prompts(11, 4), [0] * 4, SamplingParams.make(), 40,
                 StopCriteria(), SpecConfig.tree(3, 3, 22).with_lookup(3), calibration_sizes=sizes)
    counts = np.asarray(run.calibration)  # [B,S*(1+3)]: no branch, then 1..3 tokens
    hist = np.asarray(run.state.accept_hist)
    assert counts.shape == (4, 4 * len(sizes))
    for family in np.split(counts, 4, axis=1):
        assert np.all(np.diff(family, axis=1) >= 0)
        assert np.all(family <= (hist @ np.arange(hist.shape[1]))[:, None])


def test_calibration_counts_in_a_fresh_process(tmp_path):
    """Runs `check_calibration_counts` in its own interpreter: inside the full suite,
    XLA:CPU (jax 0.10.2) segfaulted compiling the calibration loop after the earlier tests'
    compiles, while the same code passes in a fresh process."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, str(here / "test_tree_decoding.py"), str(tmp_path)],
                          cwd=here, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "calibration ok" in proc.stdout


def test_tree_rows_are_independent_of_neighbours(selfdraft_target):
    draft = self_draft(selfdraft_target)
    prompts = _prompts(12, 4)
    kwargs = dict(target=selfdraft_target, draft=draft, max_new_tokens=24, ignore_eos=True,
                  temperature=0.8, speculative=SpecConfig.tree(3, 3, 9))
    batch = eaglejax.generate(prompts, seed=[1, 2, 3, 4], **kwargs)
    alone = eaglejax.generate([prompts[2]], seed=3, **kwargs)
    assert alone[0].token_ids == batch[2].token_ids


def test_eos_inside_an_accepted_tree_path_cuts_there(selfdraft_target):
    prompts = _prompts(6, 4)
    free = eaglejax.generate(prompts, target=selfdraft_target, max_new_tokens=30,
                             ignore_eos=True)
    eos = free[1].token_ids[9]
    target = eaglejax.Target(selfdraft_target.config, selfdraft_target.params, None,
                             selfdraft_target.source, (eos,))
    plain = eaglejax.generate(prompts, target=target, max_new_tokens=30)
    spec = eaglejax.generate(prompts, target=target, draft=self_draft(target),
                             max_new_tokens=30, speculative=SpecConfig.tree(3, 4, 12))
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids and s.finish_reason == p.finish_reason
    assert spec[1].finish_reason == "eos"


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="tree", top_k=0), "top_k"),
    (dict(method="tree", top_k=2, depth=2, total_tokens=8), "total_tokens"),
    (dict(method="static", paths=[(0,), (0, 1, 1)]), r"parent path \(0, 1\)"),
    (dict(method="static", paths=[(0,), (0,)]), "given twice"),
    (dict(method="static", paths=[]), "non-empty"),
    (dict(method="beam"), "method"),
])
def test_bad_spec_configs_are_refused(kwargs, match):
    with pytest.raises(InputError, match=match):
        SpecConfig(**kwargs)


def test_presets_shrink_toward_chains_with_batch():
    for platform in ("cpu", "gpu", "tpu"):
        sizes = [SpecConfig.preset(platform, b).num_nodes for b in (1, 4, 16, 64)]
        assert sizes == sorted(sizes, reverse=True), (platform, sizes)
    assert SpecConfig.preset("gpu", 1).method == "tree"
    assert SpecConfig.preset("cpu", 64).method == "chain"


@pytest.mark.parametrize("flags,match", [
    (["--tree", "3,2"], "TOP_K,DEPTH,TOTAL"),
    (["--tree", "3,2,99"], "total_tokens"),
    (["--static-tree", "[[0],[0,1,1]]"], "parent path"),
    (["--static-tree", "[[0],"], "not valid JSON"),
])
def test_cli_refuses_bad_speculation_flags(flags, match, capsys):
    from eaglejax.cli import main

    assert main(["generate", "hi", "--draft", "random", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eaglejax: error:") and match in err, err


if __name__ == "__main__":  # the fresh-process half of test_calibration_counts_in_a_...
    import sys

    from conftest import make_hf_model
    from spec_helpers import make_selfdraftable

    model = make_hf_model("llama", sys.argv[1], seed=11, num_hidden_layers=2)
    make_selfdraftable(model)
    model.save_pretrained(sys.argv[1])
    fresh_target = eaglejax.load_target(sys.argv[1])
    check_calibration_counts(fresh_target)
    print("calibration ok")
