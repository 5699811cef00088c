"""Which speculation a run does: every check that a target, a draft head and a requested
shape agree, and the default shape, in one place (`generate` and the serving engine)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.draft.draft import Draft
from eaglejax.draft.draft_model import DraftModel
from eaglejax.errors import ConfigError, InputError

if TYPE_CHECKING:
    from eaglejax.target import Target

AUTO = "auto"
AUTO_OVER_PROCESSES = ("speculative='auto' times this machine alone, and the processes of a "
                       "multi-process run must agree on one shape: pass a SpecConfig")


WEIGHTS_HINT = {"head": "draft=eaglejax.load_draft(path, target=...)",
                "model": "draft=eaglejax.load_draft_model(path, target=...)",
                None: "no draft"}


def draft_kind(draft: object) -> str | None:
    """What `draft` is, as `SpecConfig.drafts_with` names it: "head", "model" or None."""
    if draft is None:
        return None
    if isinstance(draft, Draft):
        return "head"
    if isinstance(draft, DraftModel):
        return "model"
    raise InputError(f"draft must be a Draft ({WEIGHTS_HINT['head']}), a DraftModel "
                     f"({WEIGHTS_HINT['model']}) or None, got {type(draft).__name__}")


def check_speculation(draft: object, speculative: object) -> None:
    """InputError unless `draft` is a Draft, a DraftModel or None and `speculative` a
    SpecConfig whose method drafts with what `draft` is, "auto" (with no draft: suffix
    drafting's trees against plain decoding) or None (checked before any model is loaded)."""
    given = draft_kind(draft)
    is_auto = isinstance(speculative, str) and speculative == AUTO
    if not (speculative is None or is_auto or isinstance(speculative, SpecConfig)):
        raise InputError(f"speculative must be a SpecConfig, 'auto' or None, "
                         f"got {speculative!r:.60}")
    if isinstance(speculative, SpecConfig) and speculative.drafts_with != given:
        wants = speculative.drafts_with
        needs = {"head": "a draft head", "model": "a draft model", None: "no draft"}
        raise InputError(f"speculative ({speculative.describe()}) drafts with {needs[wants]}: "
                         f"pass {WEIGHTS_HINT[wants]}, not {needs[given]}")


def default_shape(draft: Draft | DraftModel, platform: str, batch: int = 1) -> SpecConfig:
    """What `draft` runs when no shape is asked for (`SpecConfig.default_for`)."""
    return SpecConfig.default_for(draft.parallel, platform, batch,
                                  drafts_with=draft_kind(draft),
                                  dflash_block=draft.config.block_size if draft.dflash else 0)


def resolve_speculation(target: "Target", draft: Draft | DraftModel | None,
                        speculative: SpecConfig | str | None, batch: int, *,
                        auto_by_default: bool) -> SpecConfig | str | None:
    """The speculation of a run of `batch` rows: None (plain decoding), "auto", or the
    SpecConfig to run (with no head: a method that drafts without one; "auto" with no draft
    over one row: `SpecConfig.suffix()`, whose rounds are plain steps where no match is
    long enough). A head given without
    a shape runs "auto" where `auto_by_default` and one process decodes, else the device's
    preset for `batch` rows (`SpecConfig.default_for`). ConfigError for a head loaded for
    another target or a P-EAGLE shape without a P-EAGLE head; InputError for "auto" over
    several processes (it times this machine alone, and they must agree on one shape)."""
    check_speculation(draft, speculative)
    if draft is None:
        if speculative == AUTO and jax.process_count() > 1:
            raise InputError(AUTO_OVER_PROCESSES)
        if speculative == AUTO and batch == 1:
            # one row: each round chooses between a plain step and a suffix tree from the
            # match it finds, which beat switching per segment on every workload measured
            # (BENCHMARKS.md, session 47)
            return SpecConfig.suffix()
        return speculative  # None, "auto" (suffix drafting) or a method drafting without one
    if draft.target is not target:
        raise ConfigError(f"the draft {draft.source} was loaded for target "
                          f"{draft.target.source}, not {target.source}; load it with this "
                          f"target")
    if speculative is None:
        speculative = AUTO if auto_by_default and jax.process_count() == 1 else \
            default_shape(draft, jax.default_backend(), batch)
    if speculative == AUTO:
        if jax.process_count() > 1:
            raise InputError(AUTO_OVER_PROCESSES)
        return AUTO
    if speculative.is_dflash != draft.dflash:
        raise ConfigError(f"{speculative.describe()} and {draft.source} ({draft.config.kind} "
                          f"head) do not go together: a DFlash head drafts with "
                          f"SpecConfig.dflash or dflash_tree, and only it does")
    if speculative.is_dflash and speculative.draft_depth >= draft.config.block_size:
        raise ConfigError(f"{speculative.describe()}: {draft.source} fills blocks of "
                          f"{draft.config.block_size} tokens, so it proposes at most "
                          f"{draft.config.block_size - 1}")
    if speculative.is_parallel and not draft.parallel:
        raise ConfigError(f"{speculative.describe()} needs a P-EAGLE head (one with a mask "
                          f"token); {draft.source} drafts one token per forward: use "
                          f"SpecConfig.chain or a tree")
    return speculative
