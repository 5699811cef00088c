"""A reply's text as its tokens arrive: the new text that can be sent, stop strings cut."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from eaglejax.prompting import cut_at_stop
from eaglejax.target import Target


@dataclasses.dataclass(frozen=True)
class FinalText:
    """A finished reply: its text, the tokens it counts (through the one that completed a
    stop string, as `generate` counts them) and whether a stop string ended it."""

    text: str
    token_ids: list[int]
    stopped: bool


class TextStream:
    """Decodes the whole reply at each push and hands out the new suffix, holding back
    text that may still change: an incomplete UTF-8 character (decoded as U+FFFD) and an
    ending that could begin a stop string. Once a stop string appears, `stop_seen` is set
    and nothing more is handed out until `finish`."""

    def __init__(self, target: Target, stop: Sequence[str]):
        self._target = target
        self._stop = list(stop)
        self._ids: list[int] = []
        self._sent = ""
        self.stop_seen = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new tokens; the text now safe to send (maybe "")."""
        self._ids.extend(token_ids)
        if self.stop_seen:
            return ""
        text = self._target.tokenizer.decode(self._ids)
        if any(s in text for s in self._stop):
            self.stop_seen = True
            return ""
        text = text.rstrip("\ufffd")
        return self._advance(text[:len(text) - self._stop_prefix(text)])

    def finish(self) -> tuple[str, FinalText]:
        """The reply is over: the text not sent yet, and the final text (cut before the
        first stop string, exactly as `generate` cuts it)."""
        ids, cut = cut_at_stop(self._target, self._ids, self._stop) if self._stop \
            else (self._ids, None)
        text = self._target.tokenizer.decode(ids) if cut is None else cut
        return self._advance(text), FinalText(text, list(ids), cut is not None)

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest ending of `text` that begins a stop string."""
        return max((k for s in self._stop for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)

    def _advance(self, text: str) -> str:
        """What `text` adds to the text sent so far. A tokenizer whose decoding rewrites
        earlier text (rare) cannot take back what was sent: the rewritten part is skipped."""
        new = text[len(self._sent):]
        if len(text) > len(self._sent):
            self._sent = text
        return new
