"""EAGLE-3 chain vs P-EAGLE chain vs P-EAGLE lattice tree (vs a DFlash drafter's block
and tree, vs suffix drafting with no draft), side by side in one run.

    python benchmarks/bench_peagle.py [--peagle checkpoints/smollm2-135m-instruct-peagle] \\
        [--eagle3 checkpoints/smollm2-135m-instruct-eagle3] [-k 3 5] [--tree 4:3:12 ...] \\
        [--dflash DRAFTER [--dflash-tree 4:7:12 ...]] [--suffix] [--prompts mt_bench|mix] \\
        [--num-prompts 16] [--max-new-tokens 128] [--json]

Greedy, batch 1, MT-bench first turns balanced over categories (or the Spec-Bench-style
mix of benchmarks/peers), SmolLM2 (or --model); `--suffix` adds suffix drafting (4,6,12) and
`auto` with no draft (suffix trees against plain decoding). Plain
decoding and every (head, shape) pair are timed interleaved prompt by prompt
(`eaglejax.bench.compare_drafts`), after a warm-up that compiles them all. Per pair: the
acceptance length, the round's cost in plain decode steps, the head's time per round (the
round minus one target forward over the same number of nodes, timed alone), tokens/s and
the speed-up over plain decoding; every pair's tokens must equal plain decoding's.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import eaglejax
from eaglejax import SpecConfig
from eaglejax.bench import compare_drafts
from eaglejax.datasets import interleave_categories, mt_bench_questions
from eaglejax.decoding.batch import cache_capacity
from eaglejax.draft.shipped import shipped_head
from eaglejax.timing import single_forward_ms
from peers.prompts import mix_questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--eagle3", default=None, help="EAGLE-3 head (default: the shipped one)")
    parser.add_argument("--peagle", default=None,
                        help="P-EAGLE head directory (default: the shipped one)")
    parser.add_argument("-k", type=int, nargs="+", default=[3, 5],
                        help="draft tokens per round of both chains")
    parser.add_argument("--tree", nargs="*", default=["4:3:12"],
                        help="P-EAGLE lattice trees TOP_K:DEPTH:TOTAL (none: no tree)")
    parser.add_argument("--dflash", default=None,
                        help="a DFlash drafter too: its whole block as a chain, and trees")
    parser.add_argument("--dflash-tree", nargs="*", default=["4:7:12"],
                        help="DFlash trees TOP_K:DEPTH:TOTAL over its block (none: no tree)")
    parser.add_argument("--suffix", action="store_true",
                        help="suffix drafting (no draft) and auto over suffix trees too")
    parser.add_argument("--prompts", choices=("mt_bench", "mix"), default="mt_bench")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    target = eaglejax.load_target(args.model)
    eagle3 = eaglejax.load_draft(args.eagle3 or shipped_head(args.model), target=target)
    peagle = eaglejax.load_draft(args.peagle or shipped_head(args.model, "peagle"), target=target)
    pairs = []
    for k in args.k:
        pairs += [("EAGLE-3", eagle3, SpecConfig.chain(k)),
                  ("P-EAGLE", peagle, SpecConfig.parallel(k))]
    for tree in args.tree:
        top_k, depth, total = (int(n) for n in tree.split(":"))
        pairs.append(("P-EAGLE", peagle, SpecConfig.parallel_tree(top_k, depth, total)))
    if args.dflash:
        dflash = eaglejax.load_draft(args.dflash, target=target)
        pairs.append(("DFlash", dflash, SpecConfig.dflash(dflash.config.block_size - 1)))
        for tree in args.dflash_tree:
            top_k, depth, total = (int(n) for n in tree.split(":"))
            pairs.append(("DFlash", dflash, SpecConfig.dflash_tree(top_k, depth, total)))
    if args.suffix:
        pairs += [("suffix", None, SpecConfig.suffix()), ("suffix", None, "auto")]
    questions = (interleave_categories(mt_bench_questions())[:args.num_prompts]
                 if args.prompts == "mt_bench" else mix_questions(args.num_prompts))
    reports = compare_drafts(target, [(draft, spec) for _, draft, spec in pairs], questions,
                             max_new_tokens=args.max_new_tokens)

    lengths = [len(target.tokenizer.render_prompt(q.prompt, chat=True)) for q in questions]
    context = int(np.mean(lengths)) + args.max_new_tokens // 2
    capacity = cache_capacity(max(lengths), args.max_new_tokens, 64)
    rows = []
    for (name, _, spec), r in zip(pairs, reports):
        fixed = spec != "auto"  # auto's rounds mix shapes: no one verify to subtract
        verify_ms = single_forward_ms(target, context, capacity, tokens=spec.num_nodes) \
            if fixed else None
        rows.append({"head": name, "shape": spec.describe() if fixed else r["speculative"],
                     "nodes": spec.num_nodes if fixed else None,
                     "acceptance_length": round(r["acceptance_length"], 3),
                     "round_over_plain_step": round(r["round_over_plain_step"], 3),
                     "round_ms": round(r["spec_ms_per_round"], 2),
                     "verify_ms": round(verify_ms, 2) if fixed else None,
                     "head_ms_per_round": round(r["spec_ms_per_round"] - verify_ms, 2)
                     if fixed else None,
                     "tokens_per_s": round(r["spec_decode_tokens_per_s"], 1),
                     "speedup": round(r["speedup"], 3),
                     "identical_tokens": r["identical_tokens"],
                     "acceptance_length_by_category": {
                         c: round(v, 3) for c, v in r["acceptance_length_by_category"].items()}})
    report = {"machine": reports[0]["machine"], "model": reports[0]["model"],
              "prompts": len(questions), "max_new_tokens": args.max_new_tokens,
              "plain_tokens_per_s": round(reports[0]["plain_decode_tokens_per_s"], 1),
              "plain_ms_per_step": round(reports[0]["plain_ms_per_step"], 2), "runs": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"plain decoding: {report['plain_tokens_per_s']} tok/s, "
          f"{report['plain_ms_per_step']} ms per step")
    print("| head | shape | AL | round / plain step | head ms per round | tok/s | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        head_ms = "-" if row["head_ms_per_round"] is None else f"{row['head_ms_per_round']:.2f}"
        print(f"| {row['head']} | {row['shape']} | {row['acceptance_length']:.2f} | "
              f"{row['round_over_plain_step']:.2f} | {head_ms} | "
              f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f} |")
    if not all(row["identical_tokens"] for row in rows):
        raise SystemExit("a speculative run's tokens differ from plain decoding's")


if __name__ == "__main__":
    main()
