"""`speculative="auto"`: pick the dynamic tree size (with or without a context-lookup
branch) with the best expected tokens/s, or plain decoding when nothing is expected to
beat it.

As the reference's `total_token=-1`, the target's forward is timed at a few node counts
(batch and context as in the request). The acceptance each candidate would reach is
measured, not modelled: one greedy calibration run drafts the largest tree with a lookup
branch of `LOOKUP` tokens grafted and records, every round, how many draft tokens each
candidate would have accepted (exact, `decoding.calibration`): the tree `total_tokens=s`,
and the same tree with a branch of n = 1..LOOKUP copied tokens in place of its n weakest
nodes (`with_lookup(n, replaces=True)`: same node count, so same verify cost). Expected
tokens/s for a candidate of s nodes is AL / (draft_ms + verify_ms(s)), draft_ms being the
fastest calibration round time minus the calibration tree's verify time (lookup
bookkeeping included). Plain decoding competes
as size 1: AL 1, one single-token forward a token (what a plain step costs; see
BENCHMARKS.md). Timings are noisy on a shared machine: a size's verify time is taken as at
least that of every smaller size, and speculation must be expected to beat plain decoding
by `MARGIN` to be chosen. What a verify of n nodes costs is a property of the device, the
target and the cache size, not of the prompt: it is timed once per target, batch size,
cache capacity (prompts and outputs bucketed to multiples of 128 tokens) and n in a process,
so a prompt of another length calibrates only the head's acceptance.

Choices are remembered per process and on disk (`<eaglejax cache>/autotune.json`, keyed by
the device, the versions, the target's and the head's contents, the batch size and the
bucketed lengths), so a second `eaglejax generate --auto-tree` does not calibrate again.
`EAGLEJAX_AUTOTUNE_CACHE=0` keeps choices in memory only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from typing import TYPE_CHECKING

import jax
import numpy as np

from eaglejax import hardware, native
from eaglejax.compilation_cache import cache_root, switched_on
from eaglejax.decoding.batch import cache_capacity, decode
from eaglejax.decoding.buckets import bucket
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.decoding.tree import max_nodes
from eaglejax.errors import InputError
from eaglejax.fingerprints import draft_fingerprint, target_fingerprint
from eaglejax.loading.files import write_atomically
from eaglejax.native import cache_attention, few_row_matmul
from eaglejax.target import Target
from eaglejax.timing import single_forward_ms
from eaglejax.version import __version__

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft

SIZES = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
MARGIN = 1.05  # expected speed over plain decoding below which speculating is not worth it
LOOKUP, LOOKUP_NGRAM = 4, 3  # lookup branches of 1..LOOKUP tokens are weighed
CANDIDATES = "trees, trees with lookup 1-4 replacing"  # part of the disk key: what was weighed
# On a CPU, verify blocks of up to 16 tokens run the native kernels and larger ones XLA's
# dot at several times the cost per row: the calibration tree (largest size + LOOKUP) stays
# within 16 nodes there, so the draft cost read off its round is that of the candidates.
CPU_CALIBRATION_NODES = 16


@dataclasses.dataclass
class AutoChoice:
    """The chosen configuration (None: plain decoding is faster here), its expected tokens/s
    over plain decoding's (1.0 for plain), and the candidates it was chosen from: per row
    total_tokens (1: plain decoding), lookup (branch tokens in place of the weakest nodes),
    acceptance_length, verify_ms, expected_tokens_per_s (empty when read back from disk)."""

    choice: SpecConfig | None
    expected_speedup: float
    table: list[dict[str, float]] = dataclasses.field(default_factory=list)


def choose_tree(target: Target, draft: "Draft", encoded: list[list[int]], max_new_tokens: int,
                *, calibration_tokens: int = 128, max_rows: int = 4, top_k: int | None = None,
                depth: int | None = None) -> AutoChoice:
    """Choose `total_tokens` and whether a lookup branch replaces the weakest nodes for
    `encoded` prompts (token ids) on this device, or None when plain decoding is expected to
    be faster; `top_k` and `depth` default to the device's batch-1 preset (its largest tree)."""
    batch = len(encoded)
    largest_preset = SpecConfig.preset(jax.default_backend(), 1)
    top_k = top_k or largest_preset.top_k
    depth = depth or largest_preset.depth
    most = max_nodes(top_k, depth)
    if jax.default_backend() == "cpu":
        most = min(most, CPU_CALIBRATION_NODES - LOOKUP)
    sizes = tuple(s for s in SIZES if s <= most)
    calibrated = SpecConfig.tree(top_k, depth, sizes[-1]).with_lookup(LOOKUP, LOOKUP_NGRAM)
    rows = encoded[:max_rows]
    greedy = SamplingParams.make()
    steps = min(calibration_tokens, max_new_tokens)
    runs = [decode(target, draft, rows, [0] * len(rows), greedy, steps, StopCriteria((), ()),
                   calibrated, calibration_sizes=sizes) for _ in range(3)]
    run = runs[0]  # greedy: every run drafts and accepts the same; the timings differ
    rounds = max(int(np.asarray(run.state.accept_hist).sum()), 1)
    accepted = np.asarray(run.calibration).sum(axis=0)  # per size and branch length
    round_ms = 1e3 * min(r.decode_s for r in runs) / max(int(run.state.forwards), 1)

    context = max(len(ids) for ids in encoded) + max_new_tokens // 2
    capacity = cache_capacity(max(len(ids) for ids in encoded), max_new_tokens,
                              calibrated.num_nodes)
    node_counts = (1, *sizes, calibrated.num_nodes)
    verify_ms = {n: _verify_ms(target, context, capacity, batch, n) for n in node_counts}
    for smaller, n in zip(node_counts, node_counts[1:]):  # more tokens never verify faster
        verify_ms[n] = max(verify_ms[n], verify_ms[smaller])
    draft_ms = max(round_ms - verify_ms[calibrated.num_nodes], 0.0)
    table = [{"total_tokens": 1, "lookup": 0, "acceptance_length": 1.0,
              "verify_ms": verify_ms[1], "expected_tokens_per_s": 1e3 * batch / verify_ms[1]}]
    for lookup in range(LOOKUP + 1):
        for s, acc in zip(sizes, accepted[lookup * len(sizes):(lookup + 1) * len(sizes)]):
            if s <= lookup:
                continue  # the branch would replace every node
            al = 1.0 + acc / rounds
            table.append({"total_tokens": s, "lookup": lookup, "acceptance_length": float(al),
                          "verify_ms": verify_ms[s], "expected_tokens_per_s":
                          float(1e3 * al * batch / (draft_ms + verify_ms[s]))})
    best = max(table, key=lambda row: row["expected_tokens_per_s"])
    speedup = best["expected_tokens_per_s"] / table[0]["expected_tokens_per_s"]
    if speedup < MARGIN:
        best, speedup = table[0], 1.0
    return AutoChoice(_config(top_k, depth, best), speedup, table)


