"""A training run's directory: its identity (run.json) and its metrics log.

Layout of OUT:
  run.json        {"format": "eaglejax-train-run", "version", "settings", "target", "data", ...}
  checkpoints/    orbax CheckpointManager steps (head params, optimizer state, data position)
  log.jsonl       one JSON object per logged interval or evaluation
  head/           the final head in eaglejax format (`load_draft` reads it)
  damaged-checkpoints/   checkpoints found damaged when resuming, set aside (never deleted)

run.json is replaced atomically and log lines are appended whole and synced, so a crash or
a full disk leaves at most a torn last log line, which reading drops with a warning.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from eaglejax.errors import EaglejaxError, LoadError
from eaglejax.loading.files import append_line, write_atomically

RUN_FORMAT, RUN_VERSION = "eaglejax-train-run", 1
RUN_FILE = "run.json"
LOG_FILE = "log.jsonl"


def open_run(out: str | Path, identity: dict[str, Any]) -> Path:
    """Create the run directory OUT with `identity` in run.json, or reopen it to resume.

    Refuses a non-empty directory that is not an eaglejax run, and a run whose identity
    (settings, target, data) differs from `identity`, naming the fields that differ."""
    out = Path(out).expanduser().absolute()
    run_file = out / RUN_FILE
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not run_file.is_file():
            raise EaglejaxError(f"{out}: exists, is not empty and is not an eaglejax training "
                                f"run (no {RUN_FILE}); refusing to write into it")
        saved = _read_run_file(run_file)
        if saved.get("format") != RUN_FORMAT or saved.get("version") != RUN_VERSION:
            raise EaglejaxError(f"{run_file}: not a version-{RUN_VERSION} eaglejax training run")
        wanted = {"format": RUN_FORMAT, "version": RUN_VERSION, **json.loads(json.dumps(identity))}
        differ = _differences(saved, wanted)
        if differ:
            raise EaglejaxError(f"{out}: this run was started with different "
                                f"{', '.join(differ)}; resume it with the same settings and "
                                f"data, or choose a new output directory")
        return out
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(run_file, json.dumps({"format": RUN_FORMAT, "version": RUN_VERSION,
                                           **identity}, indent=2) + "\n")
    return out


def _read_run_file(run_file: Path) -> dict[str, Any]:
    """run.json's contents, or LoadError saying the run cannot be checked and resumed."""
    try:
        saved = json.loads(run_file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        cause = f"not valid JSON: {err}"
    except OSError as err:
        cause = f"cannot read: {err.strerror}"
    else:
        if isinstance(saved, dict):
            return saved
        cause = f"a JSON {type(saved).__name__}, not an object"
    raise LoadError(f"{run_file}: damaged ({cause}); it records the settings, target and data "
                    f"the run was started with, so the run cannot be checked and resumed: start "
                    f"a new run in another directory (nothing here was changed)")


def _differences(saved: Any, wanted: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(wanted, dict):
        return [d for key in sorted(set(saved) | set(wanted))
                for d in _differences(saved.get(key), wanted.get(key), f"{prefix}{key}.")]
    if saved == wanted:
        return []
    return [prefix.rstrip(".") + f" ({saved!r:.40} then, {wanted!r:.40} now)"]


def _log_entry(line: bytes) -> dict[str, Any] | None:
    """A log line's entry (an object with an integer "step"), or None if it is not one."""
    try:
        entry = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    valid = isinstance(entry, dict) and isinstance(entry.get("step"), int)
    return entry if valid else None


def read_log(out: Path) -> list[dict[str, Any]]:
    """The run's log entries, in order. A torn last line (the run was killed or the disk
    filled while it was written) is dropped with a warning; a damaged line before the last
    is a LoadError naming it."""
    path = out / LOG_FILE
    if not path.is_file():
        return []
    numbered = [(n, line) for n, line in enumerate(path.read_bytes().split(b"\n"), 1)
                if line.strip()]
    entries = []
    for n, line in numbered:
        entry = _log_entry(line)
        if entry is None and n == numbered[-1][0]:
            warnings.warn(f"{path}: dropped line {n}, written only in part (the run was "
                          f"interrupted while logging)", stacklevel=2)
        elif entry is None:
            raise LoadError(f"{path}, line {n}: not a log entry ({line[:60]!r}); the log is "
                            f"damaged: repair or delete that line")
        else:
            entries.append(entry)
    return entries


def truncate_log(out: Path, step: int) -> None:
    """Keep only the log entries that a run resuming from its checkpoint of `step` will not
    write again: those up to `step`, none when it starts over (step 0). The log is rewritten
    atomically, whole lines only."""
    path = out / LOG_FILE
    if path.is_file():
        kept = [e for e in read_log(out) if 0 < step and e["step"] <= step]
        write_atomically(path, "".join(json.dumps(e) + "\n" for e in kept))


def append_log(out: Path, entry: dict[str, Any]) -> None:
    """Append one entry to the run's log: one whole line, synced to disk."""
    append_line(out / LOG_FILE, json.dumps(entry))
