"""What one call of the serving engine's compiled loop costs: a call that runs no step (the
per-call work: taking the active rows out of the slot batch and putting them back, the
head's catch-up) and a call of 16 steps, for a plain engine and a speculative one decoding
plainly (`auto`'s plain segment and its target-alone steps), side by side.

    python benchmarks/bench_serving_step.py [--rows 8] [--slots 32] [--repeats 5] [--json]

SmolLM2-135M-Instruct (float32), `rows` live requests of 1,000 new tokens in a batch of
`slots` slots (capacity 1024), greedy; medians of `repeats` calls, the engines alternating.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import eaglejax
from eaglejax.hardware import machine_report
from eaglejax.serving.engine import TARGET_ONLY, Engine, Request

HEAD = "checkpoints/smollm2-135m-instruct-eagle3"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    target = eaglejax.load_target("smollm2-135m-instruct")
    draft = eaglejax.load_draft(HEAD, target=target)
    prompt = target.tokenizer.encode("Write a short story about a robot who learns to paint.")
    runs = {"plain engine": (Engine(target, None, num_slots=args.slots), None),
            "auto, plain segment": (Engine(target, draft, num_slots=args.slots), 0),
            "auto, target alone": (Engine(target, draft, num_slots=args.slots), TARGET_ONLY)}
    for engine, _ in runs.values():
        for i in range(args.rows):
            engine.submit(Request(i, prompt, 1000, ignore_eos=True))
        engine.step()  # the prefills

    def call(engine: Engine, mode: int | None, steps: int) -> float:
        start = time.perf_counter()
        engine._run(mode, np.int32(steps), True, args.rows)
        jax.block_until_ready(engine.state)
        return (time.perf_counter() - start) * 1e3

    times = {(name, steps): [] for name in runs for steps in (0, 16)}
    for repeat in range(args.repeats + 1):
        for name, (engine, mode) in runs.items():
            for steps in (0, 16):
                ms = call(engine, mode, steps)
                if repeat:  # the first is a warm-up (and compile)
                    times[(name, steps)].append(ms)
    report = {"machine": machine_report(bandwidth=False), "rows": args.rows,
              "slots": args.slots, "ms": {f"{name}, {steps} steps": float(np.median(v))
                                          for (name, steps), v in times.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for key, ms in report["ms"].items():
        print(f"{key:<36} {ms:8.1f} ms")


if __name__ == "__main__":
    main()
