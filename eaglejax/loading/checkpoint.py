"""eaglejax's own target checkpoint: orbax parameters + a JSON manifest + the tokenizer files.

Layout of a checkpoint directory:
  eaglejax.json   {"format": "eaglejax-target", "version": 1, "config": {...HF style...}, "dtype"}
  params/         orbax StandardCheckpointer tree of the parameter dict
  tokenizer.json, tokenizer_config.json   when the model has a tokenizer
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from eaglejax.config import ModelConfig
from eaglejax.errors import EaglejaxError, LoadError
from eaglejax.loading.hf_dir import read_json
from eaglejax.models.llama import Params, param_shapes

MANIFEST = "eaglejax.json"
FORMAT, VERSION = "eaglejax-target", 1


def is_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def save_target(target, path: str | Path) -> Path:
    """Write `target` to a new directory; refuses to touch an existing non-empty one."""
    path = Path(path).absolute()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise EaglejaxError(f"{path}: already exists and is not empty; refusing to overwrite")
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / "params", target.params)
    if target.tokenizer is not None:
        target.tokenizer.save(path)
    manifest = {"format": FORMAT, "version": VERSION, "config": target.config.to_hf_dict(),
                "dtype": jnp.dtype(target.dtype).name, "source": target.source,
                "eos_token_ids": list(target.eos_token_ids)}
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def load_checkpoint(path: Path, dtype: jnp.dtype | None):
    """(config, params, tokenizer or None, eos ids) from a checkpoint directory."""
    from eaglejax.tokenizer import Tokenizer

    manifest = read_json(path / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise LoadError(f"{path / MANIFEST}: format is {manifest.get('format')!r}, "
                        f"expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise LoadError(f"{path / MANIFEST}: version {manifest.get('version')!r} is not "
                        f"supported (this eaglejax reads version {VERSION})")
    config = ModelConfig.from_hf_dict(manifest.get("config") or {}, str(path / MANIFEST))
    saved_dtype = jnp.dtype(manifest.get("dtype", "float32"))
    abstract = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, saved_dtype),
                            param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params: Params = checkpointer.restore(path.absolute() / "params", abstract)
    except Exception as err:  # orbax raises many kinds for missing or mismatched trees
        raise LoadError(f"{path / 'params'}: cannot restore parameters ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if dtype is not None and jnp.dtype(dtype) != saved_dtype:
        params = jax.tree.map(lambda a: a.astype(dtype), params)
    tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
    eos_ids = tuple(int(i) for i in manifest.get("eos_token_ids", []))
    return config, params, tokenizer, eos_ids
