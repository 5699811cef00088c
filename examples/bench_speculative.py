"""Speculative vs plain greedy decoding on MT-bench, side by side, with a draft head.

    python examples/bench_speculative.py --draft random --num-draft-tokens 5 --num-prompts 8
With `--draft random` a freshly initialised EAGLE-3 head is used: its acceptance length is
near 1, so the run measures the loop's own overhead per speculative round relative to a
plain decode step. Any head `eaglejax.load_draft` reads can be given instead.
"""

from __future__ import annotations

import argparse
import json

import eaglejax
from eaglejax.bench import bench_speculative
from eaglejax.datasets import mt_bench_questions
from eaglejax.draft.draft import new_eagle3_draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="random")
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = eaglejax.load_target(args.model)
    if args.draft == "random":
        draft = new_eagle3_draft(target, seed=0)
    else:
        from eaglejax.draft import load_draft

        draft = load_draft(args.draft, target=target)
    report = bench_speculative(target, draft, mt_bench_questions()[:args.num_prompts],
                               batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                               num_draft_tokens=args.num_draft_tokens)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
