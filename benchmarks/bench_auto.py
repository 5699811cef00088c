"""`speculative="auto"` from a cold start against plain decoding and every shape it can
choose, prompt by prompt: does adapting while decoding pay on each prompt?

    python benchmarks/bench_auto.py --draft checkpoints/smollm2-135m-instruct-eagle3 \\
        [--weight-dtype float32] [--prompts mt_bench|mix] [--num-prompts 16]
        [--max-new-tokens 128] [--json]

Greedy, batch 1, MT-bench first turns (round-robin over categories) or the Spec-Bench-style
mix of `benchmarks/peers`. `auto` starts with
nothing learnt (`EAGLEJAX_AUTOTUNE_CACHE=0`, an empty process) and keeps what it learns from
prompt to prompt, as a user's process does: its first calls are included. Every program is
compiled before the prompt it first serves is timed (compile time is excluded on both
sides); per prompt, plain decoding, each fixed shape and `auto` run back to back in a
rotating order. Reported: tokens/s over all prompts per configuration, `auto` over plain per
prompt (its minimum is the bar: >= 1.0 within noise), `auto` over the best configuration,
the most a call of `auto` took beyond plain's (prefill + decode), and the modes `auto` ran
per category.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

os.environ["EAGLEJAX_AUTOTUNE_CACHE"] = "0"
# Every configuration decodes the same prompt in turn: none may copy another's reply from
# the history of earlier replies (`decoding.suffix_history`), so no call adds to it.
os.environ["EAGLEJAX_REPLY_HISTORY"] = "0"

import numpy as np  # noqa: E402

import eaglejax  # noqa: E402
from eaglejax import hardware  # noqa: E402
from eaglejax.decoding.autotune import AutoPlan  # noqa: E402
from eaglejax.datasets import interleave_categories, mt_bench_questions  # noqa: E402
from eaglejax.decoding.buckets import bucket  # noqa: E402
from peers.prompts import mix_questions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", required=True, help="draft head path")
    parser.add_argument("--weight-dtype", default="auto",
                        help="the target's weight storage, e.g. float32 (default: auto, what "
                             "decodes fastest here, as `eaglejax generate` stores it)")
    parser.add_argument("--prompts", choices=["mt_bench", "mix"], default="mt_bench",
                        help="MT-bench first turns in category order, or the Spec-Bench-style "
                             "mix of benchmarks/peers (coding, extraction, math, writing, "
                             "summarisation, text-grounded QA)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    target = eaglejax.load_target(args.model, weight_dtype=args.weight_dtype)
    draft = eaglejax.load_draft(args.draft, target=target)
    questions = (interleave_categories(mt_bench_questions())[:args.num_prompts]
                 if args.prompts == "mt_bench" else mix_questions(args.num_prompts))
    plan = AutoPlan.for_target(target, draft)
    runs: dict[str, dict] = {"plain": {}}
    runs.update({spec.describe(): dict(draft=draft, speculative=spec)
                 for spec in plan.modes[1:]})
    runs["auto"] = dict(draft=draft, speculative="auto")
    common = dict(target=target, max_new_tokens=args.max_new_tokens)
    names = list(runs)
    per_prompt, warm = [], set()
    for i, question in enumerate(questions):
        length = bucket(len(target.tokenizer.render_prompt(question.prompt, chat=True)), 16)
        if length not in warm:  # compile (and first-run) the fixed shapes outside the timing;
            warm.add(length)  # auto compiles each mode before its first segment
            for name in names[:-1]:
                eaglejax.generate([question.prompt], **common, **runs[name])
        row = {"category": question.category}
        for name in names[i % len(names):] + names[:i % len(names)]:
            (result,) = eaglejax.generate([question.prompt], **common, **runs[name])
            m = result.metrics
            row[name] = {"tokens": m.new_tokens - 1, "decode_s": m.decode_s,
                         "call_s": m.prefill_s + m.decode_s, "ids": result.token_ids,
                         "shape": m.speculative, "prompt_tokens": m.prompt_tokens}
        per_prompt.append(row)
    report = summarize(per_prompt, names)
    report.update(machine=hardware.machine_report(bandwidth=False),
                  max_new_tokens=args.max_new_tokens, draft=args.draft, prompts=len(questions),
                  weight_dtype=target.storage)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for name, tps in report["tokens_per_s"].items():
        print(f"{name:<64} {tps:7.1f} tok/s  x{tps / report['tokens_per_s']['plain']:.3f}")
    print(f"auto over plain per prompt: min {report['auto_over_plain_min']:.3f}, "
          f"median {report['auto_over_plain_median']:.3f}; auto over the best "
          f"({report['best']}): {report['auto_over_best']:.3f}; most beyond plain per call: "
          f"{report['most_beyond_plain_s']:.2f} s; identical tokens: {report['identical']}")
    for category, mix in report["auto_modes_by_category"].items():
        print(f"  {category:<12} {mix}")


def summarize(per_prompt: list[dict], names: list[str]) -> dict:
    """Tokens/s per configuration over all prompts, auto's per-prompt ratios and modes."""
    tps = {name: sum(r[name]["tokens"] for r in per_prompt)
           / sum(r[name]["decode_s"] for r in per_prompt) for name in names}
    ratios = [(r["auto"]["tokens"] / r["auto"]["decode_s"])
              / (r["plain"]["tokens"] / r["plain"]["decode_s"]) for r in per_prompt]
    best = max((n for n in names if n != "auto"), key=lambda n: tps[n])
    mixes: dict[str, collections.Counter] = {}
    for r in per_prompt:
        mixes.setdefault(r["category"], collections.Counter())[r["auto"]["shape"]] += 1
    return {
        "tokens_per_s": {n: round(v, 2) for n, v in tps.items()},
        "best": best, "auto_over_best": tps["auto"] / tps[best],
        "auto_over_plain_min": float(np.min(ratios)),
        "auto_over_plain_median": float(np.median(ratios)),
        "auto_over_plain_per_prompt": [round(x, 3) for x in ratios],
        "over_plain_per_prompt": {n: [round((r[n]["tokens"] / r[n]["decode_s"])
                                            / (r["plain"]["tokens"] / r["plain"]["decode_s"]), 3)
                                      for r in per_prompt] for n in names if n != "plain"},
        "prompt_tokens": [r["plain"]["prompt_tokens"] for r in per_prompt],
        "most_beyond_plain_s": max(r["auto"]["call_s"] - r["plain"]["call_s"]
                                   for r in per_prompt),
        "identical": all(r[n]["ids"] == r["plain"]["ids"] for r in per_prompt for n in names),
        "auto_modes_by_category": {c: dict(m) for c, m in mixes.items()},
    }


if __name__ == "__main__":
    main()
