"""Plain greedy decoding: eaglejax vs Hugging Face transformers `generate()`, side by side.

Both decode the same MT-bench first turns (chat template applied) with the same weights
(SmolLM2-135M-Instruct from its GGUF, float32) for exactly --max-new-tokens tokens, batch 1.
The two systems alternate prompt by prompt so machine noise hits both alike. Also reports
eaglejax batch-8 throughput, the time of one jitted single-token forward, the machine (CPU
model, cores, measured copy bandwidth) and the decode step's ratio to its memory floor
(bytes one step reads / bandwidth). With --weight-dtype bfloat16 (the default) a third
column runs eaglejax with 16-bit weight storage under float32 compute in the same rotation.

    python benchmarks/bench_vs_transformers.py --num-prompts 8 [--json]
Needs the test extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import eaglejax
from eaglejax.bench import bench_plain, decode_step_bytes
from eaglejax.timing import single_forward_ms
from eaglejax.datasets import mt_bench_questions
from eaglejax.hardware import machine_report, memory_floor_ms
from eaglejax.loading.builtin import resolve_builtin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # hf_oracle
from hf_oracle import transformers_model_from_gguf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--weight-dtype", default="bfloat16", choices=["bfloat16", "none"],
                        help="also time eaglejax with weights stored in this dtype")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    hf = transformers_model_from_gguf(resolve_builtin("smollm2-135m-instruct"))
    hf.generation_config.eos_token_id = None  # decode exactly max_new_tokens, like ignore_eos
    target = eaglejax.load_target("smollm2-135m-instruct")
    questions = mt_bench_questions()[:args.num_prompts]
    prompts = [target.tokenizer.render_prompt(q.prompt, chat=True) for q in questions]
    n = args.max_new_tokens

    def run_hf(ids: list[int]) -> float:
        x = torch.tensor([ids])
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        assert out.shape[1] - x.shape[1] == n
        return time.perf_counter() - start

    stored = None if args.weight_dtype == "none" else target.with_weight_dtype(args.weight_dtype)
    decode_s: dict[str, list[float]] = {"float32": [], "stored": []}

    def run_ej(ids: list[int], model=target, name: str = "float32") -> float:
        start = time.perf_counter()
        (result,) = eaglejax.generate([ids], target=model, max_new_tokens=n, ignore_eos=True)
        assert len(result.token_ids) == n
        decode_s[name].append(result.metrics.decode_s)
        return time.perf_counter() - start

    for ids in prompts:  # warm-up: compile every prompt-length bucket, warm torch
        run_ej(ids)
        if stored is not None:
            run_ej(ids, stored, "stored")
    run_hf(prompts[0])
    hf_s, ej_s, stored_s = [], [], []
    decode_s = {"float32": [], "stored": []}
    for ids in prompts:
        hf_s.append(run_hf(ids))
        ej_s.append(run_ej(ids))
        if stored is not None:
            stored_s.append(run_ej(ids, stored, "stored"))
    total = n * len(prompts)
    context = int(np.mean([len(p) for p in prompts])) + n // 2
    machine = machine_report()
    machine["torch_threads"] = torch.get_num_threads()
    step_ms = 1e3 * sum(decode_s["float32"]) / ((n - 1) * len(prompts))
    floor_ms = memory_floor_ms(decode_step_bytes(target, context),
                               machine["copy_bandwidth_gb_s"])
    report = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine, "prompts": len(prompts),
        "max_new_tokens": n,
        "transformers_tokens_per_s": total / sum(hf_s),
        "eaglejax_tokens_per_s": total / sum(ej_s),
        "speedup": sum(hf_s) / sum(ej_s),
        "eaglejax_single_forward_ms": single_forward_ms(target, context, 384),
        "eaglejax_ms_per_token": 1e3 * sum(ej_s) / total,  # prefill included
        "eaglejax_decode_ms_per_step": step_ms,
        "memory_floor_ms": floor_ms,
        "step_over_memory_floor": step_ms / floor_ms,
    }
    report["decode_step_over_forward"] = step_ms / report["eaglejax_single_forward_ms"]
    if stored is not None:
        stored_step_ms = 1e3 * sum(decode_s["stored"]) / ((n - 1) * len(prompts))
        stored_floor_ms = memory_floor_ms(decode_step_bytes(stored, context),
                                          machine["copy_bandwidth_gb_s"])
        report[f"{args.weight_dtype}_weights"] = {
            "tokens_per_s": total / sum(stored_s),
            "speedup_over_transformers": sum(hf_s) / sum(stored_s),
            "speedup_over_float32": sum(ej_s) / sum(stored_s),
            "decode_ms_per_step": stored_step_ms, "memory_floor_ms": stored_floor_ms,
            "step_over_memory_floor": stored_step_ms / stored_floor_ms}
    batch8 = bench_plain(target, questions, batch_size=8, max_new_tokens=n)
    report["eaglejax_batch8_decode_tokens_per_s"] = batch8["decode_tokens_per_s"]
    report["eaglejax_batch8_end_to_end_tokens_per_s"] = batch8["end_to_end_tokens_per_s"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:>40}: {value:.3f}" if isinstance(value, float) else f"{key:>40}: {value}")


if __name__ == "__main__":
    main()
