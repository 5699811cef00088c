"""Chain vs tree speculation side by side: tokens/s and acceptance length per configuration,
and `speculative="auto"` (which switches between plain decoding and trees as it decodes: the
mix it ran is listed), against one plain-decoding baseline per batch size.

    python benchmarks/bench_trees.py --draft checkpoints/smollm2-135m-instruct-eagle3 \\
        [--weight-dtype float32] [--num-prompts 8] [--batch-sizes 1 8] [--max-new-tokens 128]
        [--lookup 0 4] [--json]

Greedy, MT-bench first turns (round-robin over categories), SmolLM2 (or --model), every
configuration warmed up before it is timed, then plain decoding and every configuration
interleaved prompt by prompt (`eaglejax.bench.run_interleaved`). `--lookup 0 4` runs each
shape without and with a 4-token context-lookup branch (`--replacing`: also with the branch
in place of the head's 4 weakest nodes). Ratios are measured in one run;
the machine is shared, so compare within it.
"""

from __future__ import annotations

import argparse
import json

import eaglejax
from eaglejax import SpecConfig
from eaglejax.bench import compare_speculative
from eaglejax.datasets import interleave_categories, mt_bench_questions
from eaglejax.draft.draft import new_eagle3_draft

CONFIGS = [SpecConfig.chain(3), SpecConfig.chain(5), SpecConfig.tree(4, 4, 8),
           SpecConfig.tree(4, 4, 12), SpecConfig.tree(4, 4, 24)]


def parse_shape(text: str) -> SpecConfig:
    """'chain:K', 'parallel:K', 'tree:TOP_K:DEPTH:TOTAL', 'ptree:TOP_K:DEPTH:TOTAL' ->
    SpecConfig (parallel shapes need a P-EAGLE head)."""
    kind, *numbers = text.split(":")
    if kind in ("chain", "parallel") and len(numbers) == 1:
        return getattr(SpecConfig, kind)(int(numbers[0]))
    if kind in ("tree", "ptree") and len(numbers) == 3:
        make = SpecConfig.tree if kind == "tree" else SpecConfig.parallel_tree
        return make(*(int(n) for n in numbers))
    raise SystemExit(f"--shapes: {text!r} is not chain:K, parallel:K, tree:TOP_K:DEPTH:TOTAL "
                     f"or ptree:TOP_K:DEPTH:TOTAL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--weight-dtype", default="auto",
                        help="the target's weight storage, e.g. float32 (default: auto, what "
                             "decodes fastest here, as `eaglejax generate` stores it)")
    parser.add_argument("--draft", default="random",
                        help="draft head path, or 'random' (EAGLE-3), or 'random-peagle' (a "
                             "random P-EAGLE head: runs sequential and parallel shapes)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--lookup", type=int, nargs="+", default=[0],
                        help="context-lookup branch sizes to try on every shape (0: none)")
    parser.add_argument("--replacing", action="store_true",
                        help="also run each lookup branch in place of the head's weakest nodes")
    parser.add_argument("--shapes", default=None,
                        help="shapes instead of the default list, e.g. 'chain:5,tree:4:4:8'")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    target = eaglejax.load_target(args.model, weight_dtype=args.weight_dtype)
    if args.draft in ("random", "random-peagle"):
        mask = target.config.vocab_size - 1 if args.draft == "random-peagle" else None
        draft = new_eagle3_draft(target, mask_token_id=mask)
    else:
        draft = eaglejax.load_draft(args.draft, target=target)
    questions = interleave_categories(mt_bench_questions())[:args.num_prompts]
    shapes = CONFIGS if args.shapes is None else [parse_shape(s) for s in args.shapes.split(",")]
    shapes = [shape.with_lookup(n, replaces=replaces) for shape in shapes for n in args.lookup
              for replaces in ((False, True) if n and args.replacing else (False,))]
    report = []
    for batch in args.batch_sizes:
        common = dict(batch_size=batch, max_new_tokens=args.max_new_tokens)
        reports = compare_speculative(target, draft, questions, [*shapes, "auto"], **common)
        plain_tps = reports[0]["plain_decode_tokens_per_s"]
        rows = [{"speculative": "plain decoding", "nodes": 1, "acceptance_length": 1.0,
                 "tokens_per_s": round(plain_tps, 1), "speedup": 1.0, "identical_tokens": True}]
        for spec, r in zip(shapes, reports):
            rows.append({"speculative": spec.describe(), "nodes": spec.num_nodes,
                         "acceptance_length": round(r["acceptance_length"], 3),
                         "tokens_per_s": round(r["spec_decode_tokens_per_s"], 1),
                         "speedup": round(r["speedup"], 3),
                         "round_over_plain_step": round(r["round_over_plain_step"], 3),
                         "identical_tokens": r["identical_tokens"]})
        best = max(rows, key=lambda row: row["tokens_per_s"])
        auto = reports[-1]
        auto_tps = auto["spec_decode_tokens_per_s"]
        report.append({"batch_size": batch, "plain_tokens_per_s": round(plain_tps, 1),
                       "configs": rows, "best": best["speculative"],
                       "auto": {"modes": auto["speculative_shapes"],
                                "acceptance_length": round(auto["acceptance_length"], 3),
                                "tokens_per_s": round(auto_tps, 1),
                                "speedup": round(auto["speedup"], 3),
                                "identical_tokens": auto["identical_tokens"]},
                       "auto_over_best": round(auto_tps / best["tokens_per_s"], 3)})
        if not args.json:
            print(f"\nbatch {batch}: plain {plain_tps:.1f} tok/s")
            for row in rows:
                print(f"  {row['speculative']:<56} AL {row['acceptance_length']:.2f}  "
                      f"{row['tokens_per_s']:7.1f} tok/s  x{row['speedup']:.2f}")
            print(f"  {'auto':<56} AL {auto['acceptance_length']:.2f}  {auto_tps:7.1f} tok/s  "
                  f"x{auto['speedup']:.2f}: {report[-1]['auto_over_best']:.0%} of the best "
                  f"({best['speculative']})")
            for mode, rows_run in auto["speculative_shapes"].items():
                print(f"    {rows_run} rows: {mode}")
    if args.json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
