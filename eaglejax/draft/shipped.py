"""The draft heads that ship with eaglejax (`checkpoints/`), found by the built-in target
they were trained for."""

from __future__ import annotations

from pathlib import Path

SHIPPED = {  # built-in target -> {method: folder}
    "smollm2-135m-instruct": {"eagle3": "smollm2-135m-instruct-eagle3",
                              "peagle": "smollm2-135m-instruct-peagle",
                              "dflash": "smollm2-135m-instruct-dflash"},
}


def checkpoints_dir() -> Path:
    """Where the shipped heads live: `eaglejax/checkpoints` (in a source checkout a link to
    the repository's `checkpoints/`, in an installed wheel a copy of it)."""
    return Path(__file__).resolve().parent.parent / "checkpoints"


def shipped_head(model: str, method: str = "eagle3") -> Path | None:
    """The folder of the head shipped for the built-in target `model` ("eagle3": the default
    head of `eaglejax generate`; "peagle": the P-EAGLE one; "dflash": the DFlash drafter),
    or None (no such head was trained for it, or this installation lacks the checkpoints)."""
    folder = SHIPPED.get(model, {}).get(method)
    if folder is None:
        return None
    path = checkpoints_dir() / folder
    return path if (path / "eaglejax.json").is_file() else None
