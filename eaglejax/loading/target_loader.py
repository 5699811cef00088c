"""`load_target`: one entry point for every way a target model can arrive."""

from __future__ import annotations

import functools
import itertools
import operator
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eaglejax import hardware, validation
from eaglejax.config import ModelConfig
from eaglejax.errors import InputError, LoadError
from eaglejax.loading import checkpoint
from eaglejax.loading.builtin import resolve_builtin
from eaglejax.loading.files import require_regular_file
from eaglejax.loading.gguf_file import read_gguf
from eaglejax.loading.hf_dir import HFWeights, read_json
from eaglejax.loading.hub import ResolvedSource, named_errors, resolve_source
from eaglejax.loading.weights import (
    FUSED_AXIS, Placer, Stored, fuse_matrix, fused_part, params_from_hf)
from eaglejax.models.gguf_blocks import (
    KINDS, VOCABULARY_KIND, BlockMatrix, HostBlocks, PartsMatrix, kinds, pack, tiles)
from eaglejax.models.llama import (
    four_bit_kind, is_quantizing, is_vocabulary, param_info, store_matrix)
from eaglejax.models.quantized import any_int8, is_int8
from eaglejax.models.placement import TargetPlacement
from eaglejax.native import build
from eaglejax.target import FLOAT_DTYPES, Target, WeightStorage, weight_storage
from eaglejax.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"
GGUF_BLOCKS = "gguf"  # weight_dtype: a GGUF file's quantized blocks kept as stored


