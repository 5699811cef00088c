"""A validating safetensors reader (numpy, memory-mapped, bfloat16 included)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from eaglejax.errors import LoadError
from eaglejax.loading.files import require_regular_file

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile:
    """Header parsed and checked against the file size on open; tensors read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        require_regular_file(self.path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                raw_len = f.read(8)
                if len(raw_len) < 8:
                    raise LoadError(f"{self.path}: not a safetensors file (only {size} bytes)")
                (header_len,) = struct.unpack("<Q", raw_len)
                if header_len > size - 8:
                    raise LoadError(f"{self.path}: corrupt or truncated safetensors file "
                                    f"(header of {header_len} bytes in a {size}-byte file)")
                header = json.loads(f.read(header_len))
        except OSError as err:
            raise LoadError(f"{self.path}: cannot read ({err.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LoadError(f"{self.path}: corrupt safetensors header (not valid JSON)") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            try:
                dtype = np.dtype(_DTYPES[entry["dtype"]])
                shape = tuple(int(d) for d in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise LoadError(f"{self.path}: malformed header entry for tensor {name!r} "
                                f"({entry!r})") from None
            if end > data_len or end - begin != int(np.prod(shape)) * dtype.itemsize:
                raise LoadError(f"{self.path}: tensor {name!r} {entry['dtype']}{list(shape)} lies "
                                f"outside the file or has the wrong byte size: the file is "
                                f"truncated or corrupt")
            self._entries[name] = (dtype, shape, begin, end)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: e[1] for name, e in self._entries.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped numpy array."""
        if name not in self._entries:
            raise LoadError(f"{self.path}: no tensor named {name!r}")
        dtype, shape, begin, end = self._entries[name]
        if end == begin:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + begin,
                         shape=shape)


def write_safetensors(path: str | Path, layout: dict[str, tuple[np.dtype, tuple[int, ...]]],
                      arrays: Iterable[tuple[str, np.ndarray]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file as its tensors arrive: the header comes from `layout`
    (name -> (dtype, shape), in file order), so one array at a time is in memory. `arrays`
    yields (name, array) in that order; a mismatch is a ValueError naming the tensor."""
    names = {np.dtype(v): k for k, v in _DTYPES.items()}
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape) in layout.items():
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": names[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    arrays = iter(arrays)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for expected, (dtype, shape) in layout.items():
            name, array = next(arrays)
            if (name, array.shape, array.dtype) != (expected, tuple(shape), np.dtype(dtype)):
                raise ValueError(f"{path}: got {name} {array.shape} {array.dtype} where the "
                                 f"header has {expected} {tuple(shape)} {np.dtype(dtype)}")
            f.write(np.ascontiguousarray(array).tobytes())


def save_safetensors(path: str | Path, tensors: dict[str, np.ndarray],
                     metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays (bfloat16 included) to a safetensors file."""
    layout = {name: (array.dtype, array.shape) for name, array in tensors.items()}
    write_safetensors(path, layout, tensors.items(), metadata)
