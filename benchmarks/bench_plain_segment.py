"""What `auto`'s plain segments cost beyond the plain loop: SmolLM2 decodes the same prompts
with `decoding.batch.decode` (plain) and with `adaptive_decode` held on plain segments
(16 steps, then the head's catch-up), alternating, and prints ms per target forward.

    python benchmarks/bench_plain_segment.py [--draft checkpoints/smollm2-135m-instruct-eagle3]
        [--num-prompts 4] [--repeats 4] [--max-new-tokens 128] [--weight-dtype bfloat16]

Greedy, batch 1, MT-bench first turns; the first repeat warms both up and is not counted.
"""

from __future__ import annotations

import argparse

import numpy as np

import eaglejax
from eaglejax.decoding.autotune import AutoPlan, AutoPolicy, Knowledge
from eaglejax.datasets import mt_bench_questions
from eaglejax.decoding.adaptive import adaptive_decode
from eaglejax.decoding.batch import decode
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.stopping import StopCriteria


class PlainOnly(AutoPolicy):
    """`auto` that always chooses a plain segment."""

    def next_mode(self) -> int:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="checkpoints/smollm2-135m-instruct-eagle3")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--weight-dtype", default=None,
                        help="the target's weight storage, e.g. bfloat16 (default: as loaded)")
    args = parser.parse_args()
    target = eaglejax.load_target("smollm2-135m-instruct", weight_dtype=args.weight_dtype)
    draft = eaglejax.load_draft(args.draft, target=target)
    greedy, stop = SamplingParams.make(), StopCriteria((), ())
    plan = AutoPlan.for_target(target, draft)
    ms: dict[str, list[float]] = {"plain": [], "segments": []}
    for repeat in range(args.repeats):
        for question in mt_bench_questions()[:args.num_prompts]:
            ids = [target.tokenizer.render_prompt(question.prompt, chat=True)]
            for name in (["plain", "segments"] if repeat % 2 else ["segments", "plain"]):
                if name == "plain":
                    run = decode(target, None, ids, [0], greedy, args.max_new_tokens, stop, None)
                else:
                    run = adaptive_decode(target, draft, ids, [0], greedy, args.max_new_tokens,
                                          stop, PlainOnly(plan, Knowledge())).run
                if repeat:
                    ms[name].append(1e3 * run.decode_s / int(run.state.forwards))
    ratio = np.array(ms["segments"]) / np.array(ms["plain"])
    for name, values in ms.items():
        print(f"{name:<9} ms per forward: {np.round(values, 1)}")
    print(f"segments over plain: median {np.median(ratio):.3f}, mean {ratio.mean():.3f}")


if __name__ == "__main__":
    main()
