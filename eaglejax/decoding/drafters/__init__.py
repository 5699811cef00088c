"""Drafting methods as plug-ins: one module per method, each registering its drafter under
the `SpecConfig.method` name it serves (`base.register`); the compiled round looks the
method up for its state's prefill, its draft and its catch-up. The contract is in `base`;
adding a method is docs/architecture.md, "Adding a drafter"; `tests/test_drafters.py`
checks every registered drafter."""

from eaglejax.decoding.drafters import (  # noqa: F401  (each registers its method)
    chain,
    dflash,
    draft_model,
    dynamic_tree,
    parallel,
    static_tree,
    suffix,
)
from eaglejax.decoding.drafters.base import (
    Drafter,
    Head,
    HeadDrafter,
    Root,
    TreeProposal,
    drafter,
    methods,
    register,
    unregister,
)
from eaglejax.decoding.drafters.head_state import HeadState

__all__ = ["Drafter", "Head", "HeadDrafter", "HeadState", "Root", "TreeProposal", "drafter",
           "methods", "register", "unregister"]
