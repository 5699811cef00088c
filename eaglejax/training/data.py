"""Training data: ShareGPT-shaped conversations -> token ids + assistant loss mask -> packed rows.

A record is one JSON object a line (optionally gzip-compressed):
`{"id": str, "conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}`.
Conversations are rendered with the target's chat template; the loss mask is 1 exactly on
the tokens the template emits for assistant turns (content and end-of-turn), found by
rendering prefixes of the conversation.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from eaglejax.errors import InputError

if TYPE_CHECKING:
    from eaglejax.tokenizer import Tokenizer

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system"}
SHAREGPT_NAMES = {"user": "human", "assistant": "gpt", "system": "system"}


@dataclasses.dataclass(frozen=True)
class Conversation:
    """messages: (role, content) pairs with roles user / assistant / system; source:
    "file:line", for error messages."""

    id: str
    messages: tuple[tuple[str, str], ...]
    source: str

    def to_record(self) -> dict:
        """The ShareGPT-shaped JSON record of this conversation."""
        return {"id": self.id, "conversations": [{"from": SHAREGPT_NAMES[role], "value": text}
                                                 for role, text in self.messages]}


@dataclasses.dataclass(frozen=True)
class Example:
    """One conversation as token ids [T] int32 and its loss mask [T] bool."""

    tokens: np.ndarray
    loss_mask: np.ndarray


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(
        path, encoding="utf-8")


def parse_record(item: object, source: str) -> Conversation:
    """Validate one decoded JSON record; errors name `source` ("file:line")."""
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        raise InputError(f"{source}: expected an object with a 'conversations' list")
    messages = []
    for i, turn in enumerate(item["conversations"]):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise InputError(f"{source}: conversations[{i}] must be an object with a string "
                             f"'value'")
        role = ROLES.get(turn.get("from"))  # type: ignore[arg-type]
        if role is None:
            raise InputError(f"{source}: conversations[{i}] has 'from' {turn.get('from')!r}; "
                             f"expected one of {sorted(ROLES)}")
        messages.append((role, turn["value"]))
    return Conversation(str(item.get("id", source)), tuple(messages), source)


def read_conversations(path: str | Path, limit: int | None = None) -> list[Conversation]:
    """The first `limit` (all if None) conversations of a ShareGPT-shaped JSONL (.gz) file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: conversation file not found")
    out: list[Conversation] = []
    try:
        with _open_text(path) as f:
            for line_no, line in enumerate(f, 1):
                if limit is not None and len(out) >= limit:
                    break
                if not line.strip():
                    continue
                source = f"{path}:{line_no}"
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as err:
                    raise InputError(f"{source}: not valid JSON ({err})") from None
                out.append(parse_record(item, source))
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read ({type(err).__name__}: {err})") from None
    return out


def render_messages(tokenizer: Tokenizer, messages: Sequence[tuple[str, str]],
                    generation: bool) -> str:
    """(role, content) pairs rendered with the chat template (plus the generation prompt)."""
    return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                         add_generation_prompt=generation)


def tokenize_conversation(conv: Conversation, tokenizer: Tokenizer) -> Example:
    """Render `conv` with the chat template; the loss mask covers assistant turns.

    Each turn's text is the difference between successive renderings of conversation
    prefixes (the assistant's header comes from the generation prompt), tokenized on its
    own, so a prompt's tokens match what generation sees. Turns after the last assistant
    turn are dropped (they carry no loss).
    """
    last = max((i for i, (role, _) in enumerate(conv.messages) if role == "assistant"),
               default=-1)
    messages = conv.messages[:last + 1]
    pieces: list[tuple[str, bool]] = []  # (rendered prefix, the piece ending there is supervised)
    try:
        for i, (role, _) in enumerate(messages):
            if role == "assistant":
                pieces.append((render_messages(tokenizer, messages[:i], True), False))
            rendered = render_messages(tokenizer, messages[:i + 1], False)
            pieces.append((rendered, role == "assistant"))
    except InputError as err:
        raise InputError(f"{conv.source}: {err}") from None
    tokens: list[int] = []
    mask: list[bool] = []
    done = ""
    for text, supervised in pieces:
        if not text.startswith(done):
            raise InputError(f"{conv.source}: the chat template renders a conversation prefix "
                             f"differently from the whole conversation, so assistant turns "
                             f"cannot be located")
        ids = tokenizer.encode(text[len(done):])
        tokens += ids
        mask += [supervised] * len(ids)
        done = text
    return Example(np.asarray(tokens, np.int32), np.asarray(mask, bool))


def first_repeat(tokens: np.ndarray, loss_mask: np.ndarray, n: int) -> int:
    """Where the first supervised n-gram that repeats an earlier supervised one starts (a
    small model's greedy loop; copying from the prompt does not count), or len(tokens)."""
    seen: set[tuple[int, ...]] = set()
    for end in range(n, len(tokens) + 1):
        if not loss_mask[end - n:end].all():
            continue
        gram = tuple(tokens[end - n:end].tolist())
        if gram in seen:
            return end - n
        seen.add(gram)
    return len(tokens)


def tokenize_all(conversations: Sequence[Conversation], tokenizer: Tokenizer,
                 seq_len: int, cut_repeats: int = 0) -> list[Example]:
    """Tokenize and truncate to `seq_len`, and with `cut_repeats` = n > 0 also where a
    supervised n-gram repeats an earlier supervised one (the rest of a looping reply
    teaches only copying); conversations left without a supervised token are dropped."""
    examples = []
    for conv in conversations:
        ex = tokenize_conversation(conv, tokenizer)
        end = seq_len if cut_repeats <= 0 else min(
            seq_len, first_repeat(ex.tokens, ex.loss_mask, cut_repeats))
        ex = Example(ex.tokens[:end], ex.loss_mask[:end])
        if ex.loss_mask[2:].any():  # the first supervised prediction is of token 2
            examples.append(ex)
    return examples


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Examples packed into rows of a static length S, all [N,S]: tokens int32; segments
    int32 (1, 2, ... per example in a row, 0 = padding); positions int32 (restarting at 0
    in each segment); loss_mask bool."""

    tokens: np.ndarray
    segments: np.ndarray
    positions: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def take(self, indices: np.ndarray) -> PackedRows:
        """The rows at `indices` (a batch)."""
        return PackedRows(*(a[indices] for a in dataclasses.astuple(self)))

    def fingerprint(self) -> str:
        """A digest of the contents (a resumed run checks it trains on the same data)."""
        digest = hashlib.sha256()
        for array in dataclasses.astuple(self):
            digest.update(str(array.shape).encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()


def pack(examples: Sequence[Example], seq_len: int) -> PackedRows:
    """Pack examples (each at most `seq_len` long) in order: an example joins the current
    row while it fits, else starts a new one."""
    if not examples:
        raise InputError("no training examples (no conversation has a supervised token)")
    rows: list[list[Example]] = [[]]
    used = 0
    for ex in examples:
        n = len(ex.tokens)
        if n > seq_len:
            raise InputError(f"an example has {n} tokens, more than seq_len={seq_len}")
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(ex)
        used += n
    shape = (len(rows), seq_len)
    tokens, segments, positions = (np.zeros(shape, np.int32) for _ in range(3))
    loss = np.zeros(shape, bool)
    for r, row in enumerate(rows):
        start = 0
        for s, ex in enumerate(row, 1):
            end = start + len(ex.tokens)
            tokens[r, start:end] = ex.tokens
            segments[r, start:end] = s
            positions[r, start:end] = np.arange(end - start)
            loss[r, start:end] = ex.loss_mask
            start = end
    return PackedRows(tokens, segments, positions, loss)
