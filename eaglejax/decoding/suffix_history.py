"""What suffix drafting remembers across requests: the replies this process (or server)
decoded before, in a bounded buffer every request's suffix drafter searches besides its
own prompt and output (the global half of suffix decoding, arXiv 2411.04975), and so does
a head's lookup branch with history (`SpecConfig.lookup_history`, `decoding.lookup`).

The buffer holds the latest replies, each followed by a separator (-1: it matches no token
and ends every continuation), oldest dropped first; its size is fixed, so the compiled
programs take it as an input of one shape and never recompile as it fills.
`remember_replies` (what `generate` and the serving engine call) adds nothing while
$EAGLEJAX_REPLY_HISTORY is 0: e.g. a benchmark that sends the same prompts again and
compares with a server that keeps no such history.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from eaglejax.compilation_cache import switched_on

SEPARATOR = -1
DEFAULT_TOKENS = 4096


class SuffixHistory:
    """The latest replies, newest last, in `size` token slots (module docstring)."""

    def __init__(self, size: int = DEFAULT_TOKENS):
        if size < 1:
            raise ValueError(f"a suffix history holds at least one token, got {size}")
        self.tokens = np.full((size,), SEPARATOR, np.int32)

    def add(self, replies: Iterable[Iterable[int]]) -> None:
        """Append replies (token ids), each then a separator, dropping the oldest tokens; a
        reply longer than the buffer keeps its end."""
        for reply in replies:
            ids = np.asarray(list(reply), np.int32)
            if ids.size == 0:
                continue
            block = np.append(ids, np.int32(SEPARATOR))[-self.tokens.size:]
            self.tokens = np.concatenate([self.tokens[block.size:], block])

    def clear(self) -> None:
        """Forget every reply (a new buffer: arrays made from the old one keep their values)."""
        self.tokens = np.full_like(self.tokens, SEPARATOR)


_SHARED = SuffixHistory()


def shared_history() -> SuffixHistory:
    """The process's history: `generate` and the serving engine add every reply decoded with
    a shape that reads it (`SpecConfig.uses_history`: suffix drafting, a lookup branch with
    history, `auto`) to it, and every such shape reads it."""
    return _SHARED


SWITCH_ENV = "EAGLEJAX_REPLY_HISTORY"


def remember_replies(replies: Iterable[Iterable[int]]) -> None:
    """Add replies to the process's history (what `generate` and the serving engine call)
    unless $EAGLEJAX_REPLY_HISTORY is off (0, false, no, off; ConfigError naming the
    variable for a value that is neither on nor off)."""
    if switched_on(SWITCH_ENV):
        _SHARED.add(replies)
