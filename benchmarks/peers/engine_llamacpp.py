"""llama.cpp (llama-cpp-python) in the peer harness, on the Q4_1 GGUF itself (llama.cpp
computes in Q4_1; eaglejax dequantises the same file to float32): plain greedy decoding and
llama-cpp-python's prompt-lookup decoding (`LlamaPromptLookupDecoding`), batch 1 only.

Timing: every yielded token is timestamped; decode = tokens after the first over the time
from the first to the last. AL = decode tokens per `eval` call after the first (1.0 plain).

    python engine_llamacpp.py JOB.json OUT.json
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as llama_c
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from common import EmissionClock, Recorder, read_job, timed_set

NO_BATCH = ("llama-cpp-python's Llama decodes one sequence per context (generate and "
            "create_completion take one prompt); it has no batched generation API")


def without_extra_buffer_types() -> None:
    """Load models with `use_extra_bufts=False`: no AMX / repacked weight buffers."""
    default = llama_c.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    llama_c.llama_model_default_params = params


def probe(gguf: str) -> None:
    """Evaluate a 4-token batch (a prompt-sized matmul), then exit: run in a child process,
    since where AMX tiles are advertised but unusable (some VMs) ggml's AMX path crashes."""
    llm = Llama(model_path=gguf, n_ctx=64, verbose=False)
    llm.eval([1, 2, 3, 4])


def main(job_path: str, out: str) -> None:
    job = read_job(job_path)
    gguf, n = job["paths"]["gguf"], job["max_new_tokens"]
    threads = job.get("threads") or os.cpu_count() or 1
    longest = max(len(p["ids"]) for ps in job["prompt_sets"].values() for p in ps)
    info: dict[str, Any] = {"llama_cpp_python": llama_cpp.__version__, "threads": threads,
                            "target": gguf, "dtype": "Q4_1"}
    check = subprocess.run([sys.executable, __file__, "--probe", gguf], capture_output=True)
    if check.returncode:
        without_extra_buffer_types()
        info["note"] = (f"a multi-token eval with llama.cpp's extra buffer types (AMX on this "
                        f"CPU) crashed (exit {check.returncode}); ran with "
                        f"use_extra_bufts=False (plain CPU kernels)")
    rec = Recorder(out, "llama.cpp", info)
    modes: dict[str, Any] = {"plain": None}
    for k in job["ks"]:
        modes[f"prompt lookup {k}"] = k
    for mode, k in modes.items():
        try:
            draft = None if k is None else LlamaPromptLookupDecoding(num_pred_tokens=k)
            llm = Llama(model_path=gguf, n_ctx=longest + n + 64, n_threads=threads,
                        n_threads_batch=threads, draft_model=draft, verbose=False)
        except Exception as err:  # noqa: BLE001 - reported as a failed row
            for set_name in job["prompt_sets"]:
                for batch in job["batch_sizes"]:
                    rec.failed(mode, set_name, batch, err)
            continue
        evals = [0]
        plain_eval = llm.eval

        def counted_eval(tokens: Any, _eval: Any = plain_eval) -> None:
            evals[0] += 1
            _eval(tokens)

        llm.eval = counted_eval  # type: ignore[method-assign]
        counts = {"evals": 0, "tokens": 0}

        def run(rows: list[list[int]], llm: Llama = llm
                ) -> tuple[list[list[int]], tuple[int, float]]:
            (prompt,) = rows
            llm.reset()  # no prefix reuse from the previous prompt
            clock, new = EmissionClock(1), []
            evals[0] = 0
            for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                      repeat_penalty=1.0, reset=True):
                clock.emit(0, 1)
                new.append(int(token))
                if len(new) == n:  # EOS is not checked by generate(): exactly n tokens
                    break
            counts["evals"] += evals[0] - 1
            counts["tokens"] += n - 1
            return [new], clock.timing()

        for set_name, prompts in job["prompt_sets"].items():
            for batch in job["batch_sizes"]:
                if batch > 1:
                    rec.na(mode, set_name, batch, NO_BATCH)
                    continue
                try:
                    counts.update(evals=0, tokens=0)
                    row = timed_set(run, prompts, 1)
                    al = counts["tokens"] / counts["evals"] if counts["evals"] else None
                    rec.add(mode=mode, prompt_set=set_name, batch=batch, status="ok",
                            acceptance_length=al, **row)
                except Exception as err:  # noqa: BLE001
                    rec.failed(mode, set_name, batch, err)
        del llm


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        probe(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
