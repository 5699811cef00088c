"""Speculative decoding with an EAGLE-3 draft head from the Hugging Face Hub.

    python examples/speculative_decoding.py ["prompt"] \
        [--model meta-llama/Llama-3.1-8B-Instruct] \
        [--draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B] [--max-new-tokens 256]

The target model and its draft head are named by Hub id (`org/name`, or `org/name@revision`
to pin one) or by a local path. Only the files eaglejax reads are fetched, once, into the
Hugging Face cache; Llama is gated, so accept its terms on the Hub and set HF_TOKEN. The
head proposes tokens, the target verifies them all in one forward, and the reply is exactly
the one plain greedy decoding gives, in fewer target forwards. The script prints the reply,
the acceptance length (tokens per target forward, the target's own token included: plain
decoding is 1.0) and the decoding speed.

Without an accelerator, the same with the built-in SmolLM2-135M-Instruct and the EAGLE-3
head this repository ships (what CI runs, with `--max-new-tokens 8`):

    python examples/speculative_decoding.py --model smollm2-135m-instruct \
        --draft checkpoints/smollm2-135m-instruct-eagle3
"""

from __future__ import annotations

import argparse

import eaglejax

DEFAULT_PROMPT = "Explain speculative decoding in two sentences."


def main(argv: list[str] | None = None) -> eaglejax.Generation:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct",
                        help="the target: a Hub id, a local HF directory or GGUF file, or a "
                             "built-in name")
    parser.add_argument("--draft", default="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                        help="the EAGLE-3 head: a Hub id or a local directory (any layout "
                             "load_draft reads: reference, SpecForge, speculators, eaglejax)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args(argv)

    # 1. The target: weights in bfloat16 on a GPU or TPU, float32 on a CPU.
    target = eaglejax.load_target(args.model)
    # 2. The head, checked against the target (hidden size, vocabulary, taps) and placed on
    #    the same devices.
    draft = eaglejax.load_draft(args.draft, target=target)

    # 3. Greedy speculative decoding. `speculative` left out takes the device's preset (a
    #    dynamic tree on an accelerator); `eaglejax.SpecConfig.chain(5)`,
    #    `SpecConfig.tree(top_k, depth, total_tokens)` or "auto" choose yourself. The prompt
    #    is rendered with the model's chat template.
    (result,) = eaglejax.generate([args.prompt], target=target, draft=draft,
                                  max_new_tokens=args.max_new_tokens)

    # 4. What came out, and how well the head predicted the target. Times exclude the
    #    compilation of the first call.
    m = result.metrics
    print(result.text)
    print(f"speculation: {m.speculative}")
    print(f"acceptance length: {m.acceptance_length:.2f} tokens per target forward "
          f"({m.verify_rounds} rounds)")
    print(f"decoding: {m.decode_tokens_per_s:.1f} tok/s, {m.new_tokens} new tokens "
          f"(compile {m.compile_s:.1f} s, excluded)")
    return result


if __name__ == "__main__":
    main()
