"""eaglejax in the peer harness (project venv): plain decoding (in each weight storage the
job names, the first also speculating), EAGLE-3 chains of K draft
tokens with the shipped head, and the same chains replaced by a prompt-lookup copy where
the context's last 3 tokens occurred before, timed interleaved per prompt set and batch size by
`eaglejax.bench.run_interleaved` (warm-up pass over every batch first; decode tokens /
decode seconds, the prefill's first token excluded; EOS ignored).

    python engine_eaglejax.py JOB.json OUT.json
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import numpy as np

import eaglejax
from eaglejax.bench import run_interleaved
from eaglejax.draft.shipped import shipped_head
from eaglejax.hardware import machine_report

from common import Recorder, read_job


@dataclasses.dataclass(frozen=True)
class TokenPrompt:
    """`run_interleaved`'s question, holding rendered token ids instead of text."""
    question_id: int
    category: str
    prompt: list[int]


def acceptance_length(results: list[Any]) -> float:
    """AL pooled over rows, as vLLM pools its counters: tokens produced in rounds / rounds,
    each row with its own rounds (`GenerationMetrics.verify_rounds`)."""
    rounds = [r.metrics.verify_rounds for r in results]
    produced = [r.metrics.acceptance_length * n for r, n in zip(results, rounds)]
    return float(sum(produced) / sum(rounds))


def main(job_path: str, out: str) -> None:
    job = read_job(job_path)
    model = job["paths"].get("eaglejax_target", "smollm2-135m-instruct")
    storages = job.get("eaglejax_storages", ["auto"])
    targets = [eaglejax.load_target(model, weight_dtype=s) for s in storages]
    target = targets[0]  # the first storage speculates too
    head = job["paths"].get("eaglejax_head") or shipped_head("smollm2-135m-instruct")
    draft = eaglejax.load_draft(str(head), target=target)
    info = {"eaglejax": eaglejax.__version__,
            "target": target.source, "dtype": str(np.dtype(target.dtype)),
            "storage": {s: t.storage for s, t in zip(storages, targets)},
            "head": str(head), "machine": machine_report()}
    rec = Recorder(out, "eaglejax", info)
    n = job["max_new_tokens"]
    common = dict(target=target, max_new_tokens=n, ignore_eos=True, temperature=0.0)
    runs = {"plain": functools.partial(eaglejax.generate, **common)}
    for storage, other in zip(storages[1:], targets[1:]):
        runs[f"plain ({storage})"] = functools.partial(eaglejax.generate,
                                                       **dict(common, target=other))
    for k in job["ks"]:
        chain = eaglejax.SpecConfig.chain(k)
        runs[f"eagle3 K={k}"] = functools.partial(
            eaglejax.generate, draft=draft, speculative=chain, **common)
        # the chain, or where the context's last 3 tokens occurred before, the K tokens
        # that followed them there (eaglejax's prompt lookup rides on a head's draft)
        runs[f"eagle3 K={k} or lookup"] = functools.partial(
            eaglejax.generate, draft=draft, speculative=chain.with_lookup(k, replaces=True),
            **common)
    for set_name, prompts in job["prompt_sets"].items():
        questions = [TokenPrompt(p["id"], p["category"], p["ids"]) for p in prompts]
        for batch in job["batch_sizes"]:
            try:
                totals = run_interleaved(questions, batch, runs)
            except Exception as err:  # noqa: BLE001 - reported as a failed row
                for mode in runs:
                    rec.failed(mode, set_name, batch, err)
                continue
            for mode, t in totals.items():
                results = t["results"]
                rec.add(mode=mode, prompt_set=set_name, batch=batch, status="ok",
                        decode_tokens=t["decode_tokens"], decode_s=t["decode_s"],
                        tokens_per_s=t["decode_tokens"] / t["decode_s"],
                        acceptance_length=(acceptance_length(results)
                                           if not mode.startswith("plain") else 1.0),
                        outputs=[list(map(int, r.token_ids)) for r in results])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
