"""`auto` in the serving engine: each engine step's mode (plain decoding, a tree, the probe)
chosen from the live requests' own acceptance and what a round costs at the batch's size.

The modes and the rules are `eaglejax.decoding.autotune`'s (`AutoPlan`, `AutoPolicy`): expected
tokens per second of a mode is the mean acceptance length of the requests it runs over
the cost of a round, and speculation must beat plain decoding by the margin. What differs:

- Acceptance is kept per request (a decayed mean per mode, as `autotune.learn` keeps it),
  from the rows of the steps it ran in; a step's choice uses the mean over the requests
  in the batch, so a code request joining a chat batch pulls the choice its way. A new
  request starts from what finished requests showed (weighed as `PRIOR_ROUNDS` rounds).
- Costs are kept per number of active rows: a round of 8 rows verifies 8 trees, and on a
  CPU that costs more than 8 plain steps return once the batch is large, so the same
  requests decode plainly at high load and speculate at low load.
- Rows of one step share its mode: the verify forward's cost is set by the batch's widest
  tree (rows are padded to it), so a row given a smaller tree or none would save nothing.
- On a CPU, a step speculates only while its verify block (active rows x probe nodes)
  fits the native kernels' `few_row_matmul.MAX_ROWS` (16: one row with the 16-node probe);
  larger steps run the target alone (`Engine`: not even the head's catch-up), and the
  requests in them decode plainly to their end. Past that block XLA's dot verifies at
  several times the cost per row (the probe's round at 4 rows measured 7.2 plain steps
  of 4 rows, BENCHMARKS.md), and each (mode, rows, greedy) program costs compile time and
  memory maps (a 32-slot server compiling every mode for every row count ran out of them
  in LLVM).

Measured (BENCHMARKS.md, 2-core Intel Xeon, SmolLM2 with its shipped EAGLE-3 head, 32
slots, MT-bench): as served, the head's acceptance never beat plain decoding by the margin,
so after its probes `auto` decoded plainly: 0.93-0.97x the plain server with one client,
within this host's noise of it with 2-32 (the target alone). Pass a `SpecConfig` (`serve
--tree ...`) to force a shape. On a 2-core AMD EPYC (session 34, the file's blocks): the
engine with one-token rounds fixed decoded at 1.10x the plain engine with one request and
1.01x with two (4 verify rows against a 2-row step: no gain for this head to take, so 2
rows still decode plainly); `auto` at one row 1.04x once its steps ran 16 rounds.

What a batch size learnt (costs, the probe interval) is kept on disk as `generate`'s `auto`
keeps it (`autotune.recall`/`remember`, keyed by the batch size: batch 1 is shared with
`generate`). Unlike `generate`, one process serving many requests learns each cost once.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from eaglejax.decoding.autotune import (
    PLAIN_WIDTH,
    PRIOR_ROUNDS,
    AutoPlan,
    AutoPolicy,
    Knowledge,
    learn,
    recall,
    remember,
)
from eaglejax.native import few_row_matmul
from eaglejax.target import Target

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft

REMEMBER_EVERY_S = 10.0  # at most one write of what was learnt to disk per this interval
# Rounds per speculative engine step (arriving requests join between steps): as many as the
# plain engine's steps per call (`Engine.rounds_per_call`), over which a call's dispatch and
# the host's reading of its counters spread. With 4, auto's one-token rounds measured 1.53
# plain steps each and it decoded plainly at 0.79x the plain engine; with 16, 1.0 and 1.04x
# (one client, SmolLM2's blocks and shipped head, one process; BENCHMARKS.md, session 34).
STEP_ROUNDS = 16


class ShapePolicy:
    """Per engine step: `choose` a mode for the live requests and the number of active rows;
    `observe` what the step did; `admit`/`release` requests as they come and go."""

    def __init__(self, target: Target, draft: "Draft", plan: AutoPlan, platform: str):
        self.target, self.draft, self.plan = target, draft, plan
        self.max_speculative_rows = max(1, few_row_matmul.MAX_ROWS // plan.probe.num_nodes) \
            if platform == "cpu" else None
        self.by_rows: dict[int, AutoPolicy] = {}
        first = recall(target, draft, 1, plan)  # what generate() or an earlier server learnt
        self.prior = Knowledge(first.accepted, first.rounds)
        _limit(self.prior, PRIOR_ROUNDS)
        self.requests: dict[Hashable, Knowledge] = {}
        self.forwards_by_mode: collections.Counter[str] = collections.Counter()
        self._remembered = time.monotonic()

    def admit(self, key: Hashable) -> None:
        """A new request: its acceptance starts from the prior."""
        self.requests[key] = Knowledge(dict(self.prior.accepted), dict(self.prior.rounds))

    def release(self, key: Hashable) -> None:
        """A request ended: what it showed joins the prior of the requests to come."""
        knowledge = self.requests.pop(key, None)
        if knowledge is None:
            return
        for name, rounds in knowledge.rounds.items():
            self.prior.rounds[name] = self.prior.rounds.get(name, 0.0) + rounds
            self.prior.accepted[name] = self.prior.accepted.get(name, 0.0) + \
                knowledge.accepted[name]
        _limit(self.prior, PRIOR_ROUNDS)
        if time.monotonic() - self._remembered >= REMEMBER_EVERY_S:
            self.remember()

    def policy(self, rows: int) -> AutoPolicy:
        """The cost model and probe schedule of batches of `rows` active rows."""
        if rows not in self.by_rows:
            self.by_rows[rows] = AutoPolicy(  # each new request probes (`choose`), not
                self.plan, recall(self.target, self.draft, rows, self.plan),  # a batch size
                opening_probe=False, spec_rounds=STEP_ROUNDS, segment_s=0,
                evidence_rounds=0)  # its acceptance: a mean over requests, one each
        return self.by_rows[rows]

    def modes(self, rows: int) -> range:
        """The modes a step of `rows` active rows may run (plain decoding only past
        `max_speculative_rows`)."""
        limit = self.max_speculative_rows
        return range(1 if limit is not None and rows > limit else len(self.plan.modes))

    def choose(self, keys: list[Hashable], rows: int) -> tuple[int, int]:
        """The mode (index into `plan.modes`) of the next step over the requests `keys` in
        `rows` active rows, and the target forwards it may run."""
        policy = self.policy(rows)
        if len(self.modes(rows)) == 1:
            return 0, PLAIN_WIDTH  # nothing to compare plain decoding with
        policy.use_acceptance(*self._mean_acceptance(keys))
        mode = policy.next_mode()
        return mode, policy.segment_rounds(mode)

    def _mean_acceptance(self, keys: list[Hashable]) -> tuple[dict[str, float],
                                                               dict[str, float]]:
        """Per mode name: the sum over `keys` of each request's mean accepted draft tokens
        per round, and how many requests have one (their ratio is the mean of means)."""
        accepted: dict[str, float] = collections.defaultdict(float)
        counted: dict[str, float] = collections.defaultdict(float)
        for key in keys:
            knowledge = self.requests[key]
            for name, rounds in knowledge.rounds.items():
                if rounds > 0:
                    accepted[name] += knowledge.accepted[name] / rounds
                    counted[name] += 1.0
        return accepted, counted

    def observe(self, mode: int, rows: int, seconds: float | None, forwards: int,
                per_request: dict[Hashable, tuple[float, int, np.ndarray | None]]) -> None:
        """A step of `mode` over `rows` active rows ran `forwards` target forwards in
        `seconds` (None: not a measure of its cost, its program's first run); per request:
        accepted draft tokens, its row-rounds and (a probe) its per-column counts."""
        if forwards <= 0:
            return
        self.forwards_by_mode[self.plan.name(mode)] += forwards
        for key, (accepted, row_rounds, counts) in per_request.items():
            learn(self.requests[key], self.plan, mode, forwards, accepted, row_rounds, counts)
        policy = self.policy(rows)
        policy.use_acceptance(*self._mean_acceptance(list(per_request)))
        policy.observe(mode, seconds, forwards, 0.0, 0)  # its cost; acceptance is per request

    def round_seconds(self) -> dict[tuple[str, int], float]:
        """(mode name, active rows) -> a round's measured cost (median of the recent ones)."""
        return {(name, rows): float(np.median(list(times)))  # copies: the engine's
                for rows, policy in list(self.by_rows.items())  # thread may be writing
                for name, times in list(policy.knowledge.round_s.items()) if times}

    def remember(self) -> None:
        """Keep what each batch size learnt for the next server or `generate` call."""
        for rows, policy in self.by_rows.items():
            remember(self.target, self.draft, rows, self.plan, policy.knowledge)
        self._remembered = time.monotonic()


def _limit(knowledge: Knowledge, rounds: float) -> None:
    """Scale each mode's acceptance so it weighs at most `rounds` row-rounds."""
    for name in knowledge.rounds:
        scale = min(1.0, rounds / max(knowledge.rounds[name], 1e-9))
        knowledge.rounds[name] *= scale
        knowledge.accepted[name] *= scale
