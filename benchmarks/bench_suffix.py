"""Suffix drafting (no head; a fixed tree, and `auto` switching between suffix trees and
plain decoding) beside the EAGLE-3 head's tree, alone and with a lookup branch that searches
the row's own context or the replies decoded before too, the head's `auto`, and plain
decoding, in one run.

    python benchmarks/bench_suffix.py [--num-prompts 8] [--max-new-tokens 128]
        [--workloads mt_bench repetitive mix] [--gated 12,3 6,2] [--no-head] [--json]

Greedy, batch 1, SmolLM2 with the shipped EAGLE-3 head; timed interleaved prompt by prompt
(`eaglejax.bench.compare_drafts`). Each workload is a sequence of requests to one process:
a request's call starts with the history of earlier replies (`decoding.suffix_history`)
holding the replies to the requests before it (plain decoding's, so the same for every
run), as a server that answered them in order holds it. Three workloads (the first two by
default): MT-bench first turns balanced over categories, the Spec-Bench-style mix of
`benchmarks/peers` (coding, extraction, math, writing, summarisation, text-grounded QA), and a
repetitive one (rewriting given code with an edit,
extracting from a given passage: the reply repeats its prompt; then requests that repeat
earlier ones, as a regenerate does, or edit them: the reply repeats an earlier reply too),
decoded to EOS (MT-bench and the mix: to the token limit, EOS ignored, as `eaglejax bench`
does). Per run: AL (per kind of request or category on the repetitive workload and the mix), round cost in plain steps,
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
from peers.prompts import mix_questions

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
RENAME = ("Rewrite this Python function with the parameter `window` renamed to `{}`. Reply "
          f"with the code only.\n\n{CODE}")
NAMES = f"Copy every sentence of this passage that names a person, one per line.\n\n{PASSAGE}"
REPLACE = "Repeat this passage, replacing Tuesday with {}.\n\n" + PASSAGE
# (kind, prompt) in the order a process answers them: four new requests, then requests
# repeating or editing earlier ones.
REPETITIVE = [
    ("new", RENAME.format("size")),
    ("new", f"Add type hints to this Python function. Reply with the code only.\n\n{CODE}"),
    ("new", NAMES),
    ("new", REPLACE.format("Wednesday")),
    ("repeat", RENAME.format("size")),
    ("edit", RENAME.format("width")),
    ("repeat", NAMES),
    ("edit", REPLACE.format("Thursday")),
]


WORKLOADS = ("mt_bench", "mix", "repetitive")


def workload(name: str, count: int) -> list[Question]:
    """The requests of workload `name` (`count` of MT-bench or the mix), in answering order."""
    if name == "mt_bench":
        return interleave_categories(mt_bench_questions())[:count]
    if name == "mix":
        return mix_questions(count)
    return [Question(i, kind, p) for i, (kind, p) in enumerate(REPETITIVE)]


def earlier_replies(target, questions: list[Question], max_new_tokens: int,
                    ignore_eos: bool) -> list[list[list[int]]]:
    """Per question, plain decoding's replies to the questions before it: the history a
    process that answered them in order holds when it comes."""
    replies = [eaglejax.generate([q.prompt], target=target, max_new_tokens=max_new_tokens,
                                 ignore_eos=ignore_eos)[0].token_ids for q in questions]
    return [replies[:i] for i in range(len(questions))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS,
                        default=["mt_bench", "repetitive"])
    parser.add_argument("--gated", nargs="*", default=[], metavar="TOTAL,MIN_MATCH",
                        help="also suffix trees of TOTAL nodes (top_k 4, depth 6) whose rounds "
                             "are gated at MIN_MATCH")
    parser.add_argument("--no-head", action="store_true", help="only the runs with no head")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    target = eaglejax.load_target("smollm2-135m-instruct", weight_dtype="auto")
    head = eaglejax.load_draft(shipped_head("smollm2-135m-instruct"), target=target)
    tree = SpecConfig.tree(4, 4, 8)
    runs = [(None, SpecConfig.suffix(4, 6, 12, min_match=0)), (None, SpecConfig.suffix())]
    runs += [(None, SpecConfig.suffix(4, 6, *map(int, gate.split(",")))) for gate in args.gated]
    runs += [(None, "auto")]
    if not args.no_head:
        runs += [(head, tree.with_lookup(4)), (head, tree.with_lookup(4, history=True)),
                 (head, tree), (head, "auto")]
    report = {}
    for name in args.workloads:
        questions = workload(name, args.num_prompts)
        ignore_eos = name != "repetitive"
        histories = earlier_replies(target, questions, args.max_new_tokens, ignore_eos)
        results = compare_drafts(target, runs, questions, max_new_tokens=args.max_new_tokens,
                                 ignore_eos=ignore_eos, histories=histories)
        report[name] = [{key: r[key] for key in (
            "speculative", "acceptance_length", "acceptance_length_by_category",
            "round_over_plain_step", "plain_decode_tokens_per_s", "spec_decode_tokens_per_s",
            "speedup", "identical_tokens")} for r in results]
        report["machine"] = results[0]["machine"]
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for name in args.workloads:
        print(f"{name} (plain {report[name][0]['plain_decode_tokens_per_s']:.1f} tok/s)")
        for r in report[name]:
            kinds = "" if name == "mt_bench" else "  (" + ", ".join(
                f"{kind} {al:.2f}" for kind, al in r["acceptance_length_by_category"].items()) + ")"
            print(f"  {r['speculative']:<56} AL {r['acceptance_length']:.2f}{kinds}  round "
                  f"{r['round_over_plain_step']:.2f} steps  {r['spec_decode_tokens_per_s']:.1f}"
                  f" tok/s ({r['speedup']:.2f}x plain)  identical {r['identical_tokens']}")


if __name__ == "__main__":
    main()
