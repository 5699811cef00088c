"""Content digests that name things in caches and run identities: a target, a draft
head, a file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft
    from eaglejax.draft.draft_model import DraftModel
    from eaglejax.target import Target


def target_fingerprint(target: Target) -> str:
    """A digest of the target's config and a sample of every parameter (cheap, and
    distinct for different weights)."""
    digest = hashlib.sha256(json.dumps(target.config.to_hf_dict(), sort_keys=True).encode())
    for leaf in jax.tree.leaves(target.params):
        digest.update(np.asarray(leaf.reshape(-1)[:256]).tobytes())
    return digest.hexdigest()


def draft_fingerprint(draft: Draft | DraftModel) -> str:
    """sha256 over a head's (or draft model's) config, draft vocabulary and every
    parameter."""
    config = repr(draft.config)
    # as before the P-EAGLE and DFlash fields existed: earlier runs resume
    config = config.replace(", block_size=0)", ")")
    if not draft.parallel:
        config = config.replace(", mask_token_id=None)", ")")
    digest = hashlib.sha256(config.encode())
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
