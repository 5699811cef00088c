"""Which speculation a run does: every check that a target, a draft head and a requested
shape agree, and the default shape, in one place (`generate` and the serving engine)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.draft.draft import Draft
from eaglejax.errors import ConfigError, InputError

if TYPE_CHECKING:
    from eaglejax.target import Target

AUTO = "auto"


def check_speculation(draft: object, speculative: object) -> None:
    """InputError unless `draft` is a Draft or None and `speculative` a SpecConfig, "auto"
    or None, given with a draft head unless its method drafts without one (checked before
    any model is loaded)."""
    if draft is not None and not isinstance(draft, Draft):
        raise InputError(f"draft must be a Draft (eaglejax.load_draft(path, target=...)) or "
                         f"None, got {type(draft).__name__}")
    is_auto = isinstance(speculative, str) and speculative == AUTO
    if not (speculative is None or is_auto or isinstance(speculative, SpecConfig)):
        raise InputError(f"speculative must be a SpecConfig, 'auto' or None, "
                         f"got {speculative!r:.60}")
    headless = isinstance(speculative, SpecConfig) and not speculative.needs_head
    if draft is None and speculative is not None and not headless:
        shape = speculative.describe() if isinstance(speculative, SpecConfig) else "'auto'"
        raise InputError(f"speculative ({shape}) needs a draft head: pass "
                         f"draft=eaglejax.load_draft(...), or leave speculative out")


def resolve_speculation(target: "Target", draft: Draft | None,
                        speculative: SpecConfig | str | None, batch: int, *,
                        auto_by_default: bool) -> SpecConfig | str | None:
    """The speculation of a run of `batch` rows: None (plain decoding), "auto", or the
    SpecConfig to run (with no head: a method that drafts without one). A head given without
    a shape runs "auto" where `auto_by_default` and one process decodes, else the device's
    preset for `batch` rows (`SpecConfig.default_for`). ConfigError for a head loaded for
    another target or a P-EAGLE shape without a P-EAGLE head; InputError for "auto" over
    several processes (it times this machine alone, and they must agree on one shape)."""
    check_speculation(draft, speculative)
    if draft is None:
        return speculative  # None, or a method that drafts without a head
    if draft.target is not target:
        raise ConfigError(f"the draft head {draft.source} was loaded for target "
                          f"{draft.target.source}, not {target.source}; load it with this "
                          f"target")
    if speculative is None:
        speculative = AUTO if auto_by_default and jax.process_count() == 1 else \
            SpecConfig.default_for(draft.config.parallel, jax.default_backend(), batch)
    if speculative == AUTO:
        if jax.process_count() > 1:
            raise InputError("speculative='auto' times this machine alone, and the processes "
                             "of a multi-process run must agree on one shape: pass a "
                             "SpecConfig")
        return AUTO
    if speculative.is_parallel and not draft.config.parallel:
        raise ConfigError(f"{speculative.describe()} needs a P-EAGLE head (one with a mask "
                          f"token); {draft.source} drafts one token per forward: use "
                          f"SpecConfig.chain or a tree")
    return speculative
