"""The `eaglejax` command line: generate, bench, convert."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence

from eaglejax.errors import EaglejaxError

DEFAULT_MODEL = "smollm2-135m-instruct"


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="built-in name, GGUF file, Hugging Face directory or eaglejax "
                             f"checkpoint (default: {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="render prompts with the model's chat template (default: on)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft", default=None,
                        help="draft head for speculative decoding (any layout load_draft reads)")
    parser.add_argument("--num-draft-tokens", type=int, default=5,
                        help="draft tokens per speculative round (default 5)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglejax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text (several run as one batch)")
    _add_model_args(gen)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 (default) is off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")

    bench = commands.add_parser("bench", help="decoding speed on MT-bench first turns")
    _add_model_args(bench)
    bench.add_argument("--batch-size", type=int, default=1)
    bench.add_argument("--num-prompts", type=int, default=16,
                       help="first N MT-bench questions (default 16; 80 is all)")
    bench.add_argument("--questions", default=None,
                       help="MT-bench question.jsonl (default: ../shared/datasets/mt_bench)")
    bench.add_argument("--stop-at-eos", action="store_true",
                       help="stop rows at EOS (default: always decode max-new-tokens)")

    convert = commands.add_parser("convert", help="convert a draft head between checkpoint layouts")
    convert.add_argument("src", help="draft head directory: EAGLE-1/2, EAGLE-3 (reference, "
                                     "SpecForge, speculators) or eaglejax")
    convert.add_argument("dst", help="new (or empty) output directory")
    convert.add_argument("--target", required=True,
                         help="the head's target model: built-in name, GGUF file, Hugging Face "
                              "directory or eaglejax checkpoint")
    convert.add_argument("--to", default="eaglejax",
                         choices=["eaglejax", "reference", "speculators"],
                         help="output layout (default: eaglejax)")
    convert.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                         help="parameter dtype (default: the target's)")
    return parser


def _generate(args: argparse.Namespace) -> None:
    from eaglejax import generate, load_target

    from eaglejax.decoding.speculative import SpecConfig

    target = load_target(args.model, dtype=args.dtype)
    results = generate(args.prompts, target=target, draft=_load_draft(args, target),
                       speculative=SpecConfig(args.num_draft_tokens),
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, chat=args.chat,
                       stop=args.stop, ignore_eos=args.ignore_eos)
    if args.json:
        print(json.dumps([{"text": r.text, "token_ids": r.token_ids,
                           "finish_reason": r.finish_reason,
                           "metrics": dataclasses.asdict(r.metrics)} for r in results], indent=2))
        return
    for r in results:
        if len(results) > 1:
            print("-" * 40)
        print(r.text)
        m = r.metrics
        al = f", AL {m.acceptance_length:.2f}" if m.acceptance_length else ""
        print(f"[{m.new_tokens} tokens, finish: {r.finish_reason}, prefill {m.prefill_s:.3f} s, "
              f"decode {m.decode_tokens_per_s:.1f} tok/s{al}]", file=sys.stderr)


def _load_draft(args: argparse.Namespace, target):
    """The --draft head for `target`; `random` is a freshly initialised EAGLE-3 head (its
    acceptance is near 1: it measures the speculative loop's own overhead)."""
    if args.draft is None:
        return None
    from eaglejax.draft import load_draft
    from eaglejax.draft.draft import new_eagle3_draft

    if args.draft == "random":
        return new_eagle3_draft(target)
    return load_draft(args.draft, target=target)


def _bench(args: argparse.Namespace) -> None:
    from eaglejax import load_target
    from eaglejax.bench import bench_plain, bench_speculative
    from eaglejax.datasets import mt_bench_questions

    if args.batch_size < 1 or args.num_prompts < 1:
        raise EaglejaxError("--batch-size and --num-prompts must be >= 1")
    target = load_target(args.model, dtype=args.dtype)
    questions = mt_bench_questions(args.questions)[:args.num_prompts]
    common = dict(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                  chat=args.chat, ignore_eos=not args.stop_at_eos)
    draft = _load_draft(args, target)
    if draft is None:
        report = bench_plain(target, questions, **common)
    else:
        report = bench_speculative(target, draft, questions,
                                   num_draft_tokens=args.num_draft_tokens, **common)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        print(f"{key:>26}: {value:.3f}" if isinstance(value, float) else f"{key:>26}: {value}")


def _convert(args: argparse.Namespace) -> None:
    from eaglejax import load_target
    from eaglejax.draft import load_draft
    from eaglejax.draft.formats import WRITERS

    target = load_target(args.target, dtype=args.dtype)
    draft = load_draft(args.src, target=target)
    out = WRITERS[args.to](draft, args.dst)
    c = draft.config
    print(f"wrote {out} ({args.to} layout; {c.kind} head, {c.decoder.num_layers} layer(s), "
          f"draft vocab {c.draft_vocab_size}, taps {list(c.tap_layers)})")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        {"generate": _generate, "bench": _bench, "convert": _convert}[args.command](args)
    except EaglejaxError as err:
        print(f"eaglejax: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
