"""Regenerate the assistant turns of conversations with the target itself (EAGLE-3 practice),
so the head learns the target's own distribution. Cached on disk: done once, resumable.

The cache is a JSONL file named by a key over the target, the source data and the
settings: a header line, then one ShareGPT-shaped record per conversation in source
order (written batch by batch, so a killed run resumes after its last complete batch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from eaglejax.errors import InputError
from eaglejax.generate import generate
from eaglejax.target import Target
from eaglejax.training.data import Conversation, parse_record, render_messages
from eaglejax.training.run import target_fingerprint

CACHE_FORMAT, CACHE_VERSION = "eaglejax-regenerated", 1


@dataclasses.dataclass(frozen=True)
class RegenConfig:
    """Sampling settings. A conversation stops before a user turn whose prompt reaches
    `max_context` tokens and after a reply cut by `max_new_tokens`."""

    temperature: float = 0.8
    max_new_tokens: int = 512
    max_context: int = 1024
    batch_size: int = 16
    seed: int = 0


def default_cache_dir() -> Path:
    """`$EAGLEJAX_CACHE/regenerated`, else `~/.cache/eaglejax/regenerated`."""
    root = os.environ.get("EAGLEJAX_CACHE") or Path.home() / ".cache" / "eaglejax"
    return Path(root) / "regenerated"


def cache_key(target: Target, data_id: str, config: RegenConfig) -> str:
    """The cache key of regenerating `data_id` (a digest of the source data) this way."""
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "batch_size"}
    blob = json.dumps({"target": target_fingerprint(target), "data": data_id,
                       "settings": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _read_cache(path: Path, key: str) -> list[Conversation]:
    """Complete records of an existing cache file; a torn last line (a killed write) is cut."""
    raw = path.read_bytes()
    complete = raw[:raw.rfind(b"\n") + 1]
    if len(complete) != len(raw):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    lines = complete.decode("utf-8").splitlines()
    try:
        header = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError:
        header = {}
    if header.get("format") != CACHE_FORMAT or header.get("key") != key:
        raise InputError(f"{path}: exists but is not this regeneration's cache "
                         f"(key {key}); refusing to overwrite it")
    return [parse_record(json.loads(line), f"{path}:{i}") for i, line in enumerate(lines[1:], 2)]


def _regenerate_batch(conversations: Sequence[Conversation], first_index: int, target: Target,
                      config: RegenConfig) -> list[Conversation]:
    """Replace every assistant turn, turn by turn across the batch, by the target's reply."""
    tokenizer = target.tokenizer
    originals = [[m for m in c.messages if m[0] != "assistant"] for c in conversations]
    new: list[list[tuple[str, str]]] = [[] for _ in conversations]
    active = list(range(len(conversations)))
    turn = 0
    while active:
        prompts, rows = [], []
        for i in active:
            # The next user turn with any system turns before it.
            while originals[i] and originals[i][0][0] != "user":
                new[i].append(originals[i].pop(0))
            if not originals[i]:
                continue
            candidate = [*new[i], originals[i].pop(0)]
            ids = tokenizer.encode(render_messages(tokenizer, candidate, True))
            if len(ids) >= config.max_context:
                continue
            new[i] = candidate
            prompts.append(ids)
            rows.append(i)
        if not prompts:
            break
        seeds = [(config.seed * 1_000_003 + (first_index + i) * 131 + turn) % 2**31 for i in rows]
        results = generate(prompts, target=target, max_new_tokens=config.max_new_tokens,
                           temperature=config.temperature, seed=seeds, chat=False)
        active = []
        for i, result in zip(rows, results):
            new[i].append(("assistant", result.text or ""))
            if result.finish_reason != "length":
                active.append(i)
        turn += 1
    return [Conversation(c.id, tuple(messages), c.source)
            for c, messages in zip(conversations, new)]


def regenerate(conversations: Sequence[Conversation], target: Target, data_id: str,
               config: RegenConfig = RegenConfig(), cache_dir: str | Path | None = None,
               progress: bool = True) -> list[Conversation]:
    """`conversations` with every assistant turn sampled from `target` (conversations
    whose first user turn is too long come back with no assistant turn).

    data_id identifies the source (e.g. the file's digest): with the target and the
    settings it names the cache file in `cache_dir` (default `default_cache_dir()`). Records
    already there are reused; the rest are generated in batches of `config.batch_size` and
    appended. Row seeds depend on the conversation's index only, so batching and resuming
    never change the result."""
    if target.tokenizer is None:
        raise InputError(f"{target.source}: regeneration needs the target's tokenizer")
    key = cache_key(target, data_id, config)
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"regenerated-{key}.jsonl"
    if path.exists():
        done = _read_cache(path, key)
    else:
        header = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "key": key,
                  "target": target.source, "data": data_id, "settings": dataclasses.asdict(config)}
        with open(path, "x") as f:
            f.write(json.dumps(header) + "\n")
        done = []
    with tqdm(total=len(conversations), initial=min(len(done), len(conversations)),
              unit="conv", desc="regenerating", disable=not progress) as bar:
        for start in range(len(done), len(conversations), config.batch_size):
            batch = conversations[start:start + config.batch_size]
            fresh = _regenerate_batch(batch, start, target, config)
            with open(path, "a") as f:
                f.write("".join(json.dumps(c.to_record()) + "\n" for c in fresh))
                f.flush()
                os.fsync(f.fileno())
            done.extend(fresh)
            bar.update(len(batch))
    return done[:len(conversations)]
