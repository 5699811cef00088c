"""`load_draft`: one entry point for every draft-head layout eaglejax reads."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.draft.draft import Draft
from eaglejax.draft.formats import READERS
from eaglejax.draft.formats.dflash import is_dflash
from eaglejax.draft.formats.native import FORMAT, manifest_format
from eaglejax.draft.formats.speculators import is_speculators
from eaglejax.errors import LoadError
from eaglejax.loading.hf_dir import HFWeights, read_json
from eaglejax.loading.hub import ResolvedSource, named_errors, resolve_source
from eaglejax.models.placement import replicate

if TYPE_CHECKING:
    from eaglejax.target import Target

_EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_EAGLE1_ARCHS = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")


def detect_format(path: Path) -> tuple[str, "HFWeights | None"]:
    """The layout of a head directory ("eaglejax", "dflash", "speculators", "eagle3" or
    "eagle1"), and its opened weights when they had to be looked at."""
    found = manifest_format(path)
    if found == FORMAT:
        return "eaglejax", None
    if found is not None:
        raise LoadError(f"{path / 'eaglejax.json'}: format {found!r} is not a draft head "
                        f"(expected {FORMAT!r}); load targets with load_target")
    if (path / "params").is_dir() and not (path / "config.json").exists():
        raise LoadError(f"{path / 'eaglejax.json'}: missing, so {path} is not a complete "
                        f"eaglejax head (its save was interrupted, or the manifest was deleted)")
    cfg = read_json(path / "config.json")
    archs = cfg.get("architectures") or []
    if is_dflash(cfg):
        return "dflash", None
    if is_speculators(cfg):
        return "speculators", None
    if "draft_vocab_size" in cfg or any(a in _EAGLE3_ARCHS for a in archs):
        return "eagle3", None
    if any(a in _EAGLE1_ARCHS for a in archs):
        return "eagle1", None
    weights = HFWeights(path)
    names = weights.shapes()
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3", weights
    if "fc.weight" in names and any(n.startswith("layers.") for n in names):
        return "eagle1", weights
    raise LoadError(f"{path}: not a draft head eaglejax recognises (EAGLE-1/2, EAGLE-3 "
                    f"reference/SpecForge, speculators, DFlash or eaglejax format)")


def named_verifier(path: Path) -> str | None:
    """The target a head directory's config names, or None: a speculators config's
    `speculators_config.verifier.name_or_path` (a local path or a Hub id); the reference
    EAGLE, SpecForge, z-lab DFlash and eaglejax layouts name none."""
    if not (path / "config.json").is_file():
        return None
    section = read_json(path / "config.json").get("speculators_config")
    verifier = section.get("verifier") if isinstance(section, dict) else None
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return name if isinstance(name, str) and name.strip() else None


def load_draft(path: str | Path | ResolvedSource, *, target: "Target",
               dtype: jnp.dtype | str | None = None,
               weight_dtype: jnp.dtype | str | None = None) -> Draft:
    """Load a draft head for `target`, auto-detecting its layout (eaglejax directory,
    speculators, SpecForge/reference EAGLE-3, EAGLE-1/2, DFlash from z-lab or speculators)
    and checking it against the target. `path` may be a Hugging Face Hub id (`org/name`,
    `org/name@revision`; a local path of that name wins: `loading.hub.resolve_source`).

    Parameters are cast to `dtype`, by default the target's compute dtype; the matrices are
    stored in `weight_dtype`, by default in `dtype`, or as the target stores its own where it
    stores them narrower than it computes (16-bit storage halves what each head step reads;
    training widens a head it starts from); int8 under an int8 target (a round's head steps
    then cost a third of bfloat16's, at the same acceptance: BENCHMARKS.md, session 29).
    """
    source = path if isinstance(path, ResolvedSource) else resolve_source(path)
    path = source.path
    if not path.exists():
        raise LoadError(f"{path}: no such file or directory")
    with named_errors(source):
        return _load_draft(path, source.name, target, dtype, weight_dtype)


def _load_draft(path: Path, name: str, target: "Target", dtype: jnp.dtype | str | None,
                weight_dtype: jnp.dtype | str | None) -> Draft:
    if not path.is_dir():
        raise LoadError(f"{path}: a draft head is a directory (config.json + weights, or an "
                        f"eaglejax head directory)")
    layout, weights = detect_format(path)
    config, params, d2t = READERS[layout](path, target.config, weights)
    dtype = jnp.dtype(dtype) if dtype is not None else target.dtype
    if target.mesh is not None:  # replicated on every device: see models.placement
        host = jax.tree.map(lambda a: np.asarray(a).astype(dtype), params)
        params, d2t = replicate((host, np.asarray(d2t, np.int32)), target.mesh)
    else:
        params = jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), params)
        d2t = jnp.asarray(d2t, jnp.int32)
    draft = Draft(config, params, d2t, target, name)
    if weight_dtype is None:  # as the target stores its matrices, when it narrows them
        weight_dtype = target.weight_dtype if target.weight_dtype != target.dtype else dtype
    return draft if jnp.dtype(weight_dtype) == dtype else draft.with_weight_dtype(weight_dtype)
