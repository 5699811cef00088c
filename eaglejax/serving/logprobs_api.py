"""Generated tokens' log-probabilities in the OpenAI API's two shapes: a chat choice's
`logprobs.content` list and a text completion's parallel `tokens` / `token_logprobs` /
`top_logprobs` / `text_offset` lists."""

from __future__ import annotations

from typing import Any

from eaglejax.decoding.token_logprobs import TokenLogprob
from eaglejax.tokenizer import Tokenizer

# JSON has no -Infinity: a token the model rules out reports this (as vLLM does).
LOWEST_LOGPROB = -9999.0


class LogprobsFormat:
    """Writes `TokenLogprob` entries for a chat (`chat`) or a text completion, naming tokens
    by their text (their bytes decoded; a part of a UTF-8 character shows as U+FFFD, its
    bytes in the chat shape's `bytes`)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool):
        self._tokenizer, self._chat = tokenizer, chat

    def body(self, entries: list[TokenLogprob], offset: int = 0) -> tuple[dict[str, Any], int]:
        """The `logprobs` object of a choice or stream chunk for `entries`, whose first token
        starts at character `offset` of the reply's text; and the offset after them."""
        if self._chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}, offset
        tokens, offsets = [], []
        for e in entries:
            offsets.append(offset)
            tokens.append(self._text(e.token_id))
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [_value(e.logprob) for e in entries],
                "top_logprobs": [None if e.top is None else
                                 {self._text(t): _value(v) for t, v in e.top} for e in entries],
                "text_offset": offsets}, offset

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        return {**self._token(entry.token_id, entry.logprob),
                "top_logprobs": [self._token(t, v) for t, v in entry.top]}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self._tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": _value(logprob),
                "bytes": list(raw)}

    def _text(self, token_id: int) -> str:
        return self._tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _value(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, LOWEST_LOGPROB)
