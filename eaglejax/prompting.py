"""Prompts and stop strings as token ids for the loops, and the exact stop-string cut of a
reply (host side; shared by `generate()` and the server)."""

from __future__ import annotations

from collections.abc import Sequence

from eaglejax import validation
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.errors import InputError
from eaglejax.target import Target


def encode_prompts(prompts: list[str | list[int]], target: Target,
                   chat: bool) -> list[list[int]]:
    """Token ids of prompts already checked by `validation.prompt_list`."""
    encoded = []
    for i, prompt in enumerate(prompts):
        name = f"prompt {i}"
        if isinstance(prompt, str):
            if target.tokenizer is None:
                raise InputError(f"{target.source}: the model has no tokenizer; pass token ids")
            try:
                ids = target.tokenizer.render_prompt(prompt, chat=chat)
            except InputError as err:
                raise InputError(f"{name}: {err}") from None
            if not ids:
                raise InputError(f"{name} encodes to no tokens")
        else:
            validation.in_vocabulary(name, prompt, target.config.vocab_size)
            ids = prompt
        encoded.append(ids)
    return encoded


def stop_criteria(target: Target, stop: list[str], ignore_eos: bool) -> StopCriteria:
    """The loop's stop rules: the target's EOS ids (unless `ignore_eos`) and each stop
    string's usual tokenization (an early stop; `cut_at_stop` is the exact check)."""
    sequences = []
    for s in stop:
        if target.tokenizer is None:
            raise InputError(f"{target.source}: stop strings need a tokenizer")
        ids = tuple(target.tokenizer.encode(s))
        if not ids:
            raise InputError(f"stop string {s!r} encodes to no tokens")
        sequences.append(ids)
    eos = () if ignore_eos else tuple(sorted(set(target.eos_token_ids)))
    return StopCriteria(eos, tuple(sorted(set(sequences))))


def cut_at_stop(target: Target, ids: list[int],
                 stop: Sequence[str]) -> tuple[list[int], str | None]:
    """Exact host-side stop-string check: the shortest token prefix whose text holds a stop
    string, and the text before it; (ids, None) when no stop string occurs."""
    decode = target.tokenizer.decode
    if not any(s in decode(ids) for s in stop):
        return ids, None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(ids[:mid]) for s in stop):
            hi = mid
        else:
            lo = mid + 1
    text = decode(ids[:lo])
    cut = min(text.find(s) for s in stop if s in text)
    return ids[:lo], text[:cut]
