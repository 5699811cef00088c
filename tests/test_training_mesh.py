"""Training a head data-parallel over a mesh (the frozen target split like inference, the
head replicated, each batch's rows split over dp): the same training as one device, and
a resumed run bit-identical to an uninterrupted one on the same mesh; for an EAGLE-3 head
and a DFlash drafter. Runs in a subprocess with 8 host CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_data_parallel_training_on_a_mesh(tmp_path):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags,
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(HERE / "test_training_mesh.py"), str(tmp_path)],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mesh training ok" in proc.stdout


def _train_on_meshes(directory: Path) -> None:
    from eaglejax.training.trainer import TrainConfig
    from test_training import V, make_tiny_target, sample_rows

    one = make_tiny_target()
    rows = sample_rows(one, 32)
    config = TrainConfig(seq_len=64, batch_size=4, steps=6, lr=1e-3, draft_vocab_size=48,
                         checkpoint_every=2, log_every=1, eval_every=0)
    _check_mesh_training(one, rows, config, directory / "eagle3")
    dflash = TrainConfig(seq_len=64, batch_size=4, steps=6, lr=1e-3, block_size=4,
                         mask_token_id=V - 1, num_layers=2, num_anchors=8,
                         checkpoint_every=2, log_every=1, eval_every=0)
    _check_mesh_training(one, rows, dflash, directory / "dflash")
    print("mesh training ok")


def _check_mesh_training(one, rows, config, directory: Path) -> None:
    import jax
    import numpy as np

    import eaglejax
    from eaglejax.training import trainer
    from eaglejax.training.trainer import train
    from tolerances import FORWARD_UNITS, assert_close_scaled

    alone = train(one, rows, directory / "one", config, progress=False)

    mesh = eaglejax.make_mesh(tp=2, dp=2, devices=jax.devices()[:4])
    sharded = one.on_mesh(mesh)
    straight = train(sharded, rows, directory / "mesh", config, progress=False)
    for leaf in jax.tree.leaves(straight.draft.params):
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 4
    # The same training: only the order of the partial sums differs (rows over dp, heads
    # and MLP over tp), a few float32 rounding units per step, compounded over 6 steps of
    # Adam; 50 units of each parameter's scale bounds it with room and still fails for a
    # single skipped or doubled update (~1e-3 of the scale at this learning rate).
    for a, b in zip(jax.tree.leaves(alone.draft.params), jax.tree.leaves(straight.draft.params)):
        assert_close_scaled(np.asarray(b), np.asarray(a), units=50 * FORWARD_UNITS)
    losses = [(e["loss"], e["step"]) for e in straight.log]
    assert_close_scaled([x for x, _ in losses], [e["loss"] for e in alone.log],
                        units=50 * FORWARD_UNITS, what="logged losses")

    # stop after step 5 (checkpoints at 2 and 4), resume: bit-identical to straight
    real_step = trainer._train_step

    def crashing_step(*args):
        step, calls = real_step(*args), []

        def run(*inputs):
            calls.append(1)
            if len(calls) == 5:
                raise RuntimeError("simulated crash")
            return step(*inputs)
        return run

    trainer._train_step = crashing_step
    try:
        train(sharded, rows, directory / "resumed", config, progress=False)
    except RuntimeError as err:
        assert "simulated crash" in str(err)
    else:
        raise AssertionError("the simulated crash did not happen")
    finally:
        trainer._train_step = real_step
    resumed = train(sharded, rows, directory / "resumed", config, progress=False)
    for a, b in zip(jax.tree.leaves(straight.draft.params),
                    jax.tree.leaves(resumed.draft.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [e["loss"] for e in resumed.log] == [e["loss"] for e in straight.log]


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    _train_on_meshes(Path(sys.argv[1]))
