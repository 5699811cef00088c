"""eaglejax's own target checkpoint: exact round trip, no overwriting, clear failures."""

import jax
import numpy as np
import pytest

import eaglejax
from eaglejax import EaglejaxError, LoadError
from eaglejax.loading.checkpoint import save_target


def test_round_trip_is_exact(tmp_path, target_of):
    target = target_of("qwen2")
    save_target(target, tmp_path / "ckpt")
    loaded = eaglejax.load_target(tmp_path / "ckpt")
    assert loaded.config == target.config
    assert loaded.eos_token_ids == target.eos_token_ids
    for a, b in zip(jax.tree.leaves(target.params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(target.params) == jax.tree.structure(loaded.params)


def test_dtype_can_change_on_load(tmp_path, target_of):
    save_target(target_of("llama"), tmp_path / "ckpt")
    loaded = eaglejax.load_target(tmp_path / "ckpt", dtype="bfloat16")
    assert loaded.dtype == np.dtype("bfloat16")


def test_refuses_to_overwrite(tmp_path, target_of):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "precious.txt").write_text("keep me")
    with pytest.raises(EaglejaxError, match="refusing to overwrite"):
        save_target(target_of("llama"), tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "precious.txt").read_text() == "keep me"


def test_damaged_checkpoint_is_reported(tmp_path, target_of):
    path = save_target(target_of("llama"), tmp_path / "ckpt")
    manifest = (path / "eaglejax.json").read_text()
    (path / "eaglejax.json").write_text(manifest.replace('"version": 1', '"version": 99'))
    with pytest.raises(LoadError, match="version 99"):
        eaglejax.load_target(path)
    (path / "eaglejax.json").write_text(manifest.replace('"num_hidden_layers": 3',
                                                        '"num_hidden_layers": 4'))
    with pytest.raises(LoadError, match="params"):
        eaglejax.load_target(path)
