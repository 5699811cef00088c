"""The EAGLE-3 head shipped for SmolLM2-135M-Instruct (`checkpoints/`): it loads, its
drafts are accepted at the rate its model card states, and it exports to the reference
EAGLE-3 and speculators layouts without loss."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import eaglejax
from eaglejax import SpecConfig
from eaglejax.draft.formats import WRITERS
from eaglejax.training.pipeline import mt_bench_prompts

pytestmark = pytest.mark.slow

HEAD = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct-eagle3"


@pytest.fixture(scope="module")
def head(smollm2):
    return eaglejax.load_draft(HEAD, target=smollm2)


def test_acceptance_is_what_the_model_card_states(head, smollm2):
    card = json.loads((HEAD / "evaluation.json").read_text())
    prompts = mt_bench_prompts(card["mt_bench_first_turns"])
    common = dict(target=smollm2, max_new_tokens=card["max_new_tokens"])
    plain = eaglejax.generate(prompts, **common)
    spec = eaglejax.generate(prompts, draft=head, speculative=SpecConfig.chain(5), **common)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    measured = float(np.mean([s.metrics.acceptance_length for s in spec]))
    # The card's figure was measured with this very call; float32 rounding on another CPU
    # may flip a near-tie token, hence the small tolerance. An untrained head scores 1.0.
    assert measured == pytest.approx(card["acceptance_length_chain5"], abs=0.03)
    assert measured > 1.15


@pytest.mark.parametrize("layout", ["reference", "speculators"])
def test_exports_reload_exactly(layout, head, smollm2, tmp_path):
    WRITERS[layout](head, str(tmp_path / layout))
    again = eaglejax.load_draft(tmp_path / layout, target=smollm2)
    assert again.config == head.config
    np.testing.assert_array_equal(np.asarray(again.d2t), np.asarray(head.d2t))
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(head.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_installed_package_carries_the_head():
    """`eaglejax generate` finds the head through the installed package (a wheel copies
    `checkpoints/`, a source checkout links it): every file as in the repository."""
    from eaglejax.draft.shipped import shipped_head

    installed = shipped_head("smollm2-135m-instruct")
    assert installed is not None
    files = sorted(p.relative_to(HEAD) for p in HEAD.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(installed) for p in installed.rglob("*")
                                     if p.is_file())
    for name in files:
        assert (installed / name).read_bytes() == (HEAD / name).read_bytes(), name
    assert shipped_head("no-such-model") is None
