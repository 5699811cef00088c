"""The model's single attention interface: dispatch, and Pallas (interpret) == XLA end to end."""

import dataclasses

import jax
import numpy as np
import pytest

import eaglejax
from eaglejax.models.attention import resolve_impl
from tolerances import FORWARD_UNITS, assert_close_scaled


def test_auto_is_pallas_on_accelerators_xla_on_cpu_and_names_are_checked():
    accelerator = jax.default_backend() in ("gpu", "tpu")
    assert resolve_impl("auto") == ("pallas" if accelerator else "xla")
    assert resolve_impl("pallas") == "pallas"
    with pytest.raises(ValueError, match="attention impl"):
        resolve_impl("flash")


def test_generation_with_pallas_kernel_matches_xla(target_of):
    target = target_of("qwen3")  # GQA group 2, head_dim 32
    pallas = dataclasses.replace(target, attn_impl="pallas")
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, 97, size=n).tolist() for n in (3, 11)]
    want = eaglejax.generate(prompts, target=dataclasses.replace(target, attn_impl="xla"),
                             max_new_tokens=6, ignore_eos=True)
    got = eaglejax.generate(prompts, target=pallas, max_new_tokens=6, ignore_eos=True)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    ids = np.asarray([prompts[1]])
    # Noise 3.5 units here (1.4e-6 for logits up to 1.9), 6.2 across emulated CPUs; a wrong
    # epsilon is 300 units and up.
    assert_close_scaled(pallas.logits(ids), target.logits(ids), units=FORWARD_UNITS,
                        depth=target.config.num_layers)
