"""The draft vocabulary: the DV target tokens the head predicts, and its coverage."""

from __future__ import annotations

import dataclasses

import numpy as np

from eaglejax.errors import InputError
from eaglejax.training.data import PackedRows


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    """used: sorted target ids [DV]; d2t: int32 [DV] with `i + d2t[i]` = used[i]; t2d: int32
    [V], the draft index of each target id or -1; coverage: share of the supervised next
    tokens of the data that lie in the draft vocabulary."""

    used: np.ndarray
    d2t: np.ndarray
    t2d: np.ndarray
    coverage: float


def supervised_token_counts(rows: PackedRows, vocab_size: int) -> np.ndarray:
    """How often each target id [V] is a supervised next token (loss mask 1) in `rows`."""
    return np.bincount(rows.tokens[rows.loss_mask], minlength=vocab_size)[:vocab_size]


def vocab_from_counts(counts: np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """The `draft_vocab_size` most frequent ids (ties: lower id first; ids never seen fill
    the rest in id order), with d2t, t2d and the coverage of `counts`."""
    vocab_size = len(counts)
    if not 1 <= draft_vocab_size <= vocab_size:
        raise InputError(f"draft vocabulary size must be in [1, {vocab_size}], "
                         f"got {draft_vocab_size}")
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id
    return vocab_from_used(np.sort(order[:draft_vocab_size]), counts)


def vocab_from_used(used: np.ndarray, counts: np.ndarray) -> DraftVocab:
    """The draft vocabulary of sorted target ids `used` (e.g. an existing head's), with
    d2t, t2d and its coverage of `counts` [V]."""
    used = np.asarray(used, np.int32)
    t2d = np.full(len(counts), -1, np.int32)
    t2d[used] = np.arange(len(used), dtype=np.int32)
    total = counts.sum()
    coverage = float(counts[used].sum() / total) if total else 0.0
    return DraftVocab(used, (used - np.arange(len(used))).astype(np.int32), t2d, coverage)


def select_draft_vocab(rows: PackedRows, vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """The draft vocabulary of the `draft_vocab_size` most frequent supervised tokens."""
    return vocab_from_counts(supervised_token_counts(rows, vocab_size), draft_vocab_size)
