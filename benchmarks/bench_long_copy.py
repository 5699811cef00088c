"""Long copies: `auto`'s depth-1 tree against the same tree whose rounds verify a chain of
copied tokens instead where the context matched long (`SpecConfig.long_lookup`), side by
side with plain decoding.

    python benchmarks/bench_long_copy.py --draft checkpoints/smollm2-135m-instruct-eagle3 \\
        [--prompts mt_bench mix] [--num-prompts 16] [--max-new-tokens 128] \\
        [--long 8,8 6,5 ...] [--json]

`--long TOKENS,NGRAM`: a chain of TOKENS copied tokens in rounds where some row's match
held NGRAM tokens or more. Greedy, batch 1, the target stored as `auto` stores it; every
shape warmed up first, then plain decoding and every shape interleaved prompt by prompt
(`eaglejax.bench.compare_speculative`); the tokens of every shape are checked against plain
decoding's. Reported per shape: tokens/s over plain decoding, AL, and per category.
"""

from __future__ import annotations

import argparse
import json

import eaglejax
from eaglejax.bench import compare_speculative
from eaglejax.datasets import interleave_categories, mt_bench_questions
from eaglejax.decoding.autotune import AutoPlan
from peers.prompts import mix_questions


def parse_long(text: str) -> tuple[int, int]:
    tokens, ngram = (int(n) for n in text.split(","))
    return tokens, ngram


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", required=True, help="draft head path")
    parser.add_argument("--weight-dtype", default="auto")
    parser.add_argument("--prompts", nargs="+", choices=["mt_bench", "mix"],
                        default=["mt_bench", "mix"])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--long", type=parse_long, nargs="+", default=[(8, 8), (6, 5)])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    target = eaglejax.load_target(args.model, weight_dtype=args.weight_dtype)
    draft = eaglejax.load_draft(args.draft, target=target)
    plan = AutoPlan.for_target(target, draft)
    depth_one = next(m for m in plan.modes[1:] if m.depth == 1).without_long_lookup()
    shapes = [depth_one] + [depth_one.with_long_lookup(t, n) for t, n in args.long]
    table = {}
    for prompts in args.prompts:
        questions = (interleave_categories(mt_bench_questions())[:args.num_prompts]
                     if prompts == "mt_bench" else mix_questions(args.num_prompts))
        reports = compare_speculative(target, draft, questions, shapes,
                                      max_new_tokens=args.max_new_tokens, ignore_eos=False)
        table[prompts] = reports
        if args.json:
            continue
        print(f"\n{prompts}: {len(questions)} prompts, plain "
              f"{reports[0]['plain_decode_tokens_per_s']:.1f} tok/s")
        for spec, report in zip(shapes, reports):
            identical = "identical" if report["identical_tokens"] else "DIFFER"
            categories = ", ".join(f"{c} {al:.2f}" for c, al in
                                   report["acceptance_length_by_category"].items())
            print(f"  {spec.describe()}: {report['speedup']:.3f}x plain, AL "
                  f"{report['acceptance_length']:.3f}, round "
                  f"{report['round_over_plain_step']:.2f} plain steps, tokens {identical}\n"
                  f"    AL per category: {categories}")
    if args.json:
        print(json.dumps(table, indent=1, default=str))


if __name__ == "__main__":
    main()
