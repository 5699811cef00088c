"""Parallel drafting (P-EAGLE): all K draft tokens from ONE forward of the draft head.

    python examples/parallel_drafting.py ["prompt"] [--model smollm2-135m-instruct] \
        [--draft checkpoints/smollm2-135m-instruct-peagle] [-k 3] [--max-new-tokens 128]

An EAGLE-3 chain runs the head K times per round, each step feeding it the token it just
drafted. A P-EAGLE head (arXiv 2602.01469) is an EAGLE-3 head with a learned mask token:
K - 1 mask slots after the last accepted token ask for the following tokens in the same
forward, so drafting costs one head call whatever K. The script decodes the prompt plainly
and with the P-EAGLE head (`SpecConfig.parallel(K)`, a chain of its K proposals), checks
the tokens are the same (greedy speculative decoding is lossless) and prints the
acceptance length and both speeds.

By default it uses the P-EAGLE head this repository ships for SmolLM2-135M-Instruct;
`--draft` takes any P-EAGLE head `load_draft` reads (eaglejax, reference with
`mask_hidden`, or speculators `peagle` layout; a Hub id too). CI runs it with
`--max-new-tokens 8`.
"""

from __future__ import annotations

import argparse

import eaglejax
from eaglejax import SpecConfig
from eaglejax.draft.shipped import shipped_head

DEFAULT_PROMPT = "List the planets of the solar system in order, then explain why."


def main(argv: list[str] | None = None) -> dict[str, float | bool]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None,
                        help="a P-EAGLE head (default: the one shipped for --model)")
    parser.add_argument("-k", type=int, default=3, help="draft tokens per round")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    target = eaglejax.load_target(args.model)
    head = args.draft or shipped_head(args.model, "peagle")
    if head is None:
        parser.error(f"no P-EAGLE head ships for {args.model}: pass --draft")
    draft = eaglejax.load_draft(head, target=target)
    if not draft.config.parallel:  # a plain EAGLE-3 head has no mask token to draft with
        parser.error(f"{head} is not a P-EAGLE head (it has no mask token)")

    common = dict(target=target, max_new_tokens=args.max_new_tokens)
    plain = eaglejax.generate([args.prompt], **common)[0]
    # `parallel(K)`: one head forward proposes K tokens, verified as a chain.
    # `SpecConfig.parallel_tree(top_k, depth, total_tokens)` verifies a tree over the slots'
    # top tokens instead, still from the one forward.
    parallel = eaglejax.generate([args.prompt], draft=draft,
                                 speculative=SpecConfig.parallel(args.k), **common)[0]

    result = {"identical": parallel.token_ids == plain.token_ids,
              "acceptance_length": parallel.metrics.acceptance_length,
              "plain_tokens_per_s": plain.metrics.decode_tokens_per_s,
              "parallel_tokens_per_s": parallel.metrics.decode_tokens_per_s}
    print(parallel.text)
    print(f"{parallel.metrics.speculative}: tokens identical to plain decoding: "
          f"{result['identical']}")
    print(f"acceptance length: {result['acceptance_length']:.2f} tokens per target forward, "
          f"one head forward per round")
    print(f"decoding: {result['parallel_tokens_per_s']:.1f} tok/s with the head, "
          f"{result['plain_tokens_per_s']:.1f} tok/s plain")
    return result


if __name__ == "__main__":
    main()
