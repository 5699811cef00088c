"""Continuous batching, the host half: a queue of requests decoded over a fixed set of slots.

The engine owns one running batch (`decoding.slots`): each `step()` prefills queued
requests into free slots, runs the compiled loop for at most `rounds_per_call` rounds
(it comes back early when a row finishes) and reports every request's new tokens, so
callers can stream them. Plain or speculative decoding (any `SpecConfig`, or "auto", the
default with a head in one process: each step's mode chosen by `serving.shape_policy`);
sampling settings, seeds, token limits and stop rules are per request and never recompile.
A request's tokens are the ones `eaglejax.generate()` gives it alone (greedy: exactly;
sampled under a fixed shape: the same seed draws the same tokens up to float rounding
between batch shapes; under "auto" the draws depend on the modes that ran, each exact).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from tqdm import tqdm

from eaglejax import validation
from eaglejax.decoding import slots
from eaglejax.decoding.autotune import PLAIN_WIDTH, AutoPlan
from eaglejax.decoding.buckets import bucket, fine_bucket, fine_buckets
from eaglejax.decoding.bundle import Bundle
from eaglejax.decoding.drafters.head_state import HeadState
from eaglejax.decoding.loops import State
from eaglejax.decoding.prefix_pool import BLOCK
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.speculation import AUTO, resolve_speculation
from eaglejax.decoding.suffix_history import remember_replies
from eaglejax.decoding.token_logprobs import TokenLogprob, check_count, row_logprobs
from eaglejax.decoding.stopping import (
    FINISH_NONE,
    FINISH_REASONS,
    StopCriteria,
    StopTable,
)
from eaglejax.errors import InputError
from eaglejax.models import kv_cache
from eaglejax.serving.kv_blocks import BlockTables
from eaglejax.serving.prefix_cache import PREFIX_CACHE_TOKENS, PrefixCache
from eaglejax.serving.shape_policy import ShapePolicy
from eaglejax.target import Target

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft

# `auto`'s mode for steps that leave the head behind (more rows than may speculate, or a row
# whose head was left behind): the target's plain steps alone, at plain decoding's cost.
TARGET_ONLY = -1
# Fewest target forwards a step must run (of those it was given) for its time to count as
# its mode's cost: a step a finishing row cut to a round or two measures mostly the call's
# dispatch.
MIN_TIMED_FORWARDS = 4
MIN_PROMPT_BUCKET = 16
MAX_STOP_SEQUENCES = 4  # OpenAI's limit on stop strings
MAX_STOP_TOKENS = 16  # longer stop sequences end replies on the host side only
MAX_STOP_TOKEN_IDS = 8  # a request's own end-of-reply tokens beside the model's EOS
# A row that could speculate (`auto` at one row) with a drafter whose rows the prefix cache
# does not keep (not an EAGLE head) takes a hit of at least this many cached tokens per token it
# may generate: the rest is then prefilled by the target alone and the row decodes plainly. On
# SmolLM2 (2 cores, BENCHMARKS.md) a prompt token's prefill costs 0.85-1.3 ms and speculation
# at its best (1.10x a 4-5 ms step) saves 0.4-0.5 ms a token.
HIT_PER_REPLY_TOKEN = 0.5
REPLY_WINDOW = 64  # a paged engine expects replies as long as the last this many (`_expected`)
# Prompt tokens a step prefills before it reports (it fills one more request while under):
# a burst of requests then gets its first tokens as its prefills finish, not all after the
# last one (64 MT-bench prompts took 8-9 s to prefill on 2 CPU cores, BENCHMARKS.md).
FILL_TOKENS_PER_STEP = 256


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """temperature 0 is greedy; top_k 0 and top_p 1 are off; seed in [0, 2**32)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt (token ids) to continue for at most `max_new_tokens`. `key` is the caller's
    handle, unique among live requests. `stop_sequences` (token ids, at most 4) end the
    reply inside the loop; EOS ends it unless `ignore_eos`, and so does any of
    `stop_token_ids` (at most 8, kept in the reply as EOS is; `ignore_eos` leaves them).
    `logprobs` (None: none): each token's log-probability under the target and that many
    most likely tokens' (at most the engine's `max_logprobs`). `deadline` (None: none): a
    `time.monotonic()` time (the clock `step` is given) after which the request ends,
    queued or running, with finish reason "timeout" and the tokens it has."""

    key: Hashable
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingOptions = SamplingOptions()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    deadline: float | None = None


class QueueFull(InputError):
    """A request arrived while `max_waiting` requests already waited for a slot."""


@dataclasses.dataclass(frozen=True)
class Update:
    """A request's tokens new since its previous update; `finish_reason` ("eos", "stop",
    "length", "timeout": its deadline passed) once it ended, else None. `rounds`: target
    forwards spent on it after the prefill (verification rounds; plain decoding: one per
    token). `cached_tokens`: prompt tokens copied from the prefix cache, not prefilled.
    `logprobs`: one entry per new token (for a request that asked for them)."""

    key: Hashable
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    generated: int
    rounds: int
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per target forward after the first token (plain decoding: 1.0)."""
        return (self.generated - 1) / self.rounds if self.rounds else None


@dataclasses.dataclass
class _Live:
    """A request in a slot, how many of its tokens were reported (after how many target
    forwards) and how many of its prompt's came from the prefix cache."""

    request: Request
    reported: int = 0
    cached: int = 0
    rounds: int = 0
    order: int = 0  # when it was filled (among the engine's fills)


