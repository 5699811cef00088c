"""`decoding.speculation`: the one place where a target, a head and a requested shape are
checked against each other and the default shape is chosen; `generate` and the serving
engine give the same answers through it."""

import dataclasses

import jax
import pytest

import eaglejax
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.speculation import AUTO, resolve_speculation
from eaglejax.serving.engine import Engine
from spec_helpers import random_eagle3


@pytest.fixture(scope="module")
def pair(target_of):
    target = target_of("llama")
    return target, random_eagle3(target, seed=1)


def test_defaults_none_auto_or_the_preset(pair):
    target, head = pair
    assert resolve_speculation(target, None, None, 1, auto_by_default=True) is None
    assert resolve_speculation(target, head, None, 1, auto_by_default=True) == AUTO
    preset = SpecConfig.default_for(False, jax.default_backend(), 4)
    assert resolve_speculation(target, head, None, 4, auto_by_default=False) == preset
    chain = SpecConfig.chain(3)
    assert resolve_speculation(target, head, chain, 4, auto_by_default=True) is chain


@pytest.mark.parametrize("case, error, match", [
    ("parallel shape, sequential head", eaglejax.ConfigError, "parallel K=4 needs a P-EAGLE"),
    ("head of another target", eaglejax.ConfigError, "loaded for target"),
    ("shape without head", eaglejax.InputError,
     r"speculative \(chain K=3\) drafts with a draft head"),
    ("not a shape", eaglejax.InputError, "speculative must be a SpecConfig"),
])
def test_generate_and_the_engine_refuse_alike(pair, case, error, match):
    target, head = pair
    other = dataclasses.replace(target)  # an equal but distinct Target
    kwargs = {"parallel shape, sequential head": dict(draft=head,
                                                      speculative=SpecConfig.parallel(4)),
              "head of another target": dict(draft=head),
              "shape without head": dict(draft=None, speculative=SpecConfig.chain(3)),
              "not a shape": dict(draft=head, speculative="fastest")}[case]
    on = other if case == "head of another target" else target
    with pytest.raises(error, match=match):
        eaglejax.generate([[1, 2, 3]], target=on, max_new_tokens=2, **kwargs)
    with pytest.raises(error, match=match):
        Engine(on, kwargs["draft"], speculative=kwargs.get("speculative"), capacity=256)
