"""Careful file handling: refuse non-regular files, write atomically, append whole lines,
and record and check the sizes and CRC-32 checksums of the files a checkpoint is made of."""

from __future__ import annotations

import os
import stat
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eaglejax.errors import LoadError

_BLOCK = 1 << 20


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def require_regular_file(path: Path) -> None:
    """LoadError unless `path` is (a link to) a regular file: reading a named pipe or a
    device would block or never end."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise LoadError(f"{path}: file not found") from None
    except OSError as err:
        raise LoadError(f"{path}: cannot read ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        raise LoadError(f"{path}: is {_kind(mode)}, not a regular file")


def _fsync_directory(directory: Path) -> None:
    """Make a rename inside `directory` durable (a no-op where directories cannot be opened)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` by `text` all at once: written to a temporary file beside it, synced,
    then renamed over it, so a crash leaves either the old or the new content."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append `line` and a newline in one write, synced to disk before returning."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            crc = zlib.crc32(block, crc)
    return crc


def file_checksums(root: Path, names: Iterable[str]) -> dict[str, list[int]]:
    """{path relative to `root`: [size, CRC-32]} of the files `names` (files or directories,
    relative to `root`) consist of, in sorted order."""
    found: dict[str, list[int]] = {}
    for name in names:
        top = root / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            found[path.relative_to(root).as_posix()] = [path.stat().st_size, _crc32(path)]
    return dict(sorted(found.items()))


def verify_checksums(root: Path, recorded: Any, source: str) -> None:
    """LoadError naming the first file under `root` that is missing or differs in size or
    CRC-32 from what `file_checksums` recorded (`recorded`, read from `source`)."""
    if not isinstance(recorded, dict):
        raise LoadError(f"{source}: 'files' must map file names to [size, crc32]")
    for name, entry in recorded.items():
        path = root / name
        valid_entry = (isinstance(entry, list) and len(entry) == 2
                       and all(isinstance(x, int) for x in entry))
        if not valid_entry or Path(name).is_absolute() or ".." in Path(name).parts:
            raise LoadError(f"{source}: bad 'files' entry {name!r}: {entry!r}")
        if not path.exists():
            raise LoadError(f"{path}: missing (listed in {source}); the checkpoint is "
                            f"incomplete")
        require_regular_file(path)
        size, crc = entry
        if path.stat().st_size != size:
            raise LoadError(f"{path}: {path.stat().st_size} bytes, {size} when saved; the "
                            f"file is truncated or damaged")
        if _crc32(path) != crc:
            raise LoadError(f"{path}: contents differ from when it was saved (CRC-32 "
                            f"mismatch); the file is damaged")
