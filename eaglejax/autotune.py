"""`speculative="auto"`: pick the dynamic tree size with the best expected tokens/s, or
plain decoding when no size is expected to beat it.

As the reference's `total_token=-1`, the target's forward is timed at a few node counts
(batch and context as in the request). The acceptance each size would reach is measured,
not modelled: one greedy calibration run with the largest tree records, every round, how
many draft tokens the best s-node subtree would have accepted (exact: that subtree is the
tree `total_tokens=s` would have drafted). Expected tokens/s for size s is then
AL(s) / (draft_ms + verify_ms(s)), draft_ms being the measured round time minus the
largest tree's verify time. Plain decoding competes as size 1: AL 1, one single-token
forward a token (what a plain step costs; see BENCHMARKS.md). Timings are noisy on a shared
machine: a size's verify time is taken as at least that of every smaller size, and a tree
must be expected to beat plain decoding by `MARGIN` to be chosen.

Choices are remembered per process and on disk (`<eaglejax cache>/autotune.json`, keyed by
the device, the versions, the target's and the head's contents, the batch size and the
bucketed lengths), so a second `eaglejax generate --auto-tree` does not calibrate again.
`EAGLEJAX_AUTOTUNE_CACHE=0` keeps choices in memory only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING

import jax
import numpy as np

from eaglejax import __version__, hardware, native
from eaglejax.compilation_cache import cache_root, switched_on
from eaglejax.decoding.buckets import bucket
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.errors import InputError
from eaglejax.fingerprints import draft_fingerprint, target_fingerprint
from eaglejax.loading.files import write_atomically
from eaglejax.target import Target

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft

SIZES = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
MARGIN = 1.05  # expected speed over plain decoding below which speculating is not worth it


@dataclasses.dataclass
class AutoChoice:
    """The chosen configuration (None: plain decoding is faster here) and, per candidate
    size (1: plain decoding), what it was chosen from."""

    choice: SpecConfig | None
    table: list[dict[str, float]]


def choose_tree(target: Target, draft: "Draft", encoded: list[list[int]], max_new_tokens: int,
                *, calibration_tokens: int = 32, max_rows: int = 4, top_k: int | None = None,
                depth: int | None = None) -> AutoChoice:
    """Choose `total_tokens` for `encoded` prompts (token ids) on this device, or None when
    plain decoding is expected to be faster; `top_k` and `depth` default to the device's
    batch-1 preset (its largest tree)."""
    from eaglejax.bench import single_forward_ms
    from eaglejax.generate import cache_capacity, decode

    batch = len(encoded)
    largest_preset = SpecConfig.preset(jax.default_backend(), 1)
    top_k = top_k or largest_preset.top_k
    depth = depth or largest_preset.depth
    sizes = tuple(s for s in SIZES if s <= top_k + (depth - 1) * top_k ** 2 + 1)
    largest = SpecConfig.tree(top_k, depth, sizes[-1])
    rows = encoded[:max_rows]
    greedy = SamplingParams.make()
    steps = min(calibration_tokens, max_new_tokens)
    run = None
    for _ in range(2):  # the first run compiles; the second is timed
        run = decode(target, draft, rows, [0] * len(rows), greedy, steps, StopCriteria((), ()),
                     largest, calibration_sizes=sizes)
    rounds = int(np.asarray(run.state.accept_hist).sum())
    accepted = np.asarray(run.state.size_accepted).sum(axis=0)
    round_ms = 1e3 * run.decode_s / max(int(run.state.forwards), 1)

    context = max(len(ids) for ids in encoded) + max_new_tokens // 2
    capacity = cache_capacity(max(len(ids) for ids in encoded), max_new_tokens, sizes[-1])
    verify_ms = {s: single_forward_ms(target, context, capacity, batch, repeats=5, tokens=s)
                 for s in (1, *sizes)}
    for smaller, s in zip((1, *sizes), sizes):  # more tokens never verify faster
        verify_ms[s] = max(verify_ms[s], verify_ms[smaller])
    draft_ms = max(round_ms - verify_ms[sizes[-1]], 0.0)
    table = [{"total_tokens": 1, "acceptance_length": 1.0, "verify_ms": verify_ms[1],
              "expected_tokens_per_s": 1e3 * batch / verify_ms[1]}]
    for s, acc in zip(sizes, accepted):
        al = 1.0 + acc / max(rounds, 1)
        table.append({"total_tokens": s, "acceptance_length": float(al),
                      "verify_ms": verify_ms[s], "expected_tokens_per_s":
                      1e3 * al * batch / (draft_ms + verify_ms[s])})
    best = max(table, key=lambda row: row["expected_tokens_per_s"])
    if best["expected_tokens_per_s"] < MARGIN * table[0]["expected_tokens_per_s"]:
        best = table[0]
    size = int(best["total_tokens"])
    return AutoChoice(SpecConfig.tree(top_k, depth, size) if size > 1 else None, table)


SWITCH_ENV = "EAGLEJAX_AUTOTUNE_CACHE"
CHOICES_FILE = "autotune.json"
_CHOICES: dict[tuple, SpecConfig | None] = {}


def _disk_key(target: Target, draft: "Draft", batch: int, prompt_bucket: int,
              new_bucket: int) -> str:
    """What a choice depends on: the machine and software that timed it, the two models'
    contents and the request's shape."""
    from eaglejax.native import cache_attention, few_row_matmul

    device = jax.devices()[0]
    kernels = native.kernels_allowed() and few_row_matmul.available() \
        and cache_attention.available()
    blob = json.dumps({
        "device": [device.platform, device.device_kind, hardware.cpu_model(),
                   hardware.cpu_cores(), jax.device_count()],
        "versions": [__version__, jax.__version__], "native": kernels,
        "target": target_fingerprint(target), "draft": draft_fingerprint(draft),
        "shape": [batch, prompt_bucket, new_bucket]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _read_choices() -> dict[str, dict | None]:
    try:
        stored = json.loads((cache_root() / CHOICES_FILE).read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: choose again (and rewrite it)
    return stored if isinstance(stored, dict) else {}


def _as_config(entry: object) -> SpecConfig | None:
    if not isinstance(entry, dict):
        return None
    return SpecConfig.tree(int(entry["top_k"]), int(entry["depth"]), int(entry["total_tokens"]))


def cached_choice(target: Target, draft: "Draft", encoded: list[list[int]],
                  max_new_tokens: int) -> SpecConfig | None:
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
            choice = _as_config(stored[disk_key])
        except (KeyError, TypeError, ValueError, InputError):
            pass  # a malformed entry: choose again
        else:
            _CHOICES[key] = choice
            return choice
    choice = choose_tree(target, draft, encoded, max_new_tokens).choice
    _CHOICES[key] = choice
    if persist:
        stored = _read_choices()  # another process may have added choices meanwhile
        stored[disk_key] = None if choice is None else {
            "top_k": choice.top_k, "depth": choice.depth, "total_tokens": choice.total_tokens}
        try:
            cache_root().mkdir(parents=True, exist_ok=True)
            write_atomically(cache_root() / CHOICES_FILE, json.dumps(stored, indent=1))
        except OSError:
            pass  # a read-only cache folder: the choice lives in this process only
    return choice
