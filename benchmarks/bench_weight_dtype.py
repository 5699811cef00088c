"""Float32 weights against narrower storage under float32 compute (16-bit, int8, 4-bit
blocks, a GGUF file's own blocks), side by side.

Speed: one jitted target forward of 1 token (a plain decode step) and of 6 tokens (a K=5
chain's verification), the two storages alternating, plus plain greedy decoding of the
same MT-bench first turns. Exactness: greedy agreement with float32 over many prompts,
as (a) teacher-forced top-1 agreement (the 16-bit model scores float32's own output; the
share of positions whose argmax is float32's token), (b) free-running outputs identical
to float32's, and the mean length of the common prefix.

    python benchmarks/bench_weight_dtype.py --num-prompts 40 --max-new-tokens 64 --json
    python benchmarks/bench_weight_dtype.py --weight-dtype bfloat16 int8 int4 int4-sym gguf
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import eaglejax
from eaglejax.bench import decode_step_bytes
from eaglejax.timing import single_forward_ms
from eaglejax.datasets import interleave_categories, mt_bench_questions
from eaglejax.hardware import machine_report, memory_floor_ms


def forward_times(targets: dict, tokens: int, rounds: int, context: int = 200) -> dict:
    """Median single-forward ms per storage, measured in alternation."""
    times: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(rounds):
        for name, target in targets.items():
            times[name].append(single_forward_ms(target, context, 512, tokens=tokens,
                                                 repeats=10))
    return {name: float(np.median(t)) for name, t in times.items()}


def decode_speed(targets: dict, prompts: list[str], max_new_tokens: int) -> dict:
    """Plain greedy decode tokens/s per storage (one warm-up, then alternating prompts)."""
    for target in targets.values():
        eaglejax.generate(prompts[:1], target=target, max_new_tokens=max_new_tokens,
                          ignore_eos=True)
    tokens = {name: 0 for name in targets}
    seconds = {name: 0.0 for name in targets}
    for prompt in prompts:
        for name, target in targets.items():
            result = eaglejax.generate([prompt], target=target, max_new_tokens=max_new_tokens,
                                       ignore_eos=True)[0]
            tokens[name] += result.metrics.new_tokens - 1
            seconds[name] += result.metrics.decode_s
    return {name: tokens[name] / seconds[name] for name in targets}


def agreement(reference, candidate, prompts: list[list[int]], max_new_tokens: int,
              batch_size: int) -> dict:
    """Greedy agreement of `candidate` with `reference` on token-id `prompts`."""
    forced_hits = forced_total = identical = 0
    prefixes = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        want = eaglejax.generate(batch, target=reference, max_new_tokens=max_new_tokens,
                                 ignore_eos=True)
        got = eaglejax.generate(batch, target=candidate, max_new_tokens=max_new_tokens,
                                ignore_eos=True)
        for ids, w, g in zip(batch, want, got):
            sequence = list(ids) + list(w.token_ids)
            logits = np.asarray(candidate.logits([sequence]))[0]
            start = len(ids) - 1
            predicted = logits[start:start + len(w.token_ids)].argmax(-1)
            forced_hits += int(np.sum(predicted == np.asarray(w.token_ids)))
            forced_total += len(w.token_ids)
            identical += w.token_ids == g.token_ids
            common = next((k for k, (a, b) in enumerate(zip(w.token_ids, g.token_ids))
                           if a != b), len(w.token_ids))
            prefixes.append(common)
    return {"teacher_forced_top1_agreement": forced_hits / forced_total,
            "identical_outputs": identical / len(prompts),
            "mean_common_prefix_tokens": float(np.mean(prefixes)),
            "prompts": len(prompts), "new_tokens": max_new_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--weight-dtype", nargs="+", default=["bfloat16"],
                        choices=["bfloat16", "float16", "int8", "int4", "int4-sym", "gguf"],
                        help="storages measured beside float32 (gguf: the file's blocks)")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--speed-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    start = time.time()
    full = eaglejax.load_target(args.model)
    targets = {"float32": full}
    for name in args.weight_dtype:
        targets[name] = eaglejax.load_target(args.model, weight_dtype=name) if name == "gguf" \
            else full.with_weight_dtype(name)
    questions = interleave_categories(mt_bench_questions())
    prompts = [full.tokenizer.render_prompt(q.prompt, chat=True)
               for q in questions[:args.num_prompts]]
    machine = machine_report()
    report = {
        "date": time.strftime("%Y-%m-%d"), "model": full.source, "machine": machine,
        "forward_1_token_ms": forward_times(targets, 1, args.rounds),
        "forward_6_tokens_ms": forward_times(targets, 6, args.rounds),
        "decode_tokens_per_s": decode_speed(targets, prompts[:args.speed_prompts],
                                            args.max_new_tokens),
        "memory_floor_ms": {name: memory_floor_ms(decode_step_bytes(t, 200),
                                                  machine["copy_bandwidth_gb_s"])
                            for name, t in targets.items()},
        "agreement": {name: agreement(full, targets[name], prompts, args.max_new_tokens,
                                      args.batch_size) for name in args.weight_dtype},
    }
    report["wall_s"] = round(time.time() - start, 1)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
