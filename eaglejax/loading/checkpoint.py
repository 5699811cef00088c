"""eaglejax's own target checkpoint: orbax parameters + a JSON manifest + the tokenizer files.

Layout of a checkpoint directory:
  eaglejax.json   {"format": "eaglejax-target", "version": 1, "config": {...HF style...}, "dtype",
                   "weight_dtype" (the matrices': a float dtype, or "int8": those whose shape
                   tiles are stored packed with their scales, `models.quantized`, or
                   "blocks": GGUF blocks as `models.gguf_blocks` keeps them, int4 storage
                   included, with "blocks": {parameter path: block kind}; the other
                   matrices in the compute dtype),
                   "files": {path: [size, crc32]} of every other file}
  params/         orbax StandardCheckpointer tree of the parameter dict
  tokenizer.json, tokenizer_config.json   when the model has a tokenizer

The manifest is written last and atomically: a directory without it is an interrupted save.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from eaglejax.config import ModelConfig
from eaglejax.errors import EaglejaxError, LoadError
from eaglejax.loading.files import file_checksums, verify_checksums, write_atomically
from eaglejax.loading.hf_dir import read_json
from eaglejax.loading.orbax_io import restore_tree
from eaglejax.models import gguf_blocks
from eaglejax.models.llama import Params, is_param_info, logical_axes, param_info
from eaglejax.models.placement import TargetPlacement
from eaglejax.models.quantized import Int8Matrix, is_int8, tiles
from eaglejax.sharding.rules import shardings
from eaglejax.tokenizer import Tokenizer

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
        checkpointer.save(path / "params", _blocks_as(target.params, "savable"))
    if target.tokenizer is not None:
        target.tokenizer.save(path)
    blocks = gguf_blocks.kinds_by_path(target.params)
    weight_dtype = {"weight_dtype": "blocks", "blocks": blocks} if blocks else \
        {"weight_dtype": jnp.dtype(target.weight_dtype).name}
    manifest = {"format": FORMAT, "version": VERSION, "config": target.config.to_hf_dict(),
                "dtype": jnp.dtype(target.dtype).name, **weight_dtype, "source": target.source,
                "eos_token_ids": list(target.eos_token_ids),
                "files": file_checksums(path, sorted(p.name for p in path.iterdir()))}
    write_atomically(path / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return path


def saved_dtype_of(manifest: dict, source: str, key: str = "dtype") -> jnp.dtype:
    """The parameter dtype a manifest records under `key` ("weight_dtype": the matrices';
    both float32 when absent, the weight dtype defaulting to the parameter dtype)."""
    value = manifest.get(key, manifest.get("dtype", "float32"))
    try:
        return jnp.dtype(value)
    except TypeError:
        raise LoadError(f"{source}: unknown {key} {value!r}") from None


def load_checkpoint(path: Path, dtype: jnp.dtype | None, mesh: Mesh | None = None):
    """(config, params, tokenizer or None, eos ids) from a checkpoint directory. With a
    `mesh`, each parameter is read straight into its sharding there (orbax reads only each
    device's slice) unless the model's KV heads must be widened for the mesh first or the
    matrices are quantized (saved `flat`, split on a mesh: `eaglejax.models.placement`):
    then they are read into host memory (numpy) and the caller places them, so that no
    device holds the whole model."""
    manifest = read_json(path / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise LoadError(f"{path / MANIFEST}: format is {manifest.get('format')!r}, "
                        f"expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise LoadError(f"{path / MANIFEST}: version {manifest.get('version')!r} is not "
                        f"supported (this eaglejax reads version {VERSION})")
    if "files" in manifest:  # checkpoints written before checksums were recorded lack it
        verify_checksums(path, manifest["files"], str(path / MANIFEST))
    config = ModelConfig.from_hf_dict(manifest.get("config") or {}, str(path / MANIFEST))
    saved_dtype = saved_dtype_of(manifest, str(path / MANIFEST))
    blocks = _block_kinds(manifest, config, str(path / MANIFEST))
    weight_dtype = jnp.dtype(jnp.int8) if blocks is not None else \
        saved_dtype_of(manifest, str(path / MANIFEST), "weight_dtype")

    int8 = weight_dtype == jnp.int8

    def stored(key, info):
        if blocks is not None:  # the saved blocks, the other matrices in the compute dtype
            kind = blocks.get(jax.tree_util.keystr(key))
            return gguf_blocks.abstract(info.shape, kind) if kind else \
                jax.ShapeDtypeStruct(info.shape, saved_dtype)
        if int8 and info.matrix:  # int8 where the shape tiles, else as the compute dtype
            return Int8Matrix.abstract(info.shape) if tiles(info.shape) \
                else jax.ShapeDtypeStruct(info.shape, saved_dtype)
        return jax.ShapeDtypeStruct(info.shape, weight_dtype if info.matrix else saved_dtype)

    abstract = jax.tree_util.tree_map_with_path(stored, param_info(config),
                                                is_leaf=is_param_info)
    if mesh is not None and not int8 and TargetPlacement.plan(config, mesh).factor == 1:
        where = shardings(mesh, logical_axes(config), abstract)
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract, where)
    elif mesh is not None:  # the caller splits them: read to the host, never whole on a device
        abstract = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    params: Params = _blocks_as(restore_tree(path / "params", abstract), "restored")
    if dtype is not None and jnp.dtype(dtype) != saved_dtype:
        params = jax.tree.map(lambda a: a if is_int8(a) else a.astype(dtype), params,
                              is_leaf=is_int8)
    tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
    eos_ids = tuple(int(i) for i in manifest.get("eos_token_ids", []))
    return config, params, tokenizer, eos_ids


def _block_kinds(manifest: dict, config: ModelConfig, source: str) -> dict[str, str] | None:
    """A block checkpoint's {parameter path: block kind} (None: no blocks), checked against
    the model's matrices and the kinds this eaglejax reads."""
    if manifest.get("weight_dtype") != "blocks":
        return None
    blocks = manifest.get("blocks")
    if not isinstance(blocks, dict) or not blocks:
        raise LoadError(f"{source}: weight_dtype 'blocks' needs a 'blocks' map of parameter "
                        f"paths to block kinds")
    matrices = {jax.tree_util.keystr(key): info.shape for key, info in
                jax.tree_util.tree_flatten_with_path(param_info(config),
                                                     is_leaf=is_param_info)[0] if info.matrix}
    for key, kind in blocks.items():
        if key not in matrices:
            raise LoadError(f"{source}: 'blocks' names {key!r}, not a matrix of this model")
        try:
            fits = gguf_blocks.fits(matrices[key], kind)
        except ValueError as err:
            raise LoadError(f"{source}: 'blocks' gives {key!r} the kind {kind!r}; this "
                            f"eaglejax reads {sorted(gguf_blocks.KINDS)} and parts of them "
                            f"({err})") from None
        if not fits:
            raise LoadError(f"{source}: {key!r} of shape {matrices[key]} cannot be kept in "
                            f"blocks")
    return blocks


def _blocks_as(params: Params, form: str) -> Params:
    """`params` with every quantized matrix in its `savable` or `restored` form."""
    return jax.tree.map(lambda leaf: getattr(leaf, form)() if is_int8(leaf) else leaf,
                        params, is_leaf=is_int8)
