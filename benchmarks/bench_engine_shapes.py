"""The serving engine's decode speed per shape, in one process: a plain engine, engines with a
fixed speculative shape and an `auto` engine, the same requests `--rows` at a time, the
engines alternating repeat by repeat (this machine is shared and noisy: compare within one
run). Decode only: each batch's prefill step is not timed, so the figures are what a round
costs against a step, without the HTTP server around the engine (`load_test.py` has that).

    python benchmarks/bench_engine_shapes.py [--rows 1] [--prompts 8] [--max-new-tokens 64]
        [--shapes one-token auto] [--step-rounds 16] [--repeats 4] [--json]

`--shapes`: "one-token" (the head's best token or the context's next), "depth-one" (`auto`'s
cheapest mode on a CPU, `AutoPlan`'s depth-1 tree: the head's best two, or the context's next
two, or where the context matched long a copied chain), "tree:K,D,N",
"chain:K", "auto" (with `--step-rounds` rounds per speculative engine step).
SmolLM2-135M-Instruct in the storage `auto` picks, its shipped EAGLE-3 head, MT-bench first
turns (categories interleaved), greedy, EOS ignored; as many slots as `--rows` (a power of
two), no prefix cache.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import eaglejax
from eaglejax.datasets import interleave_categories, mt_bench_questions
from eaglejax.decoding.autotune import AutoPlan
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.hardware import machine_report
from eaglejax.serving import shape_policy
from eaglejax.serving.engine import Engine, Request

# The engines decode the same requests in turn: none may copy another's replies from the
# history of earlier replies that `auto`'s lookup branches search (`decoding.suffix_history`).
os.environ["EAGLEJAX_REPLY_HISTORY"] = "0"

HEAD = "checkpoints/smollm2-135m-instruct-eagle3"
ONE_TOKEN = SpecConfig(method="tree", top_k=4, depth=1, total_tokens=2).with_lookup(1, 3, True)
DEPTH_ONE = next(spec for spec in AutoPlan.for_device("cpu", depth_one=True).modes[1:]
                 if spec.depth == 1)


def shape(name: str) -> SpecConfig | str:
    named = {"auto": "auto", "one-token": ONE_TOKEN, "depth-one": DEPTH_ONE}
    if name in named:
        return named[name]
    kind, _, numbers = name.partition(":")
    values = [int(x) for x in numbers.split(",")]
    return SpecConfig.tree(*values) if kind == "tree" else SpecConfig.chain(*values)


def decode(engine: Engine, prompts: list[list[int]], rows: int, max_new_tokens: int,
           tag: int) -> tuple[float, float]:
    """Tokens per second after each batch's prefill, and tokens per target forward."""
    seconds, tokens, rounds = 0.0, 0, 0
    for i in range(0, len(prompts), rows):
        for j, prompt in enumerate(prompts[i:i + rows]):
            engine.submit(Request((tag, i + j), prompt, max_new_tokens, ignore_eos=True))
        engine.step()  # the prefills
        start = time.perf_counter()
        while not engine.idle:
            for update in engine.step():
                if update.finish_reason is not None:
                    tokens += update.generated - 1
                    rounds += update.rounds
        seconds += time.perf_counter() - start
    return tokens / seconds, tokens / max(rounds, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--shapes", nargs="+", default=["one-token", "auto"])
    parser.add_argument("--step-rounds", type=int, default=shape_policy.STEP_ROUNDS)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shape_policy.STEP_ROUNDS = args.step_rounds
    target = eaglejax.load_target("smollm2-135m-instruct", weight_dtype="auto")
    draft = eaglejax.load_draft(HEAD, target=target)
    tokenizer = target.tokenizer
    questions = interleave_categories(mt_bench_questions())[:args.prompts]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": q.prompt}])) for q in questions]
    # As few slots as the rows need (a step runs the active rows, whatever the slot count),
    # and no prefix cache (decode only): three 16-slot engines warmed up in one process
    # ran XLA:CPU out of memory maps.
    slots = 1 << max(args.rows - 1, 0).bit_length()
    engines = {"plain": Engine(target, None, num_slots=slots, prefix_cache_tokens=0)}
    for name in args.shapes:
        engines[name] = Engine(target, draft, speculative=shape(name), num_slots=slots,
                               prefix_cache_tokens=0)
    for engine in engines.values():
        engine.warmup(progress=False)
        engine.run([Request(("warm", j), prompts[j], args.max_new_tokens)
                    for j in range(min(args.rows, len(prompts)))])
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        order = list(engines) if repeat % 2 == 0 else list(engines)[::-1]
        for name in order:
            runs[name].append(decode(engines[name], prompts, args.rows, args.max_new_tokens,
                                     repeat))
    plain = float(np.median([rate for rate, _ in runs["plain"]]))
    report = {"machine": machine_report(bandwidth=False), "rows": args.rows,
              "step_rounds": args.step_rounds, "storage": target.storage, "results": {
                  name: {"tokens_per_s": [rate for rate, _ in results],
                         "median_over_plain": float(np.median([r for r, _ in results])) / plain,
                         "acceptance_length": float(np.median([al for _, al in results]))}
                  for name, results in runs.items()}}
    for name, engine in engines.items():
        if engine.policy is not None:
            report["results"][name]["forwards_by_mode"] = dict(engine.policy.forwards_by_mode)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['machine']['cpu']}, {target.storage}, {args.rows} row(s), decode tok/s:")
    for name, result in report["results"].items():
        rates = ", ".join(f"{r:.1f}" for r in result["tokens_per_s"])
        print(f"  {name:<12} [{rates}]  {result['median_over_plain']:.3f}x plain  "
              f"AL {result['acceptance_length']:.3f}")


if __name__ == "__main__":
    main()