def default_dtype() -> jnp.dtype:
    """float32 on CPU, bfloat16 on GPU/TPU."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def fastest_weight_dtype() -> jnp.dtype | None:
    """The storage of a target's matrices that decodes fastest here: bfloat16 on a CPU with
    AVX-512 where the native kernels run (half the bytes a step reads; plain decoding 1.46x
    faster than float32 on an AMD Zen 4 (the kernel widens the stored values in registers)
    and on an Intel Xeon with AMX tiles (the tile unit multiplies them), BENCHMARKS.md);
    None (as loaded) elsewhere: GPUs and TPUs already compute in bfloat16, XLA alone widens
    16-bit storage more slowly than it reads float32, and AVX2-only CPUs are unmeasured."""
    if jax.default_backend() != "cpu" or not build.enabled() or build.compiler() is None:
        return None
    wide_vectors = {"avx512f"} <= set(hardware.isa_features())
    return jnp.dtype(jnp.bfloat16) if wide_vectors else None


def blocks_decode_fastest() -> bool:
    """Whether a GGUF file's own blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K: `models.gguf_blocks`)
    decode faster here than any storage `fastest_weight_dtype` picks: on a CPU with AVX-512 VNNI
    where the native kernels run (`native.block_matmul`; BENCHMARKS.md)."""
    if jax.default_backend() != "cpu" or not build.enabled() or build.compiler() is None:
        return False
    return {"avx512f", "avx512_vnni"} <= set(hardware.isa_features())


def load_target(path_or_name: str | Path | ResolvedSource, *,
                dtype: jnp.dtype | str | None = None, weight_dtype: jnp.dtype | str | None = None,
                mesh: Mesh | None = None) -> Target:
    """Load a target from a built-in name, a GGUF file, an HF directory, an eaglejax
    checkpoint or a Hugging Face Hub id (`org/name`, `org/name@revision`; a local path of
    that name wins: `loading.hub.resolve_source`).
    `dtype`: compute and parameter dtype; `weight_dtype`: store the matrices
    in another (e.g. bfloat16 under float32 compute, or "int8": `Target.with_weight_dtype`), "auto"
    for the storage that decodes fastest on this machine (a GGUF file's own blocks where
    `blocks_decode_fastest`, else `fastest_weight_dtype`; what `eaglejax generate`,
    `eaglejax bench` and `eaglejax.generate()` use; a checkpoint saved in int8, int4 or a
    GGUF file's blocks stays as saved),
    "gguf" for a GGUF file's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K matrices as stored
    (`models.gguf_blocks`),
    None as loaded.
    `mesh` (`eaglejax.make_mesh`): every weight goes from the file straight into its
    sharding on the mesh (`eaglejax.models.placement`), never whole onto one device; a
    GGUF file's blocks and a quantized checkpoint's matrices split with their scales, and
    int8/int4/int4-sym quantize each float matrix of a GGUF file or HF directory on the
    host as it is read and split it the same way (without a mesh, each goes onto the
    device quantized: the float model is never on a device)."""
    if not isinstance(path_or_name, (str, os.PathLike, ResolvedSource)):
        raise InputError(f"load_target wants a model name or path, got {path_or_name!r}")
    if dtype is not None:
        dtype = validation.dtype("dtype", dtype, FLOAT_DTYPES)
    auto = isinstance(weight_dtype, str) and weight_dtype == "auto"
    keep_blocks: bool | str = isinstance(weight_dtype, str) and weight_dtype == GGUF_BLOCKS
    if auto:
        weight_dtype = fastest_weight_dtype()
        keep_blocks = "auto" if mesh is None and blocks_decode_fastest() else False
    if keep_blocks is True:
        weight_dtype = None
    elif weight_dtype is not None:
        weight_dtype = weight_storage("weight_dtype", weight_dtype)
    if mesh is not None and not isinstance(mesh, Mesh):
        raise InputError(f"mesh must be a jax.sharding.Mesh (eaglejax.make_mesh), "
                         f"got {type(mesh).__name__}")
    if jax.default_backend() == "cpu":
        build.start_builds()  # the native kernels compile while the model loads
    quantize = weight_dtype if weight_dtype is not None and is_quantizing(weight_dtype) else None
    target = _load(path_or_name, dtype, mesh, keep_blocks, quantize)
    if target.weight_dtype == jnp.int8 and (
            auto or _stored_as_asked(target, weight_dtype, keep_blocks is True)):
        return target  # a quantized checkpoint: stored as it asks, or as quantized on purpose
    return target if weight_dtype is None else target.with_weight_dtype(weight_dtype)


def _stored_as_asked(target: Target, weight_dtype: WeightStorage | None, blocks_asked: bool
                     ) -> bool:
    """Whether a quantized target's matrices are what `weight_dtype` (int8, int4, int4-sym)
    or, with `blocks_asked`, "gguf" asks for."""
    kept = kinds(target.params)
    if not kept:
        return isinstance(weight_dtype, jnp.dtype) and weight_dtype == jnp.int8
    layers = [kind for kind in kept if kind != VOCABULARY_KIND]  # 4-bit: vocabulary in 8
    asked = None if weight_dtype is None else four_bit_kind(weight_dtype)
    return blocks_asked or (asked is not None and layers == [asked])


def _load(path_or_name: str | Path | ResolvedSource, dtype: jnp.dtype | str | None,
          mesh: Mesh | None, keep_blocks: bool | str = False,
          quantize: WeightStorage | None = None) -> Target:
    """`keep_blocks`: True keeps a GGUF file's blocks or refuses; "auto" keeps them where a
    GGUF file has any. `quantize`: a GGUF file's or HF directory's matrices stored so as
    they are read (`_storing`; a checkpoint loads as saved)."""
    source = path_or_name
    if not isinstance(source, ResolvedSource):
        builtin = resolve_builtin(source) if isinstance(source, str) else None
        source = ResolvedSource(builtin) if builtin else resolve_source(source)
    path = source.path
    if not path.exists():
        raise LoadError(f"{path}: no such file or directory, and not a built-in model name "
                        f"(built-in: smollm2-135m-instruct)")
    with named_errors(source):
        return _load_path(path, source.name, dtype, mesh, keep_blocks, quantize)


def _load_path(path: Path, name: str, dtype: jnp.dtype | str | None,
               mesh: Mesh | None, keep_blocks: bool | str,
               quantize: WeightStorage | None) -> Target:
    dtype = jnp.dtype(dtype) if dtype is not None else None
    if path.is_dir() and checkpoint.is_checkpoint(path):
        config, params, tokenizer, eos_ids = checkpoint.load_checkpoint(path, dtype, mesh)
        if not kinds(params):  # a checkpoint of GGUF blocks keeps them
            _not_gguf(path, keep_blocks)
        target = Target(config, params, tokenizer, name, eos_ids)
        return target if mesh is None else target.on_mesh(mesh)
    dtype = dtype or default_dtype()
    if path.is_dir():
        if (path / "params").is_dir() and not (path / "config.json").exists():
            raise LoadError(f"{path / checkpoint.MANIFEST}: missing, so {path} is not a "
                            f"complete eaglejax checkpoint (its save was interrupted, or the "
                            f"manifest was deleted)")
        _not_gguf(path, keep_blocks)
        return _load_hf_dir(path, name, dtype, mesh, quantize)
    require_regular_file(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC or path.suffix == ".gguf":
        return _load_gguf(path, name, dtype, mesh, keep_blocks, quantize)
    raise LoadError(f"{path}: not a GGUF file, Hugging Face directory or eaglejax checkpoint")


def _not_gguf(path: Path, keep_blocks: bool | str) -> None:
    if keep_blocks is True:
        raise InputError(f"{path}: weight_dtype {GGUF_BLOCKS!r} keeps a GGUF file's quantized "
                         f"blocks, and this is not a GGUF file; pick int8 or a float dtype")


def _load_hf_dir(path: Path, name: str, dtype: jnp.dtype, mesh: Mesh | None,
                 quantize: WeightStorage | None) -> Target:
    config_path = path / "config.json"
    config = ModelConfig.from_hf_dict(read_json(config_path), str(config_path))
    weights = HFWeights(path)
    placement = _placement(config, mesh)
    params = params_from_hf(weights.get, weights.shapes(), config, str(path), dtype,
                            _storing(config, placement, quantize))
    config, mesh = (placement.config, placement.mesh) if placement else (config, None)
    if (path / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_hf_dir(path)
        return Target(config, params, tokenizer, name, tuple(tokenizer.eos_token_ids),
                      mesh=mesh)
    return Target(config, params, None, name, _config_eos_ids(path), mesh=mesh)


def _placement(config: ModelConfig, mesh: Mesh | None):
    """The plan for putting this model on `mesh`, or None without one."""
    if mesh is None:
        return None

    return TargetPlacement.plan(config, mesh)


def _storing(config: ModelConfig, placement: TargetPlacement | None,
             quantize: WeightStorage | None) -> Placer | None:
    """`params_from_hf`'s `place`: each parameter onto `placement`'s mesh (None: the
    default device), with `quantize` each matrix first quantized on the host from the float
    array just read (`llama.store_matrix`), so that no float matrix reaches a device."""
    if quantize is None:
        return placement and placement.place
    infos = param_info(config)

    def place(path: tuple, host: Any) -> Any:
        info = functools.reduce(operator.getitem, path, infos)
        if info.matrix and not is_int8(host):
            host = store_matrix(host, quantize, host=True, vocabulary=is_vocabulary(info))
        if placement is not None:
            return placement.place(path, host)
        return jax.tree.map(jnp.asarray, host)

    return place


def _config_eos_ids(path: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (an int or a list)."""
    for name in ("generation_config.json", "config.json"):
        if (path / name).exists():
            eos = read_json(path / name).get("eos_token_id")
            if eos is not None:
                return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    return ()


def _load_gguf(path: Path, name: str, dtype: jnp.dtype, mesh: Mesh | None,
               keep_blocks: bool | str, quantize: WeightStorage | None) -> Target:
    model = read_gguf(path, keep_blocks=bool(keep_blocks))
    config = ModelConfig.from_hf_dict(model.config, str(path))
    shapes = {name: tuple(t.shape) for name, t in (*model.tensors.items(), *model.blocks.items())}
    placement = _placement(config, mesh)

    def get(name: str) -> np.ndarray:  # a matrix whose blocks stay stored is never asked for
        return model.tensors[name] if name in model.tensors else model.blocks[name].dequantized()

    params = params_from_hf(get, shapes, config, str(path), dtype,
                            _storing(config, placement, quantize),
                            stored=_stored_blocks(config, model.blocks, placement is not None)
                            if keep_blocks else None)
    if keep_blocks is True and not any_int8(params):
        raise LoadError(f"{path}: weight_dtype {GGUF_BLOCKS!r}: no matrix is stored in a block "
                        f"type eaglejax computes with as stored ({', '.join(KINDS)}); load "
                        f"it with int8 or a float dtype")
    config, mesh = (placement.config, placement.mesh) if placement else (config, None)
    return Target(config, params, model.tokenizer, name,
                  tuple(model.tokenizer.eos_token_ids), mesh=mesh)


def _stored_blocks(config: ModelConfig, blocks: dict[str, HostBlocks], host: bool) -> Stored:
    """`params_from_hf`'s `stored`: a matrix whose HF parts are all blocks, in the kernel's
    layout (`models.gguf_blocks.pack`; `host`: kept on the host, for a mesh) where its shape
    tiles; a fused one whose parts differ in kind as a `PartsMatrix` of its runs of one kind
    (each run packed)."""
    def stored(key: str, names: tuple[str, ...]) -> BlockMatrix | PartsMatrix | None:
        parts = [blocks.get(name) for name in names]
        if any(p is None for p in parts):
            return None
        if len({p.kind for p in parts}) == 1:
            fused = parts[0].map(lambda *a: fuse_matrix(config, key, list(a)), *parts[1:])
            return pack(fused, host) if tiles(fused.shape, fused.kind.per_block) else None
        runs = []
        for _, run in itertools.groupby(enumerate(parts), key=lambda ip: ip[1].kind):
            run = [p.map(lambda a, i=i: fused_part(config, key, i, a)) for i, p in run]
            runs.append(run[0].map(lambda *a: np.concatenate(a, axis=FUSED_AXIS[key]),
                                   *run[1:]))
        if not all(tiles(r.shape, r.kind.per_block) for r in runs):
            return None
        return PartsMatrix(tuple(pack(r, host) for r in runs), FUSED_AXIS[key])

    return stored
