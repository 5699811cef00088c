"""Long prompts: prefill speed against transformers, and the end-to-end time of one long request.

Prefill mode (default) times one greedy prefill of SmolLM2-135M-Instruct (float32, batch 1)
at each --lengths prompt size, eaglejax (`generate` with max_new_tokens=1: its prefill_s,
compiled beforehand) and transformers (one `model(ids, logits_to_keep=1)` forward with
--threads torch threads) side by side, the two alternating repeat by repeat:

    python benchmarks/bench_prefill.py [--lengths 1024 4096 8192] [--repeats 3] [--json]

End-to-end mode runs one request of --prompt-tokens tokens plus --max-new-tokens new ones,
plain or speculative, twice in a fresh process: cold (compilation included) and warm (run
it under `/usr/bin/time -v` for the peak memory):

    python benchmarks/bench_prefill.py --end-to-end plain [--prompt-tokens 8184] [--json]
    python benchmarks/bench_prefill.py --end-to-end spec --draft checkpoints/smollm2-135m-instruct-eagle3

Prompts are MT-bench first turns joined into one text (repeated as needed), cut to length.
Needs the test extra (torch, transformers) for prefill mode.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import eaglejax
from eaglejax.datasets import mt_bench_questions
from eaglejax.target import Target


def long_prompt(target: Target, n_tokens: int) -> list[int]:
    """`n_tokens` token ids of real text (MT-bench questions, repeated as needed)."""
    text = "\n\n".join(q.prompt for q in mt_bench_questions())
    ids = target.tokenizer.encode(text)
    return (ids * (n_tokens // len(ids) + 1))[:n_tokens]


def eaglejax_prefill_s(target: Target, ids: list[int]) -> float:
    (result,) = eaglejax.generate([ids], target=target, max_new_tokens=1, ignore_eos=True)
    return result.metrics.prefill_s


def transformers_prefill_s(model, ids: list[int]) -> float:
    import torch

    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.no_grad():
        model(x, logits_to_keep=1)
    return time.perf_counter() - start


def bench_prefill(lengths: list[int], repeats: int,
                  weight_dtype: str | None = None) -> list[dict[str, float]]:
    from eaglejax.loading.builtin import resolve_builtin
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_oracle import transformers_model_from_gguf

    target = eaglejax.load_target("smollm2-135m-instruct", weight_dtype=weight_dtype)
    hf = transformers_model_from_gguf(resolve_builtin("smollm2-135m-instruct"))
    rows = []
    for n in lengths:
        ids = long_prompt(target, n)
        eaglejax_prefill_s(target, ids)  # compile
        transformers_prefill_s(hf, ids)  # warm up
        ej, tf = [], []
        for _ in range(repeats):
            ej.append(eaglejax_prefill_s(target, ids))
            tf.append(transformers_prefill_s(hf, ids))
        ej_s, tf_s = statistics.median(ej), statistics.median(tf)
        rows.append({"prompt_tokens": n, "eaglejax_s": ej_s, "transformers_s": tf_s,
                     "eaglejax_tokens_per_s": n / ej_s, "transformers_tokens_per_s": n / tf_s,
                     "speedup": tf_s / ej_s})
    return rows


def end_to_end(mode: str, prompt_tokens: int, max_new_tokens: int, draft_path: str | None
               ) -> dict[str, object]:
    """One request twice in this fresh process: cold (compilation included), then warm."""
    target = eaglejax.load_target("smollm2-135m-instruct")
    draft = None
    if mode == "spec":
        if not draft_path:
            raise SystemExit("--end-to-end spec needs --draft HEAD")
        draft = eaglejax.load_draft(draft_path, target=target)
    ids = long_prompt(target, prompt_tokens)
    report: dict[str, object] = {"mode": mode, "prompt_tokens": len(ids)}
    for run in ("cold", "warm"):
        start = time.perf_counter()
        (result,) = eaglejax.generate([ids], target=target, draft=draft,
                                      max_new_tokens=max_new_tokens, ignore_eos=True)
        m = result.metrics
        report.update({f"{run}_total_s": time.perf_counter() - start,
                       f"{run}_compile_s": getattr(m, "compile_s", None),
                       f"{run}_prefill_s": m.prefill_s, f"{run}_decode_s": m.decode_s})
    report.update(new_tokens=m.new_tokens, speculative=m.speculative,
                  acceptance_length=m.acceptance_length, token_ids=result.token_ids)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--end-to-end", choices=("plain", "spec"))
    parser.add_argument("--prompt-tokens", type=int, default=8184)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--draft", help="draft head for --end-to-end spec")
    parser.add_argument("--weight-dtype", default=None,
                        help="eaglejax's weight storage in prefill mode, e.g. gguf or int8 "
                             "(default: float32, as loaded)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    machine = f"{platform.machine()} {platform.processor() or ''}".strip()
    if args.end_to_end:
        report = {"machine": machine, **end_to_end(args.end_to_end, args.prompt_tokens,
                                                   args.max_new_tokens, args.draft)}
    else:
        import torch

        torch.set_num_threads(args.threads)
        report = {"machine": f"{machine}, {args.threads} torch threads",
                  "rows": bench_prefill(args.lengths, args.repeats, args.weight_dtype)}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if key != "rows":
            print(f"{key}: {value}")
    for row in report.get("rows", []):
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()))


if __name__ == "__main__":
    main()
