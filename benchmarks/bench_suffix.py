"""Suffix drafting (no head; a fixed tree, and `auto` switching between suffix trees and
plain decoding) beside the EAGLE-3 head and plain decoding, in one run.

    python benchmarks/bench_suffix.py [--num-prompts 8] [--max-new-tokens 128] [--json]

Greedy, batch 1, SmolLM2 with the shipped EAGLE-3 head; timed interleaved prompt by prompt
(`eaglejax.bench.compare_drafts`). Two workloads: MT-bench first turns balanced over
categories, and a repetitive one (rewriting given code with an edit, extracting from a
given passage) where the reply repeats its prompt, decoded to EOS (MT-bench: to the token
limit, EOS ignored, as `eaglejax bench` does). Per run: AL, round cost in plain steps,
tokens/s and the speed-up over plain decoding; every run's tokens must equal plain's.
"""

from __future__ import annotations

import argparse
import json

import eaglejax
from eaglejax import SpecConfig
from eaglejax.bench import compare_drafts
from eaglejax.datasets import Question, interleave_categories, mt_bench_questions
from eaglejax.draft.shipped import shipped_head

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages'''
PASSAGE = ("The committee met on Tuesday. Maria Lopez chaired the meeting, and Ahmed Khan "
           "presented the budget. Priya Natarajan asked about the travel fund, and Tom "
           "Becker promised a report by Friday. Maria Lopez closed the meeting at noon.")
REPETITIVE = [
    f"Rewrite this Python function with the parameter `window` renamed to `size`. Reply "
    f"with the code only.\n\n{CODE}",
    f"Add type hints to this Python function. Reply with the code only.\n\n{CODE}",
    f"Copy every sentence of this passage that names a person, one per line.\n\n{PASSAGE}",
    f"Repeat this passage, replacing Tuesday with Wednesday.\n\n{PASSAGE}",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    target = eaglejax.load_target("smollm2-135m-instruct", weight_dtype="auto")
    head = eaglejax.load_draft(shipped_head("smollm2-135m-instruct"), target=target)
    runs = [(None, SpecConfig.suffix(4, 6, 12)), (None, "auto"),
            (head, SpecConfig.tree(4, 4, 8).with_lookup(4)),
            (head, SpecConfig.tree(4, 4, 8))]
    workloads = {
        "mt_bench": interleave_categories(mt_bench_questions())[:args.num_prompts],
        "repetitive": [Question(i, "repetitive", p) for i, p in enumerate(REPETITIVE)],
    }
    report = {}
    for name, questions in workloads.items():
        results = compare_drafts(target, runs, questions, max_new_tokens=args.max_new_tokens,
                                 ignore_eos=name == "mt_bench")
        report[name] = [{key: r[key] for key in (
            "speculative", "acceptance_length", "round_over_plain_step",
            "plain_decode_tokens_per_s", "spec_decode_tokens_per_s", "speedup",
            "identical_tokens")} for r in results]
        report["machine"] = results[0]["machine"]
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for name in workloads:
        print(name)
        for r in report[name]:
            print(f"  {r['speculative']:<48} AL {r['acceptance_length']:.2f}  round "
                  f"{r['round_over_plain_step']:.2f} steps  {r['spec_decode_tokens_per_s']:.1f}"
                  f" tok/s ({r['speedup']:.2f}x plain)  identical {r['identical_tokens']}")


if __name__ == "__main__":
    main()