_VERIFY_MS: dict[tuple, tuple[weakref.ref, float]] = {}


def _verify_ms(target: Target, context: int, capacity: int, batch: int, tokens: int) -> float:
    """A target forward of `tokens` tokens per row (`single_forward_ms`), timed once per
    target, batch, cache capacity and token count in this process."""
    key = (id(target), batch, capacity, tokens)
    known = _VERIFY_MS.get(key)
    if known is not None and known[0]() is target:
        return known[1]
    ms = single_forward_ms(target, context, capacity, batch, repeats=15, tokens=tokens)
    _VERIFY_MS[key] = (weakref.ref(target), ms)
    return ms


def _config(top_k: int, depth: int, row: dict) -> SpecConfig | None:
    """The SpecConfig a table row stands for (None: plain decoding)."""
    if int(row["total_tokens"]) <= 1:
        return None
    tree = SpecConfig.tree(top_k, depth, int(row["total_tokens"]))
    lookup = int(row["lookup"])
    return tree.with_lookup(lookup, LOOKUP_NGRAM, replaces=True) if lookup else tree


SWITCH_ENV = "EAGLEJAX_AUTOTUNE_CACHE"
CHOICES_FILE = "autotune.json"
_CHOICES: dict[tuple, AutoChoice] = {}


def _disk_key(target: Target, draft: "Draft", batch: int, prompt_bucket: int,
              new_bucket: int) -> str:
    """What a choice depends on: the machine and software that timed it, the two models'
    contents and the request's shape."""
    device = jax.devices()[0]
    kernels = native.kernels_allowed() and few_row_matmul.available() \
        and cache_attention.available()
    blob = json.dumps({
        "device": [device.platform, device.device_kind, hardware.cpu_model(),
                   hardware.cpu_cores(), jax.device_count()],
        "versions": [__version__, jax.__version__], "native": kernels,
        "candidates": CANDIDATES,
        "target": target_fingerprint(target), "draft": draft_fingerprint(draft),
        "shape": [batch, prompt_bucket, new_bucket]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _read_choices() -> dict[str, dict | None]:
    try:
        stored = json.loads((cache_root() / CHOICES_FILE).read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: choose again (and rewrite it)
    return stored if isinstance(stored, dict) else {}


def _from_disk(entry: object) -> AutoChoice:
    """A stored choice (None: plain decoding); KeyError, TypeError, ValueError or InputError
    for a malformed entry."""
    if entry is None:
        return AutoChoice(None, 1.0)
    return AutoChoice(_config(int(entry["top_k"]), int(entry["depth"]), entry),
                      float(entry["expected_speedup"]))


def _to_disk(auto: AutoChoice) -> dict | None:
    spec = auto.choice
    return None if spec is None else {
        "top_k": spec.top_k, "depth": spec.depth, "total_tokens": spec.total_tokens,
        "lookup": spec.lookup, "expected_speedup": auto.expected_speedup}


def cached_choice(target: Target, draft: "Draft", encoded: list[list[int]],
                  max_new_tokens: int) -> AutoChoice:
    """`choose_tree`, once per target, head, batch size and (bucketed) lengths on this
    machine (see the module docstring)."""

    shape = (len(encoded), bucket(max(len(ids) for ids in encoded), 16),
             bucket(max_new_tokens, 16))
    key = (id(target), id(draft), draft.source, *shape)
    if key in _CHOICES:
        return _CHOICES[key]
    persist = switched_on(SWITCH_ENV)
    disk_key = _disk_key(target, draft, *shape) if persist else None
    stored = _read_choices() if persist else {}
    if disk_key in stored:
        try:
            auto = _from_disk(stored[disk_key])
        except (KeyError, TypeError, ValueError, InputError):
            pass  # a malformed entry: choose again
        else:
            _CHOICES[key] = auto
            return auto
    auto = choose_tree(target, draft, encoded, max_new_tokens)
    _CHOICES[key] = auto
    if persist:
        stored = _read_choices()  # another process may have added choices meanwhile
        stored[disk_key] = _to_disk(auto)
        try:
            cache_root().mkdir(parents=True, exist_ok=True)
            write_atomically(cache_root() / CHOICES_FILE, json.dumps(stored, indent=1))
        except OSError:
            pass  # a read-only cache folder: the choice lives in this process only
    return auto
