"""The server's Prometheus metrics (`/metrics`), in a registry of its own."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from eaglejax.serving.engine import Engine, Update
from eaglejax.serving.prefix_cache import PrefixCache
from eaglejax.serving.shape_policy import ShapePolicy

RATE_WINDOW_S = 10.0


class ServingMetrics:
    """Queue depth, running rows, generated tokens (and tokens/s over the last
    RATE_WINDOW_S seconds), acceptance length and time to first token per request, and
    requests by outcome; with `auto` (`policy`), target forwards by mode (the shape mix) and
    each mode's measured round cost by active rows; with `round_splits` (the engine's
    `profile_rounds`), each shape's round phase by phase; with `prefix` (the engine's prefix
    cache), prompt tokens looked up and found cached, and blocks in use; with `paged` (an
    engine with a paged KV cache), its blocks used and free and the preemptions so far."""

    def __init__(self, policy: ShapePolicy | None = None,
                 round_splits: Sequence[dict[str, Any]] = (),
                 prefix: PrefixCache | None = None, paged: Engine | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        if policy is not None:
            r.register(_ShapeMix(policy))
        if prefix is not None:
            r.register(_PrefixCacheUse(prefix))
        if paged is not None:
            r.register(_KVBlocks(paged))
        if round_splits:
            r.register(_RoundSplits(round_splits))
        self._queued = Gauge("eaglejax_queue_depth", "requests waiting for a slot",
                             registry=r)
        self._running = Gauge("eaglejax_running_rows", "requests decoding in a slot",
                              registry=r)
        self._tokens = Counter("eaglejax_generated_tokens", "tokens generated", registry=r)
        Gauge("eaglejax_tokens_per_second",
              f"tokens generated per second over the last {RATE_WINDOW_S:g} s",
              registry=r).set_function(self._rate)
        self._acceptance = Histogram(
            "eaglejax_acceptance_length", "a request's tokens per target forward (verification "
            "round) after its first token; 1 without speculation",
            buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0), registry=r)
        self._ttft = Histogram(
            "eaglejax_time_to_first_token_seconds", "from a request's arrival to its first "
            "token", buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self._requests = Counter("eaglejax_requests", "requests by outcome: stop, length, "
                                 "cancelled (the client left), rejected (4xx), error (5xx)",
                                 ["outcome"], registry=r)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()  # the engine thread appends, scrapes read

    def observe_step(self, updates: list[Update], queued: int, running: int) -> None:
        """After each round of the engine thread's loop."""
        self._queued.set(queued)
        self._running.set(running)
        tokens = sum(len(u.token_ids) for u in updates)
        if tokens:
            self._tokens.inc(tokens)
            with self._lock:
                self._recent.append((time.monotonic(), tokens))

    def _rate(self) -> float:
        start = time.monotonic() - RATE_WINDOW_S
        with self._lock:
            while self._recent and self._recent[0][0] < start:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_finished(self, outcome: str, acceptance_length: float | None) -> None:
        """A request that ran: its outcome ("stop", "length", "cancelled", "error") and,
        when it had a verification round, its acceptance length."""
        self._requests.labels(outcome).inc()
        if acceptance_length is not None:
            self._acceptance.observe(acceptance_length)

    def observe_rejected(self, status: int) -> None:
        self._requests.labels("rejected" if status < 500 else "error").inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ShapeMix:
    """A collector reading `auto`'s statistics at each scrape (the engine thread writes
    them; copies are taken under the GIL)."""

    def __init__(self, policy: ShapePolicy):
        self.policy = policy

    def collect(self):
        forwards = CounterMetricFamily(
            "eaglejax_target_forwards", "target forwards (decode steps, verification rounds) "
            "by the mode `auto` ran them in", labels=["mode"])
        for mode, n in dict(self.policy.forwards_by_mode).items():
            forwards.add_metric([mode], n)
        yield forwards
        cost = GaugeMetricFamily(
            "eaglejax_round_seconds", "a target forward's measured cost by mode and active "
            "rows (plain: a step with the head's catch-up spread over it; else a round)",
            labels=["mode", "rows"])
        for (mode, rows), seconds in self.policy.round_seconds().items():
            cost.add_metric([mode, str(rows)], seconds)
        yield cost


class _PrefixCacheUse:
    """The prefix cache's counters, read at each scrape."""

    def __init__(self, prefix: PrefixCache):
        self.prefix = prefix

    def collect(self):
        prompt = CounterMetricFamily("eaglejax_prefix_cache_prompt_tokens", "prompt tokens of "
                                     "the requests looked up in the prefix cache")
        prompt.add_metric([], self.prefix.prompt_tokens)
        yield prompt
        hits = CounterMetricFamily("eaglejax_prefix_cache_hit_tokens", "prompt tokens found "
                                   "in the prefix cache (copied, not prefilled)")
        hits.add_metric([], self.prefix.hit_tokens)
        yield hits
        used = GaugeMetricFamily("eaglejax_prefix_cache_blocks_used", "blocks of the prefix "
                                 f"cache in use, of {self.prefix.blocks}")
        used.add_metric([], len(self.prefix.index))
        yield used


class _KVBlocks:
    """A paged engine's KV blocks and preemptions, read at each scrape."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        blocks = self.engine.blocks
        for name, value in (("used", blocks.used), ("free", blocks.free)):
            gauge = GaugeMetricFamily(f"eaglejax_kv_blocks_{name}", f"blocks of the paged KV "
                                      f"cache {name}, of {blocks.blocks} of {blocks.block_size} "
                                      f"positions")
            gauge.add_metric([], value)
            yield gauge
        preempted = CounterMetricFamily("eaglejax_preemptions", "running requests preempted "
                                        "for want of KV blocks (resumed later)")
        preempted.add_metric([], self.engine.preemptions)
        yield preempted


class _RoundSplits:
    """Each speculative shape's round, phase by phase (`round_split`'s figures, measured
    once at start-up)."""

    def __init__(self, splits: Sequence[dict[str, Any]]):
        self.splits = list(splits)

    def collect(self):
        seconds = GaugeMetricFamily(
            "eaglejax_round_phase_seconds", "a speculative round's time by phase (draft, "
            "verify, accept_commit, catch_up, other), measured at start-up in the compiled "
            "loop (batch 1, greedy)", labels=["mode", "phase"])
        steps = GaugeMetricFamily(
            "eaglejax_round_phase_plain_steps", "the same in plain decode steps measured "
            "beside it", labels=["mode", "phase"])
        for split in self.splits:
            for phase, ms in split["phases_ms"].items():
                seconds.add_metric([split["speculative"], phase], ms / 1e3)
                steps.add_metric([split["speculative"], phase],
                                 split["phases_in_plain_steps"][phase])
        yield seconds
        yield steps