@dataclasses.dataclass(frozen=True)
class _Resume:
    """A preempted request's generated tokens (all reported) and its counters."""

    tokens: np.ndarray
    cached: int
    rounds: int


# The text `profile_rounds` times by default (chat-rendered), one request of everyday length.
PROFILE_PROMPT = "Explain speculative decoding in two sentences."


class Engine:
    """Decode queued requests over `num_slots` rows of `capacity` tokens each (prompt plus
    reply). `speculative`: a `SpecConfig`, "auto", or None (with a draft head: "auto" in one
    process, the device's preset in several). `prefix_cache_tokens` positions of earlier
    prompts and replies are kept for requests that start with them (`serving.prefix_cache`;
    0: none), in engines that decode plainly or with "auto" in one process (on a mesh
    too). At most
    `max_waiting` requests wait for a slot (None: any number); `submit` refuses more with
    `QueueFull`. With `max_logprobs` (0 to 20; None: no request may ask) a request may ask
    for its tokens' log-probabilities and up to that many most likely tokens' (the batch's
    output keeps them; the work is done only while a running request asked). With
    `kv_tokens`, the target's KV cache is paged (`serving.kv_blocks`): a pool of that many
    positions (in blocks of `BLOCK`) shared by the slots, and an EAGLE head's cache a pool
    of as many blocks read through the same block tables, so `num_slots` bounds the running
    requests and not the memory (a draft model's or DFlash drafter's cache stays per slot);
    when a step's rows need more blocks than are free, the newest running request is
    preempted (its blocks freed, its prompt and tokens prefilled again later) and completes
    with the tokens it would have produced. On a mesh the pools split their KV heads as the
    slots' caches do (`kv_cache.init_paged_cache`); across processes each runs the same
    steps on the same block tables. Not thread-safe: one thread submits, cancels and
    steps."""

    def __init__(self, target: Target, draft: "Draft | None" = None, *,
                 speculative: SpecConfig | str | None = None, num_slots: int = 8,
                 capacity: int = 1024, rounds_per_call: int = 16,
                 prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
                 max_waiting: int | None = None, max_logprobs: int | None = None,
                 kv_tokens: int | None = None):
        validation.integer("num_slots", num_slots, 1)
        validation.integer("capacity", capacity, 2)
        validation.integer("rounds_per_call", rounds_per_call, 1)
        validation.integer("prefix_cache_tokens", prefix_cache_tokens, 0)
        if max_waiting is not None:
            validation.integer("max_waiting", max_waiting, 0)
        self.max_waiting = max_waiting
        self.max_logprobs = check_count("max_logprobs", max_logprobs)
        limit = target.config.max_position_embeddings
        if capacity > limit:
            raise InputError(f"capacity {capacity} exceeds the model's context of {limit} tokens")
        speculative = resolve_speculation(target, draft, speculative, num_slots,
                                          auto_by_default=True)
        self.policy: ShapePolicy | None = None
        if speculative == AUTO:
            platform = jax.default_backend()
            self.policy = ShapePolicy(target, draft, AutoPlan.for_target(target, draft),
                                      platform)
            speculative = self.policy.plan.probe  # the state every mode runs on
        self.target, self.draft, self.spec = target, draft, speculative
        # The loop and weights every program runs (on a target's mesh, the batch follows
        # its sharding rules).
        self.models = Bundle.of(target, draft, speculative)
        # Suffix drafting or a lookup branch with history: replies go to the history.
        self._history = speculative is not None and speculative.uses_history
        self.num_slots, self.capacity = num_slots, capacity
        self.rounds_per_call = np.int32(rounds_per_call)
        self.blocks = self._block_tables(kv_tokens)
        self.preemptions = 0
        self._resumes: dict[Hashable, _Resume] = {}  # preempted requests' tokens so far
        self._admitted = 0  # requests filled so far (a slot's order: the newest preempted)
        self._replies: collections.deque[int] = collections.deque(maxlen=REPLY_WINDOW)
        self.eos_ids = tuple(sorted(set(target.eos_token_ids)))
        self.state = self._empty_state()
        self.queue: collections.deque[Request] = collections.deque()
        self.slots: list[_Live | None] = [None] * num_slots
        self._temperature = np.zeros(num_slots, np.float32)
        self._top_k = np.zeros(num_slots, np.int32)
        self._top_p = np.ones(num_slots, np.float32)
        self._max_new = np.zeros(num_slots, np.int32)
        self._stops = [StopCriteria()] * num_slots
        self._stop_table = self._table(self._stops)
        self._compiled: set[tuple[int | None, int, bool]] = set()  # (mode, rows, greedy)
        self._ran: set[tuple[int, int, bool]] = set()  # auto: programs that ran a round
        self._stale = np.zeros(num_slots, bool)  # auto: the slot's head was left behind
        self._plain_steps = np.zeros(num_slots, np.int64)  # auto: target forwards not in
        # the acceptance histogram (plain segments), per slot
        self.prefix: PrefixCache | None = None
        fills_target_alone = speculative is None or self.policy is not None
        if prefix_cache_tokens and fills_target_alone and capacity > BLOCK + 1 \
                and jax.process_count() == 1:
            self.prefix = PrefixCache(self.state.target_cache, -(-prefix_cache_tokens // BLOCK),
                                      self._head_cache(), self.blocks)
        self.round_splits: list[dict[str, Any]] = []  # `profile_rounds`' results

    # ------------------------------------------------------------------ public interface

    @property
    def idle(self) -> bool:
        """No request is queued or running."""
        return not self.queue and all(s is None for s in self.slots)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    @property
    def speculation(self) -> str | None:
        """What decodes: None (plain), "auto" or the fixed shape's description."""
        if self.spec is None:
            return None
        return "auto" if self.policy is not None else self.spec.describe()

    @property
    def num_waiting(self) -> int:
        """Queued requests that the free slots will not take at the next step."""
        return max(0, len(self.queue) - (self.num_slots - self.num_running))

    def kv_tokens(self) -> int:
        """Positions the running requests hold in their slots' caches (prompt and reply so
        far; the host's count)."""
        return sum(len(s.request.prompt) + s.reported for s in self.slots if s is not None)

    def kv_capacity(self) -> int:
        """Positions the target's KV cache holds: every slot's, or a paged cache's pool."""
        if self.blocks is None:
            return self.num_slots * self.capacity
        return self.blocks.blocks * self.blocks.block_size

    def submit(self, request: Request) -> None:
        """Queue a request after `check` and `refuse_if_full`."""
        self.check(request)
        self.refuse_if_full(request)
        self.queue.append(request)

    def refuse_if_full(self, request: Request, queued: int | None = None) -> None:
        """QueueFull if `request` would wait for a slot behind `max_waiting` others, `queued`
        requests (by default this engine's queue) before it."""
        waiting = (len(self.queue) if queued is None else queued) - (
            self.num_slots - self.num_running)
        if self.max_waiting is not None and waiting >= self.max_waiting:
            raise QueueFull(f"request {request.key!r}: {waiting} requests already wait for "
                            f"one of {self.num_slots} slots (the server's limit); retry later")

    def check(self, request: Request) -> None:
        """InputError (naming the request and the value) unless `request` can run here."""
        name = f"request {request.key!r}"
        n = len(request.prompt)
        if n == 0 or n >= self.capacity:
            raise InputError(f"{name}: prompt of {n} tokens; a slot holds prompts of 1 to "
                             f"{self.capacity - 1} tokens")
        validation.in_vocabulary(name, list(request.prompt), self.target.config.vocab_size)
        validation.integer(f"{name}: max_new_tokens", request.max_new_tokens, 1)
        if n + request.max_new_tokens > self.capacity:
            raise InputError(f"{name}: {n} prompt tokens + max_new_tokens "
                             f"{request.max_new_tokens} exceed the slot capacity of "
                             f"{self.capacity} tokens")
        s = request.sampling
        validation.sampling(s.temperature, s.top_k, s.top_p, name=lambda arg: f"{name}: {arg}")
        validation.seed(f"{name}: seed", s.seed)
        if self.spec is not None and s.temperature > 0:
            try:
                self.spec.check_sampling(greedy=False)
            except InputError as err:
                raise InputError(f"{name}: {err}") from None
        if len(request.stop_sequences) > MAX_STOP_SEQUENCES:
            raise InputError(f"{name}: at most {MAX_STOP_SEQUENCES} stop sequences, got "
                             f"{len(request.stop_sequences)}")
        for seq in request.stop_sequences:
            if not seq:
                raise InputError(f"{name}: an empty stop sequence")
            validation.in_vocabulary(f"{name}: stop sequence", list(seq),
                                     self.target.config.vocab_size)
        if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InputError(f"{name}: at most {MAX_STOP_TOKEN_IDS} stop token ids, got "
                             f"{len(request.stop_token_ids)}")
        validation.in_vocabulary(f"{name}: stop token ids", list(request.stop_token_ids),
                                 self.target.config.vocab_size)
        if request.deadline is not None:
            validation.real(f"{name}: deadline", request.deadline, -validation.FLOAT32_MAX)
        if request.logprobs is not None:
            if self.max_logprobs is None:
                raise InputError(f"{name}: logprobs: this engine keeps no log-probabilities "
                                 f"(start it with max_logprobs)")
            validation.integer(f"{name}: logprobs", request.logprobs, 0, self.max_logprobs)
        if any(self._key_of(i) == request.key for i in range(self.num_slots)) or any(
                q.key == request.key for q in self.queue):
            raise InputError(f"{name}: a live request already has this key")

    def cancel(self, key: Hashable) -> None:
        """Drop a queued request or free its slot (no further update for it)."""
        for queued in self.queue:
            if queued.key == key:
                self.queue.remove(queued)
                self._resumes.pop(key, None)
                return
        for i in range(self.num_slots):
            if self._key_of(i) == key:
                self.state = self.models.run(slots.release, self.state,
                                             self.models.put(np.int32(i)))
                self._free(i)
                return

    def step(self, now: float | None = None) -> list[Update]:
        """Fill free slots from the queue (up to `FILL_TOKENS_PER_STEP` prompt tokens, then
        report the new requests' first tokens), or else run at most `rounds_per_call` rounds
        (fewer when a row finishes); report every request that gained tokens or finished.
        Requests whose deadline is past `now` (default: `time.monotonic()`) end first, queued
        or running."""
        expired = self._expire(time.monotonic() if now is None else now)
        filled_now, prefilled = False, 0
        for i in range(self.num_slots):
            if prefilled >= FILL_TOKENS_PER_STEP:
                break  # report these first tokens; the next step fills more
            if self.slots[i] is None and self.queue and self._admits(self.queue[0]):
                self._fill_queued(i, self.queue.popleft())
                filled_now = True
                prefilled += len(self.slots[i].request.prompt) - self.slots[i].cached
        if self.idle:
            return expired
        if not filled_now and np.any(self._filled() & (self._finish() == FINISH_NONE)):
            self._advance(np.int32(self._reserve(int(self.rounds_per_call))))
        return expired + self._collect()  # after a fill: the first tokens at once

    def _expire(self, now: float) -> list[Update]:
        """End the requests whose deadline is past `now`: queued ones with no token, running
        ones with the tokens reported so far (their slots freed)."""
        late = lambda r: r.deadline is not None and r.deadline <= now  # noqa: E731
        updates = []
        for r in filter(late, self.queue):
            resume = self._resumes.pop(r.key, None)  # a preempted one: its tokens reported
            updates.append(Update(r.key, [], "timeout", len(r.prompt), 0, 0) if resume is None
                           else Update(r.key, [], "timeout", len(r.prompt), len(resume.tokens),
                                       resume.rounds, resume.cached))
        self.queue = collections.deque(r for r in self.queue if not late(r))
        for i, live in enumerate(self.slots):
            if live is not None and late(live.request):
                updates.append(Update(live.request.key, [], "timeout", len(live.request.prompt),
                                      live.reported, live.rounds, live.cached,
                                      None if live.request.logprobs is None else []))
                self.cancel(live.request.key)
        return updates

    def profile_rounds(self, prompt: str | list[int] = PROFILE_PROMPT, *, rounds: int = 16,
                       repeats: int = 3) -> list[dict[str, Any]]:
        """Measure where a round of each speculative shape this engine runs goes (draft,
        verify, accept + commit, catch-up, other: `round_split`, batch 1, greedy, on
        `prompt`), keep the results in `round_splits` (`/metrics` shows them) and return
        them. Call it on an idle engine, before its thread starts."""
        if not self.idle:
            raise InputError("profile an idle engine (requests are queued or running)")
        if self.draft is None:  # plain, or a method that drafts without a head
            return []
        from eaglejax.bench import profile_rounds  # the benchmark stack, only when asked
        speculative = "auto" if self.policy is not None else self.spec
        self.round_splits = profile_rounds(self.target, self.draft, prompt, speculative,
                                           rounds=rounds, repeats=repeats)
        return self.round_splits

    def warmup(self, progress: bool = True) -> None:
        """Compile now, so that no request waits for a compilation: the prefills of every
        prompt bucket (with `auto`, also the target's alone) and the loop over every count of
        active rows, greedy and sampled."""
        if not self.idle:
            raise InputError("warm up an idle engine (requests are queued or running)")
        prompts = fine_buckets(self.capacity, MIN_PROMPT_BUCKET) + [self.capacity - 1]
        row_counts = sorted({self._active_rows(np.arange(self.num_slots) == i)
                             for i in range(self.num_slots)})
        temperatures = [0.0]
        if self.spec is None or self.spec.samples_losslessly:
            temperatures.append(1.0)
        work = [(n, r, t) for t in temperatures for n in prompts for r in row_counts
                if n == prompts[0] or r == row_counts[0]]
        for n, rows, temperature in tqdm(work, desc="compiling", disable=not progress):
            request = Request(("warm-up", n, rows, temperature), [0] * n, 1,
                              SamplingOptions(temperature), ignore_eos=True)
            self.check(request)
            self._fill(rows - 1, request, cache=False)
            for mode in self._modes_to_warm(rows):
                self._advance(np.int32(0), mode)
            if self.blocks is not None and n == prompts[0] and rows == row_counts[0]:
                self._resume_row(rows - 1, np.zeros(1, np.int32))  # a preempted request's
            self.cancel(request.key)
            if (rows == row_counts[0] and self.policy is not None
                    and self.policy.max_speculative_rows is not None):
                self._fill(rows - 1, request, target_only=True, cache=False)  # rows left
                self.cancel(request.key)  # behind
            if rows == row_counts[0] and self.prefix is not None:  # prefix-cache hits
                hit = dataclasses.replace(request, prompt=[0] * min(BLOCK - 1 + n,
                                                                    self.capacity - 1))
                for head in {False, self.prefix.keeps_heads}:  # whose rest fills
                    self._fill(rows - 1, hit, hit=self._warm_hit(), head=head)  # `n`'s
                    self.cancel(hit.key)  # bucket
        if self.prefix is not None:
            self.prefix.warmup(self.state.target_cache, self._head_cache())
        # Programs run asynchronously: the last warm-up prefills (the longest prompts) would
        # otherwise still be running when the server reports ready, and the first request
        # waited for them (~2 s of its time to first token on a 2-core CPU).
        jax.block_until_ready(self.state)

    # ------------------------------------------------------------------------ internals

    def _modes_to_warm(self, rows: int) -> list[int | None]:
        """The programs a step of `rows` active rows may run: the fixed shape (None), or
        `auto`'s modes there, and where rows may be left behind, the target alone."""
        if self.policy is None:
            return [None]
        modes = self.policy.modes(rows)
        warm = list(modes) if len(modes) > 1 else []
        return warm + ([TARGET_ONLY] if self.policy.max_speculative_rows is not None else [])

    def _empty_state(self) -> State:
        """A batch of free slots (all finished), shaped as a prefill of `num_slots` rows."""
        return self.models.empty_state(self.num_slots, capacity=self._cache_capacity,
                                       max_tokens=self.capacity,
                                       stop=self._table([StopCriteria()] * self.num_slots),
                                       logprobs=self.max_logprobs,
                                       paged=None if self.blocks is None else
                                       (self.blocks.blocks, self.blocks.block_size))

    @property
    def _cache_capacity(self) -> int:
        """Cache rows per slot: the tokens plus a speculative round's scratch rows."""
        return -(-(self.capacity + self.models.loop.scratch_rows) // 128) * 128

    def _key_of(self, slot: int) -> Hashable | None:
        live = self.slots[slot]
        return None if live is None else live.request.key

    def _table(self, rules: list[StopCriteria]) -> StopTable:
        return StopTable.rows(rules, len(self.eos_ids) + MAX_STOP_TOKEN_IDS,
                              MAX_STOP_SEQUENCES, MAX_STOP_TOKENS)

    def _fill(self, slot: int, request: Request, target_only: bool | None = None,
              cache: bool = True, hit: list[int] | None = None, head: bool = False) -> None:
        """Prefill `request` into `slot` and record its settings there; with `auto`, the
        target alone where the row will decode plainly to its end (`_target_alone`, or as
        `target_only` says), since its head would never be used. With `cache`, a prefix the
        prefix cache holds is copied in instead of prefilled (`_prefix_hit`), and the prompt's
        blocks are kept (with the head's rows where the row keeps its head). `hit`: these
        pool blocks as the prompt's cached prefix, with the head's rows if `head` (warming
        up)."""
        n = len(request.prompt)
        s = request.sampling
        self._temperature[slot], self._top_k[slot], self._top_p[slot] = (
            s.temperature, s.top_k, s.top_p)
        self._max_new[slot] = request.max_new_tokens
        eos = (() if request.ignore_eos else self.eos_ids) + tuple(
            int(t) for t in request.stop_token_ids)
        self._stops[slot] = StopCriteria(eos, tuple(
            seq for seq in request.stop_sequences if len(seq) <= MAX_STOP_TOKENS))
        self._stop_table = self._table(self._stops)
        row = slice(slot, slot + 1)
        sampling = SamplingParams(self._temperature[row], self._top_k[row], self._top_p[row])
        stop = StopTable(*(x[row] for x in self._stop_table))
        greedy = bool(s.temperature == 0)
        if target_only is None:
            self._stale[slot] = False  # the slot's last request's, not this one's
            live = self._filled()
            live[[slot, *self._joining(slot)]] = True
            target_only = self.policy is not None and self._target_alone(live)
        if hit is not None:
            cache = False
        else:
            hit, head = self._prefix_hit(request, target_only) if cache else ([], False)
        # The hit's last position is prefilled again: the head's row there consumes the
        # token after it (this prompt's, not the cached sequence's) and the target's feature.
        cached = max(BLOCK * len(hit) - 1, 0)
        prompt = np.zeros((1, min(fine_bucket(n - cached, MIN_PROMPT_BUCKET), self.capacity)),
                          np.int32)
        prompt[0, :n - cached] = request.prompt[cached:]
        row_args = self.models.put((prompt, np.array([n - cached], np.int32),
                                    jax.random.PRNGKey(np.uint32(s.seed))[None], sampling,
                                    self._max_new[row], stop))
        if self._history:
            self.models = self.models.with_current_history()
        slot_arg = self.models.put(np.int32(slot))
        if self.blocks is not None:  # the hit's blocks themselves, read-only; the last:
            self.blocks.share(slot, hit[:-1])  # copied, its last row prefilled again
            if not self.blocks.grow(slot, n):
                raise RuntimeError(f"slot {slot}: too few free KV blocks for {n} positions")
            self._sync_tables()
        if hit:
            target_only = not head
            self._fill_after(slot_arg, request, hit, head, cached, row_args, greedy)
        else:
            fill = slots.fill_target if target_only and self.spec is not None else slots.fill
            self.state = self.models.run(fill, self.state, slot_arg, *row_args, greedy=greedy)
        if self.max_logprobs is not None:  # a fill leaves its row computing them
            self.state = self.models.run(slots.want_logprobs, self.state, slot_arg,
                                         self.models.put(np.bool_(request.logprobs is not None)))
        if cache and self.prefix is not None:
            self.prefix.save(self.state.target_cache, slot, request.prompt,
                             None if target_only else self._head_cache())
        self._admitted += 1
        self.slots[slot] = _Live(request, cached=cached, order=self._admitted)
        self._plain_steps[slot], self._stale[slot] = 0, bool(target_only)
        if self.policy is not None:
            self.policy.admit(request.key)

    def _block_tables(self, kv_tokens: int | None) -> BlockTables | None:
        """The host's block tables of a paged engine (None: slots of `capacity`)."""
        if kv_tokens is None:
            return None
        validation.integer("kv_tokens", kv_tokens, 1)
        width = self._cache_capacity // BLOCK
        if kv_tokens < width * BLOCK:
            raise InputError(f"kv_tokens {kv_tokens} is less than one request's "
                             f"{width * BLOCK} positions (capacity {self.capacity} plus a "
                             f"round's scratch rows, in blocks of {BLOCK})")
        return BlockTables(self.num_slots, kv_tokens // BLOCK, BLOCK, width)

    def _sync_tables(self) -> None:
        """Hand the device the block tables if the host changed them."""
        if self.blocks is not None and self.blocks.changed:
            self.state = self.models.run(slots.set_tables, self.state,
                                         self.models.put(self.blocks.tables))
            self.blocks.changed = False

    def _positions(self, slot: int, rounds: int) -> int:
        """Cache positions `slot`'s request may hold after `rounds` more rounds."""
        live = self.slots[slot]
        n = len(live.request.prompt)
        grown = n + live.reported + rounds * self._tokens_per_round
        return min(grown, n + live.request.max_new_tokens + self._draft_reach)

    @property
    def _tokens_per_round(self) -> int:
        """The most tokens a round adds to a row (a speculative round's accepted path and
        bonus; a plain step's one)."""
        hist = getattr(self.state, "accept_hist", None)
        return 1 if hist is None else hist.shape[1]

    @property
    def _draft_reach(self) -> int:
        """Positions past a request's last that a round's drafting may stage and read back
        (an EAGLE chain's head steps in its last round: drafts past its end, which the
        acceptance counts still see): a round's tokens, in a speculative batch."""
        return 0 if getattr(self.state, "accept_hist", None) is None else self._tokens_per_round

    def _admits(self, request: Request) -> bool:
        """Whether a paged engine has the blocks to start `request` (through its first call)
        and still give every running request one more round, and to hold what it and the
        running requests are expected to grow to (`_expected`) (slot engines: always).
        Running requests may be preempted later, but never for the request just started."""
        if self.blocks is None:
            return True
        resume = self._resumes.get(request.key)
        done = 0 if resume is None else len(resume.tokens)
        n = len(request.prompt) + done
        growth = min(n + int(self.rounds_per_call) * self._tokens_per_round,
                     len(request.prompt) + request.max_new_tokens)
        live = [i for i, s in enumerate(self.slots) if s is not None]
        now = sum(self.blocks.shortfall(i, self._positions(i, 1)) for i in live)
        later = sum(self.blocks.shortfall(i, self._expected(self.slots[i].request,
                                                            self.slots[i].reported))
                    for i in live)
        free = self.blocks.free
        return (self.blocks.needed(growth) + now <= free
                and self.blocks.needed(max(growth, self._expected(request, done))) + later
                <= free)

    def _expected(self, request: Request, generated: int) -> int:
        """Positions `request` is expected to end with, `generated` tokens in: its prompt and
        the mean reply of the last requests that ended (before any: `max_new_tokens`, so the
        first requests are never preempted), at least what it has."""
        typical = np.mean(self._replies) if self._replies else request.max_new_tokens
        reply = min(request.max_new_tokens, max(generated + 1, int(np.ceil(typical))))
        return len(request.prompt) + reply

    def _reserve(self, rounds: int) -> int:
        """Give the running rows the blocks their next call may fill: for `rounds` rounds,
        or fewer (halving) when blocks are short, preempting the newest request when not even
        one round fits. Returns the rounds the call may run."""
        if self.blocks is None:
            return rounds
        while True:
            live = [i for i, s in enumerate(self.slots) if s is not None]
            for tried in itertools.takewhile(lambda r: r >= 1, (rounds >> k for k in range(32))):
                wants = {i: self._positions(i, tried) for i in live}
                if sum(self.blocks.shortfall(i, p) for i, p in wants.items()) <= self.blocks.free:
                    for i, p in wants.items():
                        self.blocks.grow(i, p)
                    return tried
            if len(live) <= 1:
                raise RuntimeError("a paged KV cache too small for one request")
            self._preempt(max(live, key=lambda i: self.slots[i].order))

    def _preempt(self, slot: int) -> None:
        """Free `slot`'s request and its blocks and queue it first again, to resume from the
        tokens it has (`_fill_queued`); a prefix cache keeps its rows meanwhile."""
        live = self.slots[slot]
        tokens = self.models.fetch(self.state.out.tokens)[slot, :live.reported]
        if self.prefix is not None:
            self.prefix.save(self.state.target_cache, slot,
                             np.concatenate([live.request.prompt, tokens[:-1]]))
        self.state = self.models.run(slots.release, self.state, self.models.put(np.int32(slot)))
        self._free(slot)
        self._resumes[live.request.key] = _Resume(tokens, live.cached, live.rounds)
        self.queue.appendleft(live.request)
        self.preemptions += 1

    def _fill_queued(self, slot: int, request: Request) -> None:
        """`_fill`, or for a preempted request its prompt and tokens but the last prefilled
        (by the target alone where `auto` runs: the row decodes plainly) and the row made to
        go on from its tokens (`slots.resume_row`: same seeds, same stop rules)."""
        resume = self._resumes.pop(request.key, None)
        if resume is None:
            self._fill(slot, request)
            return
        tokens = resume.tokens
        again = dataclasses.replace(request, prompt=tuple(request.prompt) + tuple(
            int(t) for t in tokens[:-1]))
        self._fill(slot, again, target_only=True if self.policy is not None else None)
        self._resume_row(slot, tokens)
        live = self.slots[slot]
        live.request, live.reported = request, len(tokens)
        live.cached, live.rounds = resume.cached, resume.rounds

    def _warm_hit(self) -> list[int]:
        """A prefix-cache block a warm-up fill may read: block 0 of the prefix pool, or in a
        paged engine a block of its pool that the index keeps (a block of zeros at first)."""
        if self.blocks is None:
            return [0]
        if not self.prefix.index:
            self.blocks.grow(0, BLOCK)  # slot 0 is free while warming up
            block = int(self.blocks.tables[0, 0])
            self.prefix.index[b"warm-up"] = block
            self.blocks.keep(block)
            self.blocks.release(0)
        return [next(iter(self.prefix.index.values()))]

    def _resume_row(self, slot: int, tokens: np.ndarray) -> None:
        """`slots.resume_row`: `slot`'s row goes on from `tokens`."""
        whole = np.zeros((1, self.capacity), np.int32)
        whole[0, :len(tokens)] = tokens
        self.state = self.models.run(slots.resume_row, self.state,
                                     *self.models.put((np.int32(slot), whole,
                                                       np.int32(len(tokens)))))

    def _prefix_hit(self, request: Request, target_only: bool) -> tuple[list[int], bool]:
        """The prefix cache's blocks for `request`'s prompt, and whether they bring the head's
        rows (for a row that may speculate, where the cache keeps them)."""
        if self.prefix is None:
            return [], False
        could_speculate = self.policy is not None and not target_only
        head = could_speculate and self.prefix.keeps_heads
        minimum = math.ceil(HIT_PER_REPLY_TOKEN * request.max_new_tokens) \
            if could_speculate and not head else 0
        return self.prefix.match(request.prompt, minimum, head=head), head

    def _fill_after(self, slot: jax.Array, request: Request, hit: list[int], head: bool,
                    cached: int, row_args: tuple, greedy: bool) -> None:
        """`slots.fill_cached`: `request`'s first `cached` positions copied from pool blocks
        `hit` (with the head's rows if `head`), the rest (`row_args`, `_fill`'s) prefilled."""
        blocks = np.zeros(-(-self.state.target_cache.capacity // BLOCK), np.int32)
        blocks[:len(hit)] = hit
        whole = np.zeros((1, self.capacity), np.int32)
        whole[0, :len(request.prompt)] = request.prompt
        rest, rest_length, *settings = row_args
        self.state = self.models.run(
            slots.fill_cached, self.state, slot, self.prefix.pool,  # None: paged, shared
            self.prefix.head_pool if head else None,
            *self.models.put((blocks, np.array([cached], np.int32))), rest, rest_length,
            self.models.put(whole), *settings, greedy=greedy, head=head)

    def _head_cache(self) -> kv_cache.KVCache | None:
        """The batch's EAGLE-head cache (whose rows the prefix cache keeps), if it has one."""
        drafter = getattr(self.state, "drafter", None)
        return drafter.cache if isinstance(drafter, HeadState) else None

    def _joining(self, slot: int) -> list[int]:
        """The free slots but `slot` that queued requests fill before `slot`'s first round
        (a step that fills runs none, and the next fills on): a request arriving with others
        is prefilled by the target alone where they will share its steps, since its head
        would never be used (two clients' requests arrive in pairs; the first of each pair
        prefilled the head for nothing, BENCHMARKS.md, session 53). A paged engine short of
        blocks may keep some queued: the row then decodes plainly though it could speculate."""
        free = [i for i, live in enumerate(self.slots) if live is None and i != slot]
        return free[:len(self.queue)]

    def _target_alone(self, live: np.ndarray) -> bool:
        """Whether `auto` runs a step over the `live` slots with the target alone: a row
        left behind is live, or the active rows allow no speculation."""
        return bool(np.any(self._stale & live)) or len(
            self.policy.modes(self._active_rows(live))) == 1

    def _free(self, slot: int) -> None:
        if self.policy is not None:
            self.policy.release(self.slots[slot].request.key)
        self.slots[slot] = None
        if self.blocks is not None:
            self.blocks.release(slot)

    def _active_rows(self, live: np.ndarray) -> int:
        """Slots the loop runs: a power of two covering every live one (at most all)."""
        return min(self.num_slots, bucket(int(np.flatnonzero(live).max()) + 1, 1))

    def _advance(self, max_rounds: np.int32, mode: int | None = None) -> None:
        """Run the loop over the active rows; greedy when every live request is (the
        cheaper program). With `auto`, in the mode the policy chooses (or `mode`, which
        then teaches the policy nothing: warming up)."""
        live = self._filled()
        greedy = bool(np.all(self._temperature[live] == 0))
        rows = self._active_rows(live)
        if self.policy is None:
            self._run(None, max_rounds, greedy, rows)
            return
        if mode is not None:
            self._run(mode, max_rounds, greedy, rows)
            return
        if self._target_alone(live):
            mode, budget = TARGET_ONLY, PLAIN_WIDTH  # no speculation: not even the head's
            self._stale |= live  # catch-up (these rows decode plainly to their end)
        else:
            keys = [self.slots[i].request.key for i in np.flatnonzero(live)]
            mode, budget = self.policy.choose(keys, rows)
        # A program's first rounds link its kernels (XLA:CPU: a one-token round's first run
        # took 1.9 plain steps against 1.2 later, and `auto` went on decoding plainly on
        # that figure): one untimed round, and the next step is timed (as `generate` does).
        first = (mode, rows, greedy) not in self._ran
        self._ran.add((mode, rows, greedy))
        if first and mode != TARGET_ONLY:
            budget = 1
        watched = lambda: (self.state.forwards, self.state.accept_hist,  # noqa: E731
                           self.state.out.counts)
        before = self.models.fetch(watched())
        start = time.perf_counter()
        given = min(int(max_rounds), budget)
        counts = self._run(mode, np.int32(given), greedy, rows)
        after = self.models.fetch((*watched(), counts))
        seconds = time.perf_counter() - start
        rounds = after[1] - before[1]  # [S, depth + 1]: this step's rounds by accepted tokens
        if mode in (0, TARGET_ONLY):
            self._plain_steps += np.where(live, after[2] - before[2], 0)
        if mode == TARGET_ONLY:
            self.policy.forwards_by_mode["plain"] += int(after[0] - before[0])
            return
        per_request = {self.slots[i].request.key: (
            float((rounds[i] * np.arange(rounds.shape[1])).sum()), int(rounds[i].sum()),
            None if after[3] is None else after[3][i]) for i in np.flatnonzero(live)}
        forwards = int(after[0] - before[0])  # a step cut short by a row's end times its
        # call's dispatch more than its rounds
        timed = not first and forwards >= min(MIN_TIMED_FORWARDS, given)
        self.policy.observe(mode, rows, seconds if timed else None, forwards, per_request)

    def _run(self, mode: int | None, max_rounds: np.int32, greedy: bool, rows: int
             ) -> np.ndarray | None:
        """One compiled call over the first `rows` slots: the fixed shape (`mode` None), or
        `auto`'s mode, then compiled ahead the first time (a step's time is its run's); the
        probe's counts ([S,C]), else None."""
        fn, models, static = self._program(mode, greedy, rows)
        self._sync_tables()
        sampling = SamplingParams(self._temperature, self._top_k, self._top_p)
        args = (self.state, *self.models.put((sampling, self._max_new, self._stop_table,
                                              max_rounds)))
        if self.policy is not None and (mode, rows, greedy) not in self._compiled:
            models.compile(fn, *args, **static)
            self._compiled.add((mode, rows, greedy))
        result = models.run(fn, *args, **static)
        if fn is slots.advance_probe:
            self.state, counts = result
            return counts
        self.state = result
        return None

    def _program(self, mode: int | None, greedy: bool, rows: int
                 ) -> tuple[Callable, Bundle, dict[str, Any]]:
        """The compiled function of a `_run`, the loop and weights it runs and its static
        arguments: the fixed shape's `advance` (`mode` None), or `auto`'s mode."""
        static = dict(greedy=greedy, rows=rows)
        if mode is None:
            return slots.advance, self.models, static
        if mode == TARGET_ONLY:
            return slots.advance_target, self.models, static
        spec = self.policy.plan.modes[mode]
        if spec is None:  # plain steps that keep the head caught up
            return slots.advance_plain_segment, self.models, dict(width=PLAIN_WIDTH, **static)
        if mode == len(self.policy.plan.modes) - 1:
            return slots.advance_probe, self.models, dict(sizes=self.policy.plan.sizes,
                                                          long_copy=self.policy.plan.long_copy,
                                                          **static)
        return slots.advance, self.models.with_spec(spec), static

    def _filled(self) -> np.ndarray:
        return np.array([s is not None for s in self.slots])

    def _finish(self) -> np.ndarray:
        return self.models.fetch(self.state.out.finish)

    def _collect(self) -> list[Update]:
        """Updates for the slots with unreported tokens or a new finish; frees finished slots."""
        out = self.state.out
        hist = getattr(self.state, "accept_hist", None)
        head = self._head_cache()
        asked = any(s is not None and s.request.logprobs is not None for s in self.slots)
        tokens, counts, finish, hist, cached, head_rows, kept = self.models.fetch(
            (out.tokens, out.counts, out.finish, hist, self.state.target_cache.lengths,
             None if head is None else head.lengths, out.logprobs if asked else None))
        rounds = hist.sum(axis=1) + self._plain_steps if hist is not None else counts - 1
        updates = []
        for i, live in enumerate(self.slots):
            if live is None:
                continue
            ended = finish[i] != FINISH_NONE
            if counts[i] == live.reported and not ended:
                continue
            request = live.request
            entries = None if request.logprobs is None else row_logprobs(
                tokens[i], kept.chosen[i], kept.top_ids[i], kept.top[i], live.reported,
                int(counts[i]), request.logprobs)
            updates.append(Update(request.key, tokens[i, live.reported:counts[i]].tolist(),
                                  FINISH_REASONS[int(finish[i])] if ended else None,
                                  len(request.prompt), int(counts[i]), int(max(rounds[i], 0)),
                                  live.cached, entries))
            live.reported, live.rounds = int(counts[i]), int(max(rounds[i], 0))
            if ended and self._history:  # later requests' drafts search it
                remember_replies([tokens[i, :counts[i]]])
            if ended and self.prefix is not None:  # a chat's next turn starts with it
                with_head = head is not None and not self._stale[i]
                rows = min(cached[i], head_rows[i]) if with_head else cached[i]
                self.prefix.save(self.state.target_cache, i, np.concatenate(
                    [request.prompt, tokens[i, :counts[i]]])[:rows],
                    head if with_head else None)
            if ended:
                self._replies.append(int(counts[i]))
                self._free(i)
        return updates

    def run(self, requests: Sequence[Request] = ()) -> dict[Hashable, Update]:
        """Submit `requests`, decode until idle, and return each request's final update
        with all its tokens (and log-probabilities)."""
        for request in requests:
            self.submit(request)
        tokens: dict[Hashable, list[int]] = collections.defaultdict(list)
        logprobs: dict[Hashable, list[TokenLogprob]] = collections.defaultdict(list)
        finished = {}
        while not self.idle:
            for update in self.step():
                tokens[update.key].extend(update.token_ids)
                logprobs[update.key].extend(update.logprobs or [])
                if update.finish_reason is not None:
                    finished[update.key] = dataclasses.replace(
                        update, token_ids=tokens[update.key],
                        logprobs=None if update.logprobs is None else logprobs[update.key])
        return finished
