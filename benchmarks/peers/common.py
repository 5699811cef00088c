"""Helpers shared by the per-engine runners. Standard library only: every runner imports this
module from its own engine's virtualenv, where eaglejax is not installed."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

# A batch's decode: the tokens each row produced after its first emission (the prefill's
# token), over the time from the batch's first emission to its last token.
BatchTiming = tuple[int, float]


def read_job(path: str) -> dict[str, Any]:
    """The job the orchestrator wrote: prompt sets, modes, batch sizes, paths."""
    return json.loads(Path(path).read_text())


def batches(prompts: list[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    """`prompts` in consecutive groups of at most `size`."""
    for i in range(0, len(prompts), size):
        yield prompts[i:i + size]


def last_line(text: str) -> str:
    """The last non-empty line of an error message or a log."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else ""


class Recorder:
    """Collects one runner's rows and rewrites its JSON output after each, so a crash
    part-way keeps what finished."""

    def __init__(self, out: str, engine: str, info: dict[str, Any]) -> None:
        self.path = Path(out)
        self.data: dict[str, Any] = {"engine": engine, "info": info, "runs": []}
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)

    def add(self, **row: Any) -> None:
        self.data["runs"].append(row)
        self.flush()
        shown = {k: v for k, v in row.items() if k != "outputs"}
        print("peer-row", json.dumps(shown), file=sys.stderr, flush=True)

    def na(self, mode: str, prompt_set: str, batch: int, reason: str) -> None:
        """A combination this engine cannot run (by design, not a failure)."""
        self.add(mode=mode, prompt_set=prompt_set, batch=batch, status="n/a", reason=reason)

    def failed(self, mode: str, prompt_set: str, batch: int, err: BaseException) -> None:
        traceback.print_exc()
        self.add(mode=mode, prompt_set=prompt_set, batch=batch, status="failed",
                 reason=last_line(f"{type(err).__name__}: {err}"))


def timed_set(run_batch: Callable[[list[list[int]]], tuple[list[list[int]], BatchTiming]],
              prompts: list[dict[str, Any]], batch: int, warmup: bool = True
              ) -> dict[str, Any]:
    """Decode every prompt in batches of `batch` with `run_batch` (token-id rows in; each
    row's new token ids and the batch's (decode tokens, decode seconds) out), after one
    untimed pass over all batches (warm-up: every shape seen once)."""
    groups = [[p["ids"] for p in group] for group in batches(prompts, batch)]
    if warmup:
        for group in groups:
            run_batch(group)
    outputs: list[list[int]] = []
    decode_tokens, decode_s = 0, 0.0
    start = time.perf_counter()
    for group in groups:
        rows, (n, s) = run_batch(group)
        outputs += rows
        decode_tokens += n
        decode_s += s
    return {"decode_tokens": decode_tokens, "decode_s": decode_s,
            "tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
            "wall_s": time.perf_counter() - start, "outputs": outputs}


class EmissionClock:
    """Timestamps a batch's token emissions: `emit(row, n)` when row `row` receives `n`
    more tokens. The decode is everything after each row's first emission."""

    def __init__(self, rows: int) -> None:
        self.first_t: float | None = None
        self.last_t = 0.0
        self.first_n = [0] * rows
        self.total = [0] * rows

    def emit(self, row: int, n: int) -> None:
        now = time.perf_counter()
        if self.first_t is None:
            self.first_t = now
        if self.total[row] == 0:
            self.first_n[row] = n
        self.total[row] += n
        self.last_t = now

    def timing(self) -> BatchTiming:
        tokens = sum(t - f for t, f in zip(self.total, self.first_n))
        return tokens, self.last_t - (self.first_t or self.last_t)
