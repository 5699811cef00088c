"""The draft heads that ship with eaglejax (`checkpoints/`), found by the built-in target
they were trained for."""

from __future__ import annotations

from pathlib import Path

SHIPPED = {"smollm2-135m-instruct": "smollm2-135m-instruct-eagle3"}  # built-in target -> folder


def checkpoints_dir() -> Path:
    """Where the shipped heads live: `eaglejax/checkpoints` (in a source checkout a link to
    the repository's `checkpoints/`, in an installed wheel a copy of it)."""
    return Path(__file__).resolve().parent.parent / "checkpoints"


def shipped_head(model: str) -> Path | None:
    """The shipped head's folder for the built-in target `model`, or None (no head was
    trained for it, or this installation lacks the checkpoints)."""
    folder = SHIPPED.get(model)
    if folder is None:
        return None
    path = checkpoints_dir() / folder
    return path if (path / "eaglejax.json").is_file() else None
