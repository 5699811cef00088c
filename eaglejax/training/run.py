"""A training run's directory: its identity (run.json), its metrics log, fingerprints.

Layout of OUT:
  run.json        {"format": "eaglejax-train-run", "version", "settings", "target", "data", ...}
  checkpoints/    orbax CheckpointManager steps (head params, optimizer state, data position)
  log.jsonl       one JSON object per logged interval or evaluation
  head/           the final head in eaglejax format (`load_draft` reads it)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from eaglejax.errors import EaglejaxError

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft
    from eaglejax.target import Target

RUN_FORMAT, RUN_VERSION = "eaglejax-train-run", 1
RUN_FILE = "run.json"
LOG_FILE = "log.jsonl"


def target_fingerprint(target: Target) -> str:
    """A digest of the target's config and a sample of every parameter (cheap, and
    distinct for different weights)."""
    digest = hashlib.sha256(json.dumps(target.config.to_hf_dict(), sort_keys=True).encode())
    for leaf in jax.tree.leaves(target.params):
        digest.update(np.asarray(leaf.reshape(-1)[:256]).tobytes())
    return digest.hexdigest()


def draft_fingerprint(draft: Draft) -> str:
    """sha256 over a head's config, draft vocabulary and every parameter."""
    digest = hashlib.sha256(repr(draft.config).encode())
    digest.update(np.asarray(draft.d2t).tobytes())
    for path, leaf in jax.tree_util.tree_leaves_with_path(draft.params):
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.asarray(leaf, np.float32).tobytes())
    return digest.hexdigest()


def file_fingerprint(path: str | Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
        saved = json.loads(run_file.read_text())
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
    run_file.write_text(json.dumps({"format": RUN_FORMAT, "version": RUN_VERSION, **identity},
                                   indent=2) + "\n")
    return out


def _differences(saved: Any, wanted: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(wanted, dict):
        return [d for key in sorted(set(saved) | set(wanted))
                for d in _differences(saved.get(key), wanted.get(key), f"{prefix}{key}.")]
    if saved == wanted:
        return []
    return [prefix.rstrip(".") + f" ({saved!r:.40} then, {wanted!r:.40} now)"]


def read_log(out: Path) -> list[dict[str, Any]]:
    """The run's log entries, in order."""
    path = out / LOG_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_log(out: Path, step: int) -> None:
    """Drop log entries past `step` (written by a run killed after its last checkpoint)."""
    path = out / LOG_FILE
    if path.is_file():
        kept = [e for e in read_log(out) if e["step"] <= step]
        path.write_text("".join(json.dumps(e) + "\n" for e in kept))


def append_log(out: Path, entry: dict[str, Any]) -> None:
    """Append one entry to the run's log."""
    with open(out / LOG_FILE, "a") as f:
        f.write(json.dumps(entry) + "\n")
