"""Restoring orbax checkpoints with failures reported in one line.

A damaged orbax checkpoint fails deep inside TensorStore: the exception's message embeds
the whole TensorStore spec, and the reads still in flight when the restore gives up report
`RuntimeError: Event loop is closed` (or an exception "ignored in" an orbax coroutine)
through `sys.unraisablehook`, tens of tracebacks after the error has been handled. Here the
failure becomes one line and that debris is dropped.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from eaglejax.errors import LoadError

_SPEC = re.compile(r"\s*\[tensorstore_spec=.*$|\s*See full TensorStore details:.*$")


def describe_failure(err: BaseException, limit: int = 240) -> str:
    """The root cause of an orbax/TensorStore failure in one short line."""
    while err.__cause__ is not None:
        err = err.__cause__
    if err.__context__ is not None and not str(err).strip():
        err = err.__context__
    lines = str(err).strip().splitlines()
    message = _SPEC.sub("", lines[0]) if lines else ""
    if len(message) > limit:
        message = message[:limit - 3] + "..."
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def _is_debris(unraisable: Any) -> bool:
    """Whether an unraisable exception is the debris of a failed orbax restore."""
    value, origin = unraisable.exc_value, unraisable.object
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
        return True
    return (isinstance(origin, types.CoroutineType)
            and "orbax" in origin.cr_code.co_filename.replace("\\", "/"))


def drop_failed_restore_debris() -> None:
    """From now on, drop the unraisable exceptions a failed orbax restore leaves behind
    (see the module docstring); every other one still reaches the previous hook. Call it
    before restoring: the debris can arrive before the failure is raised."""
    previous = sys.unraisablehook
    if getattr(previous, "_eaglejax_filter", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_debris(unraisable):
            previous(unraisable)

    hook._eaglejax_filter = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def restore_tree(directory: Path, abstract: Any) -> Any:
    """The pytree saved by `ocp.StandardCheckpointer` in `directory`, shaped like `abstract`;
    LoadError naming the directory and the cause when it cannot be read."""
    drop_failed_restore_debris()
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(directory.absolute(), abstract)
    except Exception as err:  # orbax raises many kinds for missing, damaged or mismatched trees
        raise LoadError(f"{directory}: cannot restore parameters ({describe_failure(err)}); "
                        f"the checkpoint is damaged, incomplete or not for this model") from None
