"""`speculative="auto"`: which shape to decode the next segment with, from what this machine
measured while decoding. No calibration pass: the choice adapts as the text goes.

The modes: plain decoding, a few dynamic trees of the device's preset top_k and depth (each
with a context-lookup branch of `LOOKUP` copied tokens in place of its weakest nodes where
the n-gram matched; the branch searches the replies decoded before too, so a repeated or
edited request copies its earlier reply), and the probe: the largest tree with the branch
grafted on top. On a
CPU a head's plan also weighs a depth-1 tree of two draft tokens (the head's best two, or
its best and the context's next token where the n-gram matched: a 3-token verify costs about
one step there; on the GGUF's blocks one draft token decoded 1.36x plain on MT-bench where
the 6-node tree decoded 1.06x, BENCHMARKS.md, session 32, and two decoded 1.20-1.32x where
one decoded 1.18-1.26x, session 44). With no
draft the trees are suffix drafting's (`drafters.suffix`: what followed earlier matches of
the latest tokens, no model; they hold the lookup branch's copy already, so none is added),
and `auto` speculates where the text repeats itself. A probe
round verifies every node of the largest tree, so it counts exactly (greedy) what each
smaller tree, with and without the branch, would have accepted in that round
(`decoding.calibration`); a round of another mode counts its own acceptance. Acceptance is
kept per mode as a decayed mean (half-life `HALF_LIFE` target forwards, whatever the mode
that ran them), so it follows the text.

What a round of each mode costs is its wall time, measured on every segment the loop runs
(median of the last few; each program first ran once before, with the compiling: XLA:CPU
links a program's kernels on its first run; what a segment costs beyond its rounds, timed
then, is left out, so plain decoding's cost is its steps'); plain decoding is first timed over
`PLAIN_TIMING_STEPS` steps, so a call that knows nothing yet spends little of its time
learning what plain costs, and its cost is never guessed from the trees'; a tree not yet
run is costed by interpolating between the modes run so far in node count (a verify's cost
grows with its nodes). Expected tokens/s of a mode is acceptance length / round cost (plain
decoding: 1 / step cost); a tree displaces the one counted over the most rounds only
with its accepted tokens spread over `EVIDENCE_ROUNDS` more rounds (a few probe rounds do
not outweigh the rounds of a tree that ran), and the chosen one must beat plain by
`MARGIN`. Every call opens with a probe of its own text (acceptance varies far more from
prompt to prompt than costs do), unless the call inherits a tree as its choice with every
cost known (the tree's own rounds then measure the call's text); then the probe comes back
every `probe_every` target forwards: the interval doubles (up to `MAX_PROBE_EVERY`) each
time a probe leaves the choice as it was and falls back to `MIN_PROBE_EVERY` when it changes
it, so text that turns predictable (code, quotes, repetition) brings speculation back while
a head that never pays costs little. A probe that
leaves plain decoding the choice also has each tree whose acceptance would pay at the cost
its node count gives, and the depth-1 tree always, forget its measured cost and run again: a
cost measured once, at a busy moment, never keeps a tree out for good.

What was learnt (costs, acceptance, the probe interval) is carried to the next call with
the same target, head and batch size in the process, and on disk (`<eaglejax cache>/
autotune.json`, keyed by the device, the versions and the two models' contents):
`EAGLEJAX_AUTOTUNE_CACHE=0` keeps it in memory only. A new call starts from it with its
acceptance weighed as `PRIOR_ROUNDS` row-rounds, so each request soon speaks for itself.
To force a shape, pass a `SpecConfig` instead of "auto".

Measured (BENCHMARKS.md, 2-core Intel Xeon 6/167, SmolLM2 in bfloat16 storage with its
shipped EAGLE-3 head, 16 prompts from a cold start, first calls included): `auto` at
1.33-1.43x plain decoding on MT-bench (0.96-0.99x the best fixed tree) and 1.46x on a
Spec-Bench-style mix (0.94x), 0.96-1.02x plain on the worst prompt, never more than 0.08 s
beyond plain's time on a call (session 22). On a 2-core AMD EPYC Zen 4 (bfloat16 storage, no
tile unit: the 12-node probe), 1.31x on MT-bench (0.96x the best) and 1.37x on the mix
(0.92x), speculating in every MT-bench category (session 24); session 30, the same machine
kind, no opening probe where a tree is inherited: 1.29x on MT-bench (0.97x the best).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax import hardware, native
from eaglejax.compilation_cache import cache_root, switched_on
from eaglejax.decoding.calibration import DEPTH_ONE_SIZES, count_columns
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.speculation import draft_kind
from eaglejax.decoding.tree import max_nodes
from eaglejax.fingerprints import draft_fingerprint, target_fingerprint
from eaglejax.loading.files import write_atomically
from eaglejax.native import cache_attention, few_row_matmul
from eaglejax.target import Target
from eaglejax.version import __version__

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft

SIZES = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Expected speed over plain decoding below which speculating is not worth it: costs are
# measured in the loop and acceptance per request, so a tie goes to the faster estimate
# (bfloat16, 16 MT-bench prompts: `auto` at 0.93x the best fixed shape with 1.0, 0.91x with
# 1.05, BENCHMARKS.md).
MARGIN = 1.0
# While plain decoding is the choice, a tree never timed whose estimated speed (its cost
# interpolated in node count) is at least this share of plain's runs once to be timed: an
# interpolation between a plain step and the probe can overcharge a small tree.
EXPLORE = 0.9
LOOKUP, LOOKUP_NGRAM = 4, 3  # every mode's lookup branch
# A head's CPU plan's cheapest tree: the root and its best 2 children, or where the context
# matched `LOOKUP_NGRAM` tokens, the root and the 2 tokens that followed the match. One draft
# token (2 nodes) decoded slower in each of 11 interleaved runs (SmolLM2's blocks, a 2-core
# Zen 4, 16 prompts: MT-bench 1.18-1.26x plain against 1.20-1.32x, the mix 1.25-1.29x against
# 1.30-1.37x), and with both in the plan `auto` chose between them on noise (BENCHMARKS.md,
# session 44). A 2-token branch accepted more than a 1-token one (in place of the weaker
# child; AL 1.625 against 1.596 on MT-bench, 1.738 against 1.663 on the mix) at the same
# round cost (session 47).
DEPTH_ONE_NODES, DEPTH_ONE_LOOKUP = DEPTH_ONE_SIZES, 2
# ... whose rounds verify the root and 6 copied tokens alone where the context matched 5
# tokens or more (`SpecConfig.long_lookup`: quoted text, lists, loops). On a 2-core Zen 5, 12
# prompts interleaved: MT-bench 1.37x -> 1.44x plain, the mix 1.38x -> 1.48x (8 tokens at
# matches of 8+: 1.34x and 1.44x; BENCHMARKS.md, session 48). The probe counts its long
# copies along its own grafted branch (`AutoPlan.long_copy`).
DEPTH_ONE_LONG_COPY = (6, 5)
# On a CPU, verify blocks of up to 16 tokens run the native kernels and larger ones XLA's
# dot at several times the cost per row: the probe (largest tree + LOOKUP) stays within 16.
CPU_PROBE_NODES = 16
# Where the CPU's multiply-adds bound a verify (float32 storage, or bfloat16 without the AMX
# tile unit), 16 tokens cost 2.0-2.4 single steps (1.67 through the tile unit): the probe
# stays within 12 (tree 8 + LOOKUP). On an AMD Zen 4 the 16-node probe decoded at 0.85x
# plain as a fixed shape, the 12-node one at 1.02x, and `auto` went from 1.27x to 1.31x
# plain on MT-bench (BENCHMARKS.md, session 24).
FMA_BOUND_PROBE_NODES = 12
HALF_LIFE = 64  # target forwards after which an acceptance count weighs half
# A tree displaces the tree counted over the most rounds only with its acceptance spread
# over this many row-rounds more (accepting nothing): counted over 2-4 probe rounds, its
# accepted tokens weigh a third to a half. Without it, two probe rounds of a predictable
# stretch sent calls into deep trees that then decoded at 0.6-0.9x plain where the
# depth-1 tree ran 1.2x (SmolLM2's blocks, a 2-core Zen 4, MT-bench; BENCHMARKS.md,
# sessions 43-45).
EVIDENCE_ROUNDS = 4
PRIOR_ROUNDS = 2  # what a new call's inherited acceptance weighs, in row-rounds
MIN_PROBE_EVERY, MAX_PROBE_EVERY = 32, 512  # target forwards between probes
PROBE_ROUNDS = 2  # rounds per probe segment
SPEC_ROUNDS = 8  # rounds per segment of another speculative mode (per call: ~2-9 ms)
# ... or more (up to 4x), as many as last about this long: a segment's dispatch (SmolLM2's
# 520 arrays) and the counters read after it idle the machine ~2 ms. Where `auto` settled on
# one-token rounds (the mix, GGUF blocks, a 2-core Zen 4, one run): 8-round segments at
# 0.91x the fixed shape, 0.1 s 0.96x, 0.25 s 0.98x (BENCHMARKS.md, session 33).
SEGMENT_S = 0.25
PLAIN_WIDTH = 16  # plain steps per plain segment
PLAIN_TIMING_STEPS = 4  # steps of the plain segment that first times plain decoding
TIMINGS_KEPT = 5  # per mode, the latest round times whose median is its cost


def cpu_probe_nodes(weight_dtype: jnp.dtype | str) -> int:
    """The probe's most nodes on this CPU for matrices stored in `weight_dtype`: 16 where the
    AMX tile unit multiplies bfloat16 storage, else 12 (the multiply-adds bound the verify)."""
    tile_unit = {"amx_bf16", "amx_tile"} <= set(hardware.isa_features())
    return CPU_PROBE_NODES if tile_unit and jnp.dtype(weight_dtype) == jnp.bfloat16 \
        else FMA_BOUND_PROBE_NODES


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """The modes `auto` switches between (static: one compiled program each): `modes[0]` is
    plain decoding (None), then the candidate trees, the last is the probe; `sizes` are the
    tree sizes the probe counts."""

    modes: tuple[SpecConfig | None, ...]
    sizes: tuple[int, ...]

    @property
    def probe(self) -> SpecConfig:
        return self.modes[-1]

    @property
    def timed_early(self) -> tuple[int, ...]:
        """Trees timed as soon as plain decoding and the probe are: the depth-1 tree, whose
        round costs little more than a plain step where the probe's costs several, so that
        neither a cost interpolated between the two nor a few probe rounds' acceptance keeps
        the cheapest round from running."""
        return tuple(m for m in range(1, len(self.modes) - 1) if self.modes[m].depth == 1)

    @classmethod
    def for_device(cls, platform: str, top_k: int | None = None, depth: int | None = None,
                   *, probe_nodes: int = CPU_PROBE_NODES, method: str = "tree",
                   depth_one: bool = False, lookup_history: bool = True) -> "AutoPlan":
        """The probe is the largest tree of the batch-1 preset (within `probe_nodes` with its
        branch on a CPU), the candidates the two sizes below it (a tree of 8 nodes or fewer:
        the one below and its own size, with the branch in place of its weakest nodes);
        every tree a dynamic tree of `method` ("tree": the head's, "draft_model_tree": a
        draft model's, "dflash_tree": over a DFlash head's block; "suffix": suffix
        drafting's, `SpecConfig.suffix`'s matches and depth, with no branch). With
        `depth_one` (a head's trees), the first candidate is the cheapest round, a depth-1
        tree of `DEPTH_ONE_NODES`: two draft tokens, the head's best two, or where its
        n-gram matched the `DEPTH_ONE_LOOKUP` tokens that followed the match, and where it
        matched long, a copied chain alone (`DEPTH_ONE_LONG_COPY`; the probe counts the
        tree from its root's best children or its branch: `calibration.DEPTH_ONE_SIZES`). Every
        branch searches the replies decoded before too unless not `lookup_history`
        (`SpecConfig.lookup_history`: the probe counts the branch as it drafts it)."""
        preset = SpecConfig.suffix() if method == "suffix" else SpecConfig.preset(platform, 1)
        top_k, depth = top_k or preset.top_k, depth or preset.depth
        lookup = 0 if method == "suffix" else LOOKUP
        most = max_nodes(top_k, depth)
        if platform == "cpu":
            most = min(most, probe_nodes - lookup)
        sizes = tuple(s for s in SIZES if LOOKUP < s <= most)
        below = sizes[-3:-1] if sizes[-1] > 8 else sizes[-2:]
        def tree(total: int, replaces: bool) -> SpecConfig:
            spec = SpecConfig(method=method, top_k=top_k, depth=depth, total_tokens=total)
            return spec.with_lookup(lookup, LOOKUP_NGRAM, replaces, lookup_history) \
                if lookup else spec

        candidates = tuple(tree(s, replaces=True) for s in below)
        if depth_one and lookup:
            candidates = (SpecConfig(method=method, top_k=top_k, depth=1,
                                     total_tokens=DEPTH_ONE_NODES)
                          .with_lookup(DEPTH_ONE_LOOKUP, LOOKUP_NGRAM, True, lookup_history)
                          .with_long_lookup(*DEPTH_ONE_LONG_COPY),
                          *candidates)
            sizes = (DEPTH_ONE_NODES, *sizes)
        return cls((None, *candidates, tree(sizes[-1], replaces=False)), sizes)

    @classmethod
    def for_target(cls, target: Target, draft: object) -> "AutoPlan":
        """The plan for `target` and its `draft` (a head, a DFlash head or a `DraftModel`:
        their trees; None: suffix drafting's) on the default device: on a CPU, the probe's
        size follows what bounds a verify of its matrices (`cpu_probe_nodes`), and a head's
        plan weighs a depth-1 tree too (a 3-token verify costs about one step there)."""
        kind = draft_kind(draft)
        method = {"model": "draft_model_tree",
                  "head": "dflash_tree" if kind and draft.dflash else "tree",
                  None: "suffix"}[kind]
        platform = jax.default_backend()
        return cls.for_device(platform, probe_nodes=cpu_probe_nodes(target.weight_dtype),
                              method=method, depth_one=platform == "cpu" and method == "tree")

    def name(self, mode: int) -> str:
        spec = self.modes[mode]
        return "plain" if spec is None else spec.describe()

    def nodes(self, mode: int) -> int:
        spec = self.modes[mode]
        return 1 if spec is None else spec.num_nodes

    @property
    def long_copy(self) -> SpecConfig | None:
        """The candidate whose rounds verify long copies, which the probe counts in a column
        of its own (`calibration.round_counts`), if any."""
        return next((spec for spec in self.modes[1:-1] if spec.long_lookup), None)

    def count_column(self, mode: int) -> int | None:
        """The probe's counter that stands for candidate `mode` (None: plain, the probe)."""
        spec = self.modes[mode]
        if spec is None or mode == len(self.modes) - 1:
            return None
        if spec.long_lookup:  # the column after the sizes' (`calibration.round_counts`)
            return count_columns(self.probe, self.sizes)
        return spec.lookup * len(self.sizes) + self.sizes.index(spec.total_tokens)


@dataclasses.dataclass
class Knowledge:
    """What `auto` knows per mode name: decayed accepted draft tokens and row-rounds, recent
    round times (s); and the probe interval."""

    accepted: dict[str, float] = dataclasses.field(default_factory=dict)
    rounds: dict[str, float] = dataclasses.field(default_factory=dict)
    round_s: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    probe_every: int = MIN_PROBE_EVERY

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, stored: object) -> "Knowledge":
        """ValueError for anything but a stored Knowledge."""
        if not isinstance(stored, dict):
            raise ValueError("not a dict")
        known = cls(**{field.name: stored[field.name] for field in dataclasses.fields(cls)})
        numbers = [*known.accepted.values(), *known.rounds.values(),
                   *(t for times in known.round_s.values() for t in times)]
        if not all(isinstance(x, (int, float)) and x >= 0 for x in numbers) \
                or not isinstance(known.probe_every, int) or known.probe_every < 1:
            raise ValueError("malformed")
        return known


class AutoPolicy:
    """Chooses each segment's mode (index into `plan.modes`) from `knowledge`, and learns from
    what each segment did (see the module docstring)."""

    def __init__(self, plan: AutoPlan, knowledge: Knowledge, *, opening_probe: bool = True,
                 spec_rounds: int = SPEC_ROUNDS, segment_s: float = SEGMENT_S,
                 evidence_rounds: float = EVIDENCE_ROUNDS):
        """`opening_probe`: the first segment probes (a call's own text; the serving engine
        probes per request instead); `spec_rounds`: rounds per segment of a tree, or as many
        as its measured cost fits in `segment_s` seconds if more (0: exactly
        `spec_rounds`); `evidence_rounds`: see `EVIDENCE_ROUNDS` (0 where the counts are
        not row-rounds: the serving engine's means over its requests)."""
        self.plan = plan
        self.knowledge = knowledge
        self.spec_rounds = spec_rounds
        self.segment_s = segment_s
        self.evidence_rounds = evidence_rounds
        # The call starts from what earlier calls chose with all their evidence: a tree
        # counted over a few probe rounds only does not displace the one they ran (weighed
        # as `PRIOR_ROUNDS` each, the estimates alone chose, and a call locked into a tree
        # that then ran at 0.87x plain where the one before it ran 1.33x: the evidence rule
        # keeps whatever runs first; BENCHMARKS.md, session 49).
        self.best = self._best()
        for name in knowledge.rounds:  # inherited acceptance weighs PRIOR_ROUNDS at most
            scale = min(1.0, PRIOR_ROUNDS / max(knowledge.rounds[name], 1e-9))
            knowledge.rounds[name] *= scale
            knowledge.accepted[name] *= scale
        # A call's first segment probes its own text (acceptance varies from prompt to
        # prompt far more than costs vary between calls), without counting for the interval,
        # unless what it inherited chose a tree with every cost known: that tree's own
        # segments measure the call's acceptance (and hand over to plain decoding where it
        # is poor), and two probe rounds a call cost more than they told (MT-bench, bfloat16
        # on a 2-core Zen 4: 1.33-1.35x plain without, 1.24-1.25x with; BENCHMARKS.md).
        settled_on_a_tree = self.timed(0) and self.best not in (0, self.probe)
        self.opening = opening_probe and not settled_on_a_tree
        self.since_probe = knowledge.probe_every if self.opening else 0

    @property
    def probe(self) -> int:
        return len(self.plan.modes) - 1

    def timed(self, mode: int) -> bool:
        """Whether a round (plain: a step) of `mode` has a measured cost."""
        return bool(self.knowledge.round_s.get(self.plan.name(mode)))

    def acceptance_length(self, mode: int) -> float | None:
        """Expected tokens a round of `mode` yields per row (None: never measured)."""
        if self.plan.modes[mode] is None:
            return 1.0
        name = self.plan.name(mode)
        rounds = self.knowledge.rounds.get(name, 0.0)
        return None if rounds <= 0 else 1.0 + self.knowledge.accepted[name] / rounds

    def round_seconds(self, mode: int) -> float | None:
        """A round's cost: the median of its recent times, else (a tree) interpolated in node
        count between the modes timed (None: none timed, or plain decoding untimed)."""
        times = self.knowledge.round_s.get(self.plan.name(mode))
        if times:
            return float(np.median(times))
        if self.plan.modes[mode] is None:
            return None  # a plain step costs a fraction of any round: never guessed from them
        timed = sorted((self.plan.nodes(m), float(np.median(self.knowledge.round_s[name])))
                       for m in range(len(self.plan.modes))
                       if (name := self.plan.name(m)) in self.knowledge.round_s
                       and self.knowledge.round_s[name])
        if not timed:
            return None
        nodes, seconds = zip(*timed)
        if len(timed) == 1:
            return seconds[0]
        return float(np.interp(self.plan.nodes(mode), nodes, seconds))

    def expected_rates(self) -> list[float | None]:
        """Per mode, expected tokens per row per second (None: unknown)."""
        rates = []
        for mode in range(len(self.plan.modes)):
            al, seconds = self.acceptance_length(mode), self.round_seconds(mode)
            rates.append(None if al is None or not seconds else al / seconds)
        return rates

    def _evidenced_rate(self, mode: int) -> float:
        """`mode`'s expected rate with its accepted tokens spread over `evidence_rounds` more
        row-rounds."""
        name = self.plan.name(mode)
        rounds = self.knowledge.rounds[name] + self.evidence_rounds
        return (1.0 + self.knowledge.accepted[name] / rounds) / self.round_seconds(mode)

    def _best(self) -> int:
        """The fastest tree of those that may displace the tree counted over the most rounds
        (the fastest of those if several): a tree whose rate, its acceptance spread over
        `evidence_rounds` more rounds, beats that tree's; plain decoding unless it beats
        plain by `MARGIN`."""
        rates = self.expected_rates()
        plain = rates[0]
        known = [m for m in range(1, len(rates)) if rates[m] is not None]
        if not known:
            return self.probe
        rounds = {m: self.knowledge.rounds[self.plan.name(m)] for m in known}
        most = max(rounds.values())
        reference = max((m for m in known if rounds[m] >= most * (1 - 1e-9)),
                        key=lambda m: rates[m])
        best = max((m for m in known
                    if m == reference or self._evidenced_rate(m) > rates[reference]),
                   key=lambda m: rates[m])
        if plain is not None and rates[best] < MARGIN * plain:
            return 0
        return best

    def next_mode(self) -> int:
        """The mode of the next segment: what is unknown first (the probe's acceptance, then
        the costs of plain decoding, of the probe and of `plan.timed_early`), then the best,
        with the probe every `probe_every` target forwards; while plain is best, a tree
        within `EXPLORE` of it and never timed is timed."""
        if self.acceptance_length(self.probe) is None:
            return self.probe
        for mode in (0, self.probe, *self.plan.timed_early):
            if not self.timed(mode):
                return mode
        if self.best != self.probe and self.since_probe >= self.knowledge.probe_every:
            return self.probe
        if self.best == 0:
            rates = self.expected_rates()
            for mode in range(1, self.probe):
                if not self.timed(mode) and rates[mode] is not None \
                        and rates[mode] >= EXPLORE * rates[0]:
                    return mode
        return self.best

    def segment_rounds(self, mode: int) -> int:
        """Target forwards the next segment of `mode` may run: a probe runs `PROBE_ROUNDS`
        unless it is the choice, with its cost known; a timed tree at least `spec_rounds`,
        up to 4x that to fill `segment_s`."""
        if mode == 0:
            return PLAIN_WIDTH if self.timed(0) else PLAIN_TIMING_STEPS
        if mode == self.probe and (self.best != self.probe or not self.timed(mode)):
            return PROBE_ROUNDS
        if not self.timed(mode):
            return self.spec_rounds
        filled = int(self.segment_s / self.round_seconds(mode))
        return min(max(self.spec_rounds, filled), 4 * self.spec_rounds)

    def use_acceptance(self, accepted: dict[str, float], rounds: dict[str, float]) -> None:
        """Take what is known of acceptance from elsewhere (the serving engine: its live
        requests'), and choose again."""
        self.knowledge.accepted, self.knowledge.rounds = dict(accepted), dict(rounds)
        self.best = self._best()

    def observe(self, mode: int, seconds: float | None, forwards: int, accepted: float,
                row_rounds: int, counts: np.ndarray | None = None) -> None:
        """A segment of `mode` ran `forwards` target forwards in `seconds` (None: not a
        measure of its cost, e.g. its program's first run): its rows' rounds
        accepted `accepted` draft tokens in all (`row_rounds` row-rounds); a probe adds its
        per-column counts (`calibration.round_counts` summed over rows and rounds)."""
        if forwards <= 0:
            return
        informed = self.timed(0)
        if seconds is not None:
            times = self.knowledge.round_s.setdefault(self.plan.name(mode), [])
            times.append(seconds / forwards)
            del times[:-TIMINGS_KEPT]
        learn(self.knowledge, self.plan, mode, forwards, accepted, row_rounds, counts)
        if mode == self.probe:
            before, self.best = self.best, self._best()
            if self.best == 0:
                self._doubt_costs()
            if informed and not self.opening:  # a choice made with every mode costed,
                # confirmed or overturned
                self.knowledge.probe_every = MIN_PROBE_EVERY if self.best != before else min(
                    2 * self.knowledge.probe_every, MAX_PROBE_EVERY)
            self.since_probe, self.opening = 0, False
        else:
            self.best = self._best()
            self.since_probe += forwards

    def _doubt_costs(self) -> None:
        """A probe left plain decoding the choice: a tree whose acceptance would pay at the
        cost its node count gives (interpolated between the modes timed), and the plan's
        `timed_early` trees whatever their acceptance, forget their measured cost, so that
        `next_mode` times them again. A cost measured once, on a busy moment or
        another context length, would otherwise keep a tree from ever running again (the
        serving engine, its one-token rounds once measured at 1.6-2.0 plain steps and kept on
        disk: plain decoding for every later request; BENCHMARKS.md, session 34)."""
        plain = self.expected_rates()[0]
        if plain is None:
            return
        for mode in range(1, self.probe):
            name = self.plan.name(mode)
            times = self.knowledge.round_s.pop(name, None)
            if not times or mode in self.plan.timed_early:
                # the cheapest round is always timed again: interpolated between a plain
                # step and the deep probe its cost runs high (7.6 ms where it took 5.1-5.4
                # against plain's 4.7; one busy first timing at 7.0 kept a first call plain
                # for 83% of its forwards, BENCHMARKS.md, session 52)
                continue
            al, guess = self.acceptance_length(mode), self.round_seconds(mode)
            if al is None or not guess or al / guess < EXPLORE * plain:
                self.knowledge.round_s[name] = times


def learn(knowledge: Knowledge, plan: AutoPlan, mode: int, forwards: int, accepted: float,
          row_rounds: int, counts: np.ndarray | None = None) -> None:
    """Decay `knowledge`'s acceptance by `forwards` target forwards, then add a segment's:
    `accepted` draft tokens in `row_rounds` row-rounds of `mode` (nothing for plain
    decoding), and a probe's per-column `counts` for each candidate tree."""
    decay = 0.5 ** (forwards / HALF_LIFE)
    for known in knowledge.rounds:
        knowledge.rounds[known] *= decay
        knowledge.accepted[known] *= decay
    if row_rounds <= 0:
        return
    learnt = [(mode, float(accepted))] if mode else []
    if counts is not None:
        learnt += [(m, float(counts[plan.count_column(m)])) for m in range(1, len(plan.modes) - 1)]
    for m, tokens in learnt:
        name = plan.name(m)
        knowledge.accepted[name] = knowledge.accepted.get(name, 0.0) + tokens
        knowledge.rounds[name] = knowledge.rounds.get(name, 0.0) + row_rounds


SWITCH_ENV = "EAGLEJAX_AUTOTUNE_CACHE"
# Raised when what was kept on disk was measured by rules since changed (2: the serving
# engine timed its programs' first runs, which link their kernels, and kept that cost;
# 3: `generate`'s round costs leave out what a segment costs beyond its rounds).
KNOWLEDGE_RULES = 3
KNOWLEDGE_FILE = "autotune.json"
_KNOWN: dict[tuple, Knowledge] = {}


def _disk_key(target: Target, draft: "Draft | None", batch: int, plan: AutoPlan) -> str:
    """What the knowledge depends on: the machine and software that measured it, the two
    models' contents, the batch size and the modes."""
    device = jax.devices()[0]
    kernels = native.kernels_allowed() and few_row_matmul.available() \
        and cache_attention.available()
    blob = json.dumps({
        "rules": KNOWLEDGE_RULES,
        "device": [device.platform, device.device_kind, hardware.cpu_model(),
                   hardware.cpu_cores(), jax.device_count()],
        "versions": [__version__, jax.__version__], "native": kernels,
        "modes": [plan.name(m) for m in range(len(plan.modes))],
        "target": target_fingerprint(target),
        "draft": None if draft is None else draft_fingerprint(draft),
        "batch": batch}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _read_disk() -> dict:
    try:
        stored = json.loads((cache_root() / KNOWLEDGE_FILE).read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: start afresh (and rewrite it)
    return stored if isinstance(stored, dict) else {}


def _memory_key(target: Target, draft: "Draft | None", batch: int, plan: AutoPlan) -> tuple:
    return (id(target), id(draft), getattr(draft, "source", None), batch, plan)


def recall(target: Target, draft: "Draft | None", batch: int, plan: AutoPlan) -> Knowledge:
    """What earlier calls learnt for this target, head (None: no draft) and batch size (in
    this process, else on disk), or nothing yet; a malformed disk entry counts as nothing."""
    key = _memory_key(target, draft, batch, plan)
    if key not in _KNOWN:
        knowledge = Knowledge()
        if switched_on(SWITCH_ENV):
            try:
                knowledge = Knowledge.from_json(
                    _read_disk().get(_disk_key(target, draft, batch, plan)))
            except (KeyError, TypeError, ValueError):
                pass
        _KNOWN[key] = knowledge
    return Knowledge.from_json(json.loads(json.dumps(_KNOWN[key].to_json())))  # a copy


def remember(target: Target, draft: "Draft | None", batch: int, plan: AutoPlan,
             knowledge: Knowledge) -> None:
    """Keep `knowledge` for the next call (in this process, and on disk unless switched off;
    a read-only cache folder keeps it in memory only)."""
    _KNOWN[_memory_key(target, draft, batch, plan)] = knowledge
    if not switched_on(SWITCH_ENV):
        return
    stored = _read_disk()  # another process may have added entries meanwhile
    stored[_disk_key(target, draft, batch, plan)] = knowledge.to_json()
    try:
        cache_root().mkdir(parents=True, exist_ok=True)
        write_atomically(cache_root() / KNOWLEDGE_FILE, json.dumps(stored, indent=1))
    except OSError:
        pass
