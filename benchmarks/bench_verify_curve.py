"""What verifying T tokens costs: one jitted target forward of T = 1..16 tokens (output head
and argmax at every one, as verification needs) over a fixed context, in single-token
forwards; every size measured in turn, several passes, the median per size.

    python benchmarks/bench_verify_curve.py [--weight-dtype float32] [--context 200] [--json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import eaglejax
from eaglejax.hardware import machine_report
from eaglejax.timing import single_forward_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--weight-dtype", default="auto",
                        help="e.g. float32 (default: auto, as `eaglejax generate` stores it)")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    target = eaglejax.load_target(args.model, weight_dtype=args.weight_dtype)
    sizes = range(1, args.max_tokens + 1)
    capacity = -(-(args.context + args.max_tokens + 1) // 128) * 128
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for _ in range(args.passes):
        for t in sizes:
            times[t].append(single_forward_ms(target, args.context, capacity, tokens=t,
                                              repeats=10))
    ms = {t: float(np.median(v)) for t, v in times.items()}
    report = {"model": target.source, "weight_dtype": target.storage,
              "context": args.context, "machine": machine_report(),
              "forward_ms": ms, "in_single_steps": {t: ms[t] / ms[1] for t in sizes}}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['model']} ({report['weight_dtype']}), context {args.context}")
    for t in sizes:
        print(f"T={t:>2}: {ms[t]:7.2f} ms  {ms[t] / ms[1]:5.2f} single-token forwards")


if __name__ == "__main__":
    main()
