"""Load a Hugging Face model directory: config.json + safetensors (single or sharded) or .bin."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Callable

import numpy as np

from eaglejax.errors import LoadError
from eaglejax.loading.files import require_regular_file
from eaglejax.loading.safetensors_file import SafetensorsFile


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, or LoadError naming it."""
    require_regular_file(path)
    try:
        with open(path) as f:
            value = json.load(f)
    except OSError as err:
        raise LoadError(f"{path}: cannot read ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LoadError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise LoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _hub_blobs(path: Path) -> Path | None:
    """The blob store of the Hugging Face cache repository holding `path`
    (`models--org--name/snapshots/<revision>/...`, whose files link to `../../blobs/`)."""
    for snapshot in path.parents:
        if snapshot.parent.name == "snapshots" and (snapshot.parent.parent / "blobs").is_dir():
            return (snapshot.parent.parent / "blobs").resolve()
    return None


def _shard_path(directory: Path, index: Path, name: str) -> Path:
    """The safetensors shard `name` that `index` lists, refusing a name or a link that leads
    out of the model folder (links into the Hugging Face cache's blob store excepted)."""
    relative, as_windows = PurePosixPath(name), PureWindowsPath(name)
    if relative.is_absolute() or as_windows.anchor or ".." in relative.parts + as_windows.parts:
        raise LoadError(f"{index}: shard {name!r} lies outside {directory}; refusing to read it")
    shard = directory / relative
    if not shard.exists():
        raise LoadError(f"{index}: shard {name!r} is missing from {directory}")
    real, blobs = shard.resolve(), _hub_blobs(directory.absolute() / relative)
    if not (real.is_relative_to(directory.resolve()) or (blobs and real.is_relative_to(blobs))):
        raise LoadError(f"{index}: shard {name!r} is a link to {real}, outside {directory}; "
                        f"refusing to read it (copy the file into the folder)")
    return shard


class HFWeights:
    """Uniform access to the tensors of an HF directory, whatever the file layout."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._getters: dict[str, Callable[[], np.ndarray]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
        if single.exists():
            self._add_safetensors(SafetensorsFile(single))
        elif index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise LoadError(f"{index}: missing 'weight_map'")
            names = set(weight_map.values())
            if not all(isinstance(name, str) and name for name in names):
                raise LoadError(f"{index}: 'weight_map' values must be file names")
            for shard_name in sorted(names):
                self._add_safetensors(SafetensorsFile(_shard_path(directory, index, shard_name)))
        elif (directory / "pytorch_model.bin").exists():
            self._add_torch_bin(directory / "pytorch_model.bin")
        else:
            raise LoadError(f"{directory}: no weights found (looked for model.safetensors, "
                            f"model.safetensors.index.json, pytorch_model.bin)")

    def _add_safetensors(self, st: SafetensorsFile) -> None:
        for name, shape in st.shapes().items():
            self._shapes[name] = shape
            self._getters[name] = lambda st=st, name=name: st.get(name)

    def _add_torch_bin(self, path: Path) -> None:
        try:
            import torch
        except ImportError:
            raise LoadError(f"{path}: reading pytorch_model.bin needs PyTorch "
                            f"(pip install torch), or convert it to safetensors") from None
        require_regular_file(path)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises many kinds for corrupt files
            raise LoadError(f"{path}: cannot read PyTorch checkpoint ({err})") from None
        for name, tensor in state.items():
            self._shapes[name] = tuple(tensor.shape)
            self._getters[name] = lambda t=tensor: t.float().numpy() if t.is_floating_point() \
                else t.numpy()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def get(self, name: str) -> np.ndarray:
        if name not in self._getters:
            raise LoadError(f"{self.directory}: no tensor named {name!r}")
        return np.asarray(self._getters[name]())
