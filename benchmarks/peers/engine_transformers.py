"""Hugging Face transformers in the peer harness: `generate()` greedy (batches left-padded),
prompt-lookup decoding (`prompt_lookup_num_tokens`, batch 1 only in transformers), and an
attempt at assisted generation with the eaglejax-exported EAGLE-3 head.

Timing: a streamer timestamps every emission; decode = tokens after each row's first
emission over the time from the first emission to the last. AL = decode tokens per target
forward after the first (counted with a forward hook): 1.0 for plain decoding.

    python engine_transformers.py JOB.json OUT.json
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from common import EmissionClock, Recorder, last_line, read_job, timed_set

EAGLE3_REASON = (
    "transformers' assisted generation calls the assistant as a standalone causal LM on token "
    "ids only (AssistedCandidateGenerator -> assistant_model.generate(input_ids)); an EAGLE-3 "
    "head is not one: each step needs the target's hidden states from 3 tapped layers "
    "(its fc projects their concatenation) and it has no embedding or lm_head of the "
    "target's vocabulary, and transformers has no channel to pass target features to an "
    "assistant")


class ClockStreamer(BaseStreamer):
    """Feeds a batch's emissions to an `EmissionClock` (the first put is the prompt)."""

    def __init__(self, clock: EmissionClock) -> None:
        self.clock, self.seen_prompt = clock, False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        if value.dim() == 2:  # assisted decoding: [1, accepted + 1]
            for row in range(value.shape[0]):
                self.clock.emit(row, value.shape[1])
        else:  # one token per row
            for row in range(value.shape[0]):
                self.clock.emit(row, 1)

    def end(self) -> None:
        pass


def main(job_path: str, out: str) -> None:
    job = read_job(job_path)
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    hf_dir, n = job["paths"]["hf_target"], job["max_new_tokens"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly n new tokens, as ignore_eos
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    forwards = [0]
    model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    rec = Recorder(out, "transformers", {
        "transformers": transformers.__version__, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "target": hf_dir, "dtype": "float32"})
    counts = {"forwards": 0, "tokens": 0}

    def run(rows: list[list[int]], **kwargs: Any) -> tuple[list[list[int]], tuple[int, float]]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        clock = EmissionClock(len(rows))
        forwards[0] = 0
        with torch.no_grad():
            out_ids = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                     pad_token_id=pad, streamer=ClockStreamer(clock), **kwargs)
        new = out_ids[:, width:].tolist()
        assert all(len(r) == n for r in new), "wrong number of new tokens"
        timing = clock.timing()
        counts["forwards"] += forwards[0] - 1
        counts["tokens"] += timing[0] // len(rows)
        return new, timing

    modes: dict[str, dict[str, Any]] = {"plain": {}}
    for k in job["ks"]:
        modes[f"prompt lookup {k}"] = {"prompt_lookup_num_tokens": k}
    for set_name, prompts in job["prompt_sets"].items():
        for batch in job["batch_sizes"]:
            for mode, kwargs in modes.items():
                if kwargs and batch > 1:
                    rec.na(mode, set_name, batch, "transformers: assisted generate (prompt "
                           "lookup) is only supported for batch_size = 1")
                    continue
                try:
                    counts.update(forwards=0, tokens=0)
                    row = timed_set(lambda rows: run(rows, **kwargs), prompts, batch)
                    al = counts["tokens"] / counts["forwards"] if counts["forwards"] else None
                    rec.add(mode=mode, prompt_set=set_name, batch=batch, status="ok",
                            acceptance_length=al, **row)
                except Exception as err:  # noqa: BLE001 - reported as a failed row
                    rec.failed(mode, set_name, batch, err)
            try:  # EAGLE-3 head as an assistant model: record exactly what happens
                AutoModelForCausalLM.from_pretrained(job["paths"]["head_speculators"])
                error = "it loaded as a causal LM, but cannot be fed the target's features"
            except Exception as err:  # noqa: BLE001
                error = last_line(f"{type(err).__name__}: {err}")
            rec.na("eagle3 assisted", set_name, batch,
                   f"{EAGLE3_REASON} (AutoModelForCausalLM on the exported head: {error})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
