"""The data steps `eaglejax train-draft` runs before training, and its evaluation prompts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eaglejax.datasets import interleave_categories, mt_bench_questions
from eaglejax.errors import InputError
from eaglejax.fingerprints import file_fingerprint
from eaglejax.target import Target
from eaglejax.training.data import PackedRows, pack, read_conversations, tokenize_all
from eaglejax.training.regenerate import RegenConfig, regenerate

RegenPlan = RegenConfig | Sequence[tuple[int, RegenConfig]] | None


def prepare_rows(target: Target, data: str | Path, *, seq_len: int,
                 max_conversations: int | None = None, regen: RegenPlan = None,
                 regen_cache: str | Path | None = None, cut_repeats: int = 0,
                 regen_target: Target | None = None, progress: bool = True) -> PackedRows:
    """Read a ShareGPT-shaped file (first `max_conversations`), optionally regenerate its
    assistant turns with the target (cached), render, mask, truncate (at `seq_len`, and
    where a supervised `cut_repeats`-gram repeats, see `tokenize_all`) and pack.

    `regen` is one RegenConfig for every conversation, or blocks [(first index, config),
    ...] in increasing order: each config regenerates the conversations from its first
    index to the next block's (e.g. greedy replies for some, sampled for the rest).
    `regen_target` regenerates instead of `target` (the same model as users decode with it,
    e.g. in a GGUF file's blocks: the replies a head will be asked to predict); `target`
    still tokenizes."""
    if target.tokenizer is None:
        raise InputError(f"{target.source}: training on conversations needs the target's "
                         f"tokenizer and chat template")
    conversations = read_conversations(data, max_conversations)
    blocks = [(0, regen)] if isinstance(regen, RegenConfig) else list(regen or ())
    starts = [first for first, _ in blocks]
    if starts and (starts[0] != 0 or starts != sorted(set(starts))):
        raise InputError(f"regen blocks must start at conversation 0 and increase, got {starts}")
    if blocks:
        digest, regenerated = file_fingerprint(data), []
        for (first, config), end in zip(blocks, [*starts[1:], len(conversations)]):
            data_id = digest if first == 0 else f"{digest}[{first}:]"
            regenerated += regenerate(conversations[first:end], regen_target or target,
                                      data_id, config, regen_cache, progress)
        conversations = regenerated
    return pack(tokenize_all(conversations, target.tokenizer, seq_len, cut_repeats), seq_len)


def mt_bench_prompts(count: int, path: str | Path | None = None) -> list[str]:
    """First turns of `count` MT-bench questions taken round-robin over its categories (8
    gives one per category): the held-in evaluation slice."""
    return [q.prompt for q in interleave_categories(mt_bench_questions(path))[:count]]
