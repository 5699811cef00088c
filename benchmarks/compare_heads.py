"""Greedy acceptance of several draft heads on the trainer's evaluation turns.

    python benchmarks/compare_heads.py HEAD [HEAD ...] [--questions 8] [--max-new-tokens 64]

Each head speculates for SmolLM2 with a K=5 chain and a 4,4,8 dynamic tree over the same
MT-bench first turns the trainer evaluates (one per category, stopping at EOS); the script
checks the tokens equal plain decoding's and prints the mean acceptance length per head and
shape. Acceptance is deterministic under greedy decoding, so heads measured in separate
runs compare (speeds would not).
"""

from __future__ import annotations

import argparse

import numpy as np

import eaglejax
from eaglejax import SpecConfig
from eaglejax.training.pipeline import mt_bench_prompts

SHAPES = {"chain K=5": SpecConfig.chain(5), "tree 4,4,8": SpecConfig.tree(4, 4, 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", nargs="+", help="draft head directories (any layout)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    target = eaglejax.load_target(args.model)
    prompts = mt_bench_prompts(args.questions)
    common = dict(target=target, max_new_tokens=args.max_new_tokens)
    plain = [g.token_ids for g in eaglejax.generate(prompts, **common)]
    for path in args.heads:
        draft = eaglejax.load_draft(path, target=target)
        for name, shape in SHAPES.items():
            out = eaglejax.generate(prompts, draft=draft, speculative=shape, **common)
            if [g.token_ids for g in out] != plain:
                raise SystemExit(f"{path}, {name}: tokens differ from plain decoding")
            al = np.mean([g.metrics.acceptance_length for g in out])
            print(f"{path}  {name}: AL {al:.3f}", flush=True)


if __name__ == "__main__":
    main()
