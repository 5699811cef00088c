"""Regenerate the assistant turns of conversations with the target itself (EAGLE-3 practice),
so the head learns the target's own distribution. Cached on disk: done once, resumable.

The cache is a JSONL file named by a key over the target, the source data and the
settings: a header line, then one ShareGPT-shaped record per conversation in source
order (each written as soon as it and all before it are done, so a killed run resumes
after the last record). Conversations run with continuous batching (`serving.engine`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from eaglejax.compilation_cache import cache_root
from eaglejax.errors import InputError
from eaglejax.fingerprints import target_fingerprint
from eaglejax.serving.engine import Engine, Request, SamplingOptions
from eaglejax.target import Target
from eaglejax.training.data import Conversation, parse_record, render_messages
from eaglejax.validation import bounded, check_fields

CACHE_FORMAT, CACHE_VERSION = "eaglejax-regenerated", 2


@dataclasses.dataclass(frozen=True)
class RegenConfig:
    """Sampling settings (temperature 0: greedy). A conversation holds at most
    `max_context` tokens: it ends before a user turn that would not leave room for a reply,
    and after a reply cut by `max_new_tokens` or by the context. `num_slots` rows decode at
    once (continuous batching; it never changes the result)."""

    temperature: float = bounded(0.8, "real", 0.0, help="sampling temperature (0: greedy)")
    max_new_tokens: int = bounded(512, "integer", 1, help="tokens per regenerated reply")
    max_context: int = bounded(1024, "integer", 2)
    num_slots: int = bounded(16, "integer", 1, help="conversations regenerated at once "
                                                    "(continuous batching)")
    seed: int = bounded(0, "seed")

    def __post_init__(self):
        check_fields(self)


def default_cache_dir() -> Path:
    """`regenerated/` in eaglejax's cache folder (`compilation_cache.cache_root()`)."""
    return cache_root() / "regenerated"


def cache_key(target: Target, data_id: str, config: RegenConfig) -> str:
    """The cache key of regenerating `data_id` (a digest of the source data) this way."""
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "num_slots"}
    blob = json.dumps({"version": CACHE_VERSION, "target": target_fingerprint(target),
                       "data": data_id, "settings": settings}, sort_keys=True)
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


class _Replay:
    """One conversation being regenerated: its user and system turns still to come and the
    new messages so far."""

    def __init__(self, index: int, conversation: Conversation):
        self.index, self.conversation, self.turn = index, conversation, 0
        self.todo = [m for m in conversation.messages if m[0] != "assistant"]
        self.messages: list[tuple[str, str]] = []

    def next_request(self, tokenizer, config: RegenConfig) -> Request | None:
        """The prompt for the next reply, or None when the conversation is over."""
        while self.todo and self.todo[0][0] != "user":  # system turns before the next user turn
            self.messages.append(self.todo.pop(0))
        if not self.todo:
            return None
        candidate = [*self.messages, self.todo.pop(0)]
        ids = tokenizer.encode(render_messages(tokenizer, candidate, True))
        if len(ids) >= config.max_context:
            return None
        self.messages = candidate
        seed = (config.seed * 1_000_003 + self.index * 131 + self.turn) % 2**31
        # The context cuts a reply: the cache holds the prompt and every new token but the
        # last (the engine's slots hold one row more than max_context).
        max_new = min(config.max_new_tokens, config.max_context + 1 - len(ids))
        return Request(self, ids, max_new, SamplingOptions(config.temperature, seed=seed))

    def result(self) -> Conversation:
        c = self.conversation
        return Conversation(c.id, tuple(self.messages), c.source)


def _replay_all(conversations: Sequence[Conversation], first_index: int, target: Target,
                config: RegenConfig, on_done: Callable[[int, Conversation], None]) -> int:
    """Replace every assistant turn by the target's reply, `config.num_slots` conversations
    in flight: a finished reply's slot takes the conversation's next turn, or the next
    conversation. Calls on_done(index, conversation) as each ends (in any order); returns
    the number of tokens generated."""
    tokenizer = target.tokenizer
    engine = Engine(target, num_slots=config.num_slots, capacity=config.max_context + 1)
    waiting = iter(enumerate(conversations, first_index))
    generated = 0

    def start_next() -> None:
        for index, conversation in waiting:
            replay = _Replay(index, conversation)
            request = replay.next_request(tokenizer, config)
            if request is not None:
                engine.submit(request)
                return
            on_done(index, replay.result())

    for _ in range(config.num_slots):
        start_next()
    replies: dict[_Replay, list[int]] = {}
    while not engine.idle:
        for update in engine.step():
            replay = update.key
            reply = replies.setdefault(replay, [])
            reply.extend(update.token_ids)
            if update.finish_reason is None:
                continue
            del replies[replay]
            generated += len(reply)
            replay.messages.append(("assistant", tokenizer.decode(reply)))
            replay.turn += 1
            request = None
            if update.finish_reason != "length":
                request = replay.next_request(tokenizer, config)
            if request is not None:
                engine.submit(request)
            else:
                on_done(replay.index, replay.result())
                start_next()
    return generated


def regenerate(conversations: Sequence[Conversation], target: Target, data_id: str,
               config: RegenConfig = RegenConfig(), cache_dir: str | Path | None = None,
               progress: bool = True) -> list[Conversation]:
    """`conversations` with every assistant turn sampled from `target` (conversations
    whose first user turn is too long come back with no assistant turn).

    data_id identifies the source (e.g. the file's digest): with the target and the
    settings it names the cache file in `cache_dir` (default `default_cache_dir()`). Records
    already there are reused; the rest are generated with continuous batching
    (`config.num_slots` at once) and appended in order. A reply's seed depends only on its
    conversation's index and turn, so the slot count and resuming never change the result."""
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
    finished: dict[int, Conversation] = {}
    with tqdm(total=len(conversations), initial=min(len(done), len(conversations)),
              unit="conv", desc="regenerating", disable=not progress) as bar, \
            open(path, "a") as cache:

        def on_done(index: int, conversation: Conversation) -> None:
            # Records are appended in source order, so a killed run resumes after the last.
            finished[index] = conversation
            ready = []
            while len(done) in finished:
                ready.append(finished.pop(len(done)))
                done.append(ready[-1])
            if ready:
                cache.write("".join(json.dumps(c.to_record()) + "\n" for c in ready))
                cache.flush()
                os.fsync(cache.fileno())
            bar.update(1)

        if len(done) >= len(conversations):
            return done[:len(conversations)]
        start = time.perf_counter()
        generated = _replay_all(conversations[len(done):], len(done), target, config, on_done)
        if progress and generated:
            rate = generated / (time.perf_counter() - start)
            bar.write(f"regenerated {generated:,} tokens at {rate:.1f} tokens/s")
    return done[:len(conversations)]
