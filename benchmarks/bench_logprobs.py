"""What log-probabilities cost the serving engine, in one process: a plain engine that keeps
none, and one that keeps up to 20 per token (`serve`'s default) serving requests that ask for
none, for the token's own and for 5 or 20 alternatives; the variants alternating repeat by
repeat (this machine is shared and noisy: compare within one run). Decode only, as
`bench_engine_shapes.py` times it.

    python benchmarks/bench_logprobs.py [--rows 1] [--prompts 8] [--max-new-tokens 64]
        [--repeats 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import eaglejax
from eaglejax.decoding.output import MAX_TOP_LOGPROBS
from eaglejax.hardware import machine_report
from eaglejax.serving.engine import Engine, Request
from eaglejax.training.pipeline import mt_bench_prompts

# name -> (the engine's max_logprobs, what each request asks)
VARIANTS = {"keeps none": (None, None), "keeps 20, none asked": (MAX_TOP_LOGPROBS, None),
            "asks 0": (MAX_TOP_LOGPROBS, 0), "asks 5": (MAX_TOP_LOGPROBS, 5),
            "asks 20": (MAX_TOP_LOGPROBS, 20)}


def decode(engine: Engine, prompts: list[list[int]], rows: int, max_new_tokens: int,
           logprobs: int | None, tag: object) -> float:
    """Tokens per second after each batch's prefill."""
    seconds, tokens = 0.0, 0
    for i in range(0, len(prompts), rows):
        for j, prompt in enumerate(prompts[i:i + rows]):
            engine.submit(Request((tag, i + j), prompt, max_new_tokens, ignore_eos=True,
                                  logprobs=logprobs))
        engine.step()  # the prefills
        start = time.perf_counter()
        while not engine.idle:
            tokens += sum(u.generated - 1 for u in engine.step() if u.finish_reason)
        seconds += time.perf_counter() - start
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    target = eaglejax.load_target("smollm2-135m-instruct", weight_dtype="auto")
    prompts = [target.tokenizer.render_prompt(text, chat=True)
               for text in mt_bench_prompts(args.prompts)]
    engines = {kept: Engine(target, None, num_slots=16, max_logprobs=kept)
               for kept in {kept for kept, _ in VARIANTS.values()}}
    for engine in engines.values():
        engine.warmup(progress=False)
    for name, (kept, asked) in VARIANTS.items():  # every program run once
        decode(engines[kept], prompts[:args.rows], args.rows, 4, asked, ("warm", name))
    runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for repeat in range(args.repeats):
        order = list(VARIANTS) if repeat % 2 == 0 else list(VARIANTS)[::-1]
        for name in order:
            kept, asked = VARIANTS[name]
            runs[name].append(decode(engines[kept], prompts, args.rows, args.max_new_tokens,
                                     asked, (repeat, name)))
    base = float(np.median(runs["keeps none"]))
    report = {"machine": machine_report(bandwidth=False), "rows": args.rows,
              "storage": target.storage,
              "results": {name: {"tokens_per_s": rates,
                                 "median_over_keeping_none": float(np.median(rates)) / base}
                          for name, rates in runs.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['machine']['cpu']}, {target.storage}, {args.rows} row(s), decode tok/s:")
    for name, result in report["results"].items():
        rates = ", ".join(f"{r:.1f}" for r in result["tokens_per_s"])
        print(f"  {name:<22} [{rates}]  {result['median_over_keeping_none']:.3f}x")


if __name__ == "__main__":
    main()
