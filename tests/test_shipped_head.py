"""The heads shipped for SmolLM2-135M-Instruct (`checkpoints/`: EAGLE-3, P-EAGLE and DFlash):
each loads, its drafts are accepted at the rate its model card states, and it exports to the
PyTorch layouts without loss."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

import eaglejax
from eaglejax import SpecConfig
from eaglejax.draft.formats import WRITERS
from eaglejax.draft.shipped import shipped_head
from eaglejax.training.pipeline import mt_bench_prompts
from tolerances import ACCEPTANCE_LENGTH_NEAR_TIES

pytestmark = pytest.mark.slow

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
HEAD = CHECKPOINTS / "smollm2-135m-instruct-eagle3"
PEAGLE_HEAD = CHECKPOINTS / "smollm2-135m-instruct-peagle"
DFLASH_HEAD = CHECKPOINTS / "smollm2-135m-instruct-dflash"
CARD_SHAPES = {"chain": SpecConfig.chain, "parallel": SpecConfig.parallel,
               "dflash": SpecConfig.dflash}
# The PyTorch layouts each kind exports to.
LAYOUTS = {"eagle3": ("reference", "speculators"), "dflash": ("dflash", "speculators")}


@pytest.fixture(scope="module", params=[HEAD, PEAGLE_HEAD, DFLASH_HEAD],
                ids=["eagle3", "peagle", "dflash"])
def shipped(request, smollm2):
    return request.param, eaglejax.load_draft(request.param, target=smollm2)


@pytest.fixture(scope="module")
def plain_of(smollm2):
    """(MT-bench first turns, max_new_tokens) -> plain decoding's results, decoded once for
    both cards."""
    done = {}

    def get(turns: int, max_new_tokens: int):
        if (turns, max_new_tokens) not in done:
            done[turns, max_new_tokens] = eaglejax.generate(
                mt_bench_prompts(turns), target=smollm2, max_new_tokens=max_new_tokens)
        return done[turns, max_new_tokens]

    return get


def test_acceptance_is_what_the_model_card_states(shipped, smollm2, plain_of):
    path, head = shipped
    card = json.loads((path / "evaluation.json").read_text())
    kind, k = card["shape"].split(":")
    prompts = mt_bench_prompts(card["mt_bench_first_turns"])
    common = dict(target=smollm2, max_new_tokens=card["max_new_tokens"])
    plain = plain_of(card["mt_bench_first_turns"], card["max_new_tokens"])
    spec = eaglejax.generate(prompts, draft=head, speculative=CARD_SHAPES[kind](int(k)),
                             **common)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    measured = float(np.mean([s.metrics.acceptance_length for s in spec]))
    # The card's figure was measured with this very call; float32 rounding on another CPU
    # may flip a near-tie draft token (tolerances.ACCEPTANCE_LENGTH_NEAR_TIES).
    assert abs(measured - card["acceptance_length"]) <= ACCEPTANCE_LENGTH_NEAR_TIES
    assert measured > 1.1  # an untrained head: 1.00 (the DFlash drafter's card: 1.210)


@pytest.mark.parametrize("layout", [0, 1], ids=["first-layout", "second-layout"])
def test_exports_reload_exactly(layout, shipped, smollm2, tmp_path):
    _, head = shipped
    layout = LAYOUTS[head.config.kind][layout]
    WRITERS[layout](head, str(tmp_path / layout))
    again = eaglejax.load_draft(tmp_path / layout, target=smollm2)
    expected, config = dict(head.params), head.config
    if "mask_embed" in expected:  # the PyTorch layouts store a whole table: the target's rows
        table = np.array(smollm2.params["embed"], copy=True)  # with the learned mask row
        table[config.mask_token_id] = np.asarray(expected.pop("mask_embed"))
        expected["embed"] = table
        config = dataclasses.replace(config, own_embedding=True)
    assert again.config == config
    np.testing.assert_array_equal(np.asarray(again.d2t), np.asarray(head.d2t))
    assert jax.tree.structure(again.params) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("method, path", [("eagle3", HEAD), ("peagle", PEAGLE_HEAD),
                                          ("dflash", DFLASH_HEAD)])
def test_installed_package_carries_the_head(method, path):
    """`eaglejax generate` finds the heads through the installed package (a wheel copies
    `checkpoints/`, a source checkout links it): every file as in the repository."""
    installed = shipped_head("smollm2-135m-instruct", method)
    assert installed is not None
    files = sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(installed) for p in installed.rglob("*")
                                     if p.is_file())
    for name in files:
        assert (installed / name).read_bytes() == (path / name).read_bytes(), name
    assert shipped_head("no-such-model") is None
