"""Drafting methods as plug-ins: one module per method, each registering its drafter under
the `SpecConfig.method` name it serves (`base.register`); `decoding.drafting.draft_round`
looks the method up. The contract is in `base`; adding a method is docs/architecture.md,
"Adding a drafter"; `tests/test_drafters.py` checks every registered drafter."""

from eaglejax.decoding.drafters import chain, dynamic_tree, parallel, static_tree  # noqa: F401
from eaglejax.decoding.drafters.base import Drafter, Head, Root, drafter, methods, register

__all__ = ["Drafter", "Head", "Root", "drafter", "methods", "register"]
