"""How many MT-bench requests a serving engine runs at once in a fixed KV memory: slots of
`--capacity` positions against a paged KV cache of the same positions (issue 32, bar (a)).

    python benchmarks/bench_paged_capacity.py [--kv-slots 32] [--capacity 1024]
        [--num-slots 64 128 192] [--num-requests 160] [--max-tokens 64]
        [--weight-dtype auto | float32] [--json OUT]

The slot engine has `--kv-slots` slots of `--capacity` tokens; each paged engine has a pool
of the same positions (`kv_slots * capacity`, `Engine(kv_tokens=...)`) and `--num-slots`
rows. All requests (MT-bench first turns, every category in turn, repeated to
`--num-requests`, chat template, greedy, EOS honoured) are submitted at once; each engine
runs them to the end after a warm-up run of the same requests cut to 8 tokens (which compiles
every prompt bucket and row count the run meets), reporting the most
requests running at once (and blocks in use), preemptions, wall time, output tokens/s and
each request's time to its first token (p50, p99: from the common submission, so a burst's
prefills queue). Every engine's replies must equal the slot engine's (checked).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

import eaglejax
from eaglejax.datasets import interleave_categories, mt_bench_questions
from eaglejax.hardware import machine_report
from eaglejax.serving.engine import Engine, Request

MODEL = "smollm2-135m-instruct"


def requests(target: eaglejax.Target, count: int, max_tokens: int) -> list[Request]:
    """`count` MT-bench first turns (categories interleaved, repeated as needed)."""
    questions = interleave_categories(mt_bench_questions())
    prompts = [target.tokenizer.render_prompt(q.prompt, chat=True) for q in questions]
    return [Request(i, prompts[i % len(prompts)], max_tokens) for i in range(count)]


def run(engine: Engine, batch: list[Request]) -> dict:
    """Run `batch` to the end on `engine`: peak running requests, preemptions, seconds,
    tokens per second, first-token times and every reply's tokens."""
    for request in batch:
        engine.submit(request)
    replies: dict = {r.key: [] for r in batch}
    first: dict = {}
    peak, peak_blocks, preempted = 0, 0, engine.preemptions
    start = time.perf_counter()
    while not engine.idle:
        for update in engine.step():
            replies[update.key].extend(update.token_ids)
            first.setdefault(update.key, time.perf_counter() - start)
        peak = max(peak, engine.num_running)
        peak_blocks = max(peak_blocks, 0 if engine.blocks is None else engine.blocks.used)
    seconds = time.perf_counter() - start
    tokens = sum(map(len, replies.values()))
    return dict(peak_running=peak, peak_blocks_used=peak_blocks,
                preemptions=engine.preemptions - preempted,
                seconds=round(seconds, 2), tokens=tokens,
                tokens_per_s=round(tokens / seconds, 1),
                ttft_s_p50=round(float(np.percentile(list(first.values()), 50)), 2),
                ttft_s_p99=round(float(np.percentile(list(first.values()), 99)), 2),
                replies=replies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-slots", type=int, default=32)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--num-slots", type=int, nargs="+", default=[64, 128, 192])
    parser.add_argument("--num-requests", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--weight-dtype", default="auto")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    target = eaglejax.load_target(MODEL, weight_dtype=args.weight_dtype)
    batch = requests(target, args.num_requests, args.max_tokens)
    kv_tokens = args.kv_slots * args.capacity
    engines = [(f"slots {args.kv_slots} x {args.capacity}",
                Engine(target, num_slots=args.kv_slots, capacity=args.capacity,
                       prefix_cache_tokens=0))]
    engines += [(f"paged {kv_tokens} positions, {n} rows",
                 Engine(target, num_slots=n, capacity=args.capacity, kv_tokens=kv_tokens,
                        prefix_cache_tokens=0)) for n in args.num_slots]
    results = []
    for name, engine in engines:
        run(engine, [dataclasses.replace(r, max_new_tokens=8) for r in batch])  # compiles
        result = run(engine, batch)
        result["engine"] = name
        results.append(result)
        print(f"{name}: {result['peak_running']} running at most, {result['preemptions']} "
              f"preemptions, {result['tokens_per_s']} tok/s ({result['seconds']} s), first "
              f"token p50 {result['ttft_s_p50']} s, p99 {result['ttft_s_p99']} s",
              flush=True)
    want = results[0]["replies"]
    for result in results[1:]:
        same = sum(result["replies"][k] == want[k] for k in want)
        print(f"{result['engine']}: {same}/{len(want)} replies equal the slot engine's")
        result["equal_replies"] = same
    if args.json:
        for result in results:
            del result["replies"]
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine_report(), args=vars(args), results=results), f,
                      indent=1)


if __name__ == "__main__":
    main()
