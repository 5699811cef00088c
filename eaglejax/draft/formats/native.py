"""eaglejax's own draft-head format, mirroring the target checkpoint.

Layout of a head directory:
  eaglejax.json  {"format": "eaglejax-draft", "version": 1, "config": DraftConfig.to_dict(),
                  "dtype", "tap_semantics": "entering", "source",
                  "files": {path: [size, crc32]} of params/ and d2t.npy}
  params/        orbax StandardCheckpointer tree of the head's parameter dict
  d2t.npy        int32 [DV] draft -> target offsets (target id = i + d2t[i])

The manifest is written last and atomically: a directory without it is an interrupted save.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from eaglejax.config import ModelConfig
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.formats.common import ReadResult, prepare_output_dir, validate
from eaglejax.draft.head import param_shapes
from eaglejax.errors import ConfigError, LoadError
from eaglejax.loading.checkpoint import saved_dtype_of
from eaglejax.loading.files import (
    file_checksums,
    require_regular_file,
    verify_checksums,
    write_atomically,
)
from eaglejax.loading.hf_dir import read_json
from eaglejax.loading.orbax_io import restore_tree
from eaglejax.models.llama import Params

if TYPE_CHECKING:  # annotations only: `Draft.save` calls `write_head` below
    from eaglejax.draft.draft import Draft

MANIFEST = "eaglejax.json"
FORMAT, VERSION = "eaglejax-draft", 1


def manifest_format(path: Path) -> str | None:
    """The `format` named by an eaglejax manifest in `path`, or None when there is none."""
    manifest = path / MANIFEST
    return read_json(manifest).get("format") if manifest.is_file() else None


def save_draft(draft: "Draft", path: str | Path) -> Path:
    """Write `draft` as an eaglejax head directory; refuses to touch a non-empty one."""
    return write_head(draft.config, draft.params, draft.d2t, draft.source, path)


def write_head(config: DraftConfig, params: Params, d2t: np.ndarray | jax.Array, source: str,
               path: str | Path) -> Path:
    """Write a head's parts as an eaglejax head directory (a new or empty one)."""
    out = prepare_output_dir(path)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out / "params", params)
    np.save(out / "d2t.npy", np.asarray(d2t, np.int32))
    dtype = jnp.dtype(jax.tree.leaves(params)[0].dtype).name
    manifest = {"format": FORMAT, "version": VERSION, "config": config.to_dict(),
                "dtype": dtype, "tap_semantics": "entering", "source": source,
                "files": file_checksums(out, ["params", "d2t.npy"])}
    write_atomically(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return out


def read_native(path: Path, target: ModelConfig, weights: object = None) -> ReadResult:
    """(config, params in the saved dtype, int32 d2t) of an eaglejax head directory."""
    manifest_path = path / MANIFEST
    source = str(manifest_path)
    manifest = read_json(manifest_path)
    if manifest.get("format") != FORMAT:
        raise LoadError(f"{source}: format is {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise LoadError(f"{source}: version {manifest.get('version')!r} is not supported "
                        f"(this eaglejax reads version {VERSION})")
    if manifest.get("tap_semantics", "entering") != "entering":
        raise ConfigError(f"{source}: tap_semantics {manifest['tap_semantics']!r} is not "
                          f"supported (expected 'entering')")
    if "files" in manifest:  # heads written before checksums were recorded lack it
        verify_checksums(path, manifest["files"], source)
    try:
        config = DraftConfig.from_dict(manifest["config"], source)
    except (KeyError, TypeError, ValueError) as err:
        raise LoadError(f"{source}: malformed 'config' ({type(err).__name__}: {err})") from None
    saved_dtype = saved_dtype_of(manifest, source)
    abstract = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, saved_dtype),
                            param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    params = restore_tree(path / "params", abstract)
    d2t_path = path / "d2t.npy"
    require_regular_file(d2t_path)
    try:
        d2t = np.load(d2t_path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise LoadError(f"{d2t_path}: cannot read ({err}); the file is damaged") from None
    validate(config, params, d2t, target, source)
    return config, params, d2t.astype(np.int32)
