"""The two prompt sets of the peer harness, rendered once with the target's chat template so
every engine decodes the same token ids.

- `mt_bench`: MT-bench first turns, round-robin over its 8 categories.
- `mix`: a Spec-Bench-style mix built only from ../shared/datasets (a stand-in, not
  Spec-Bench): MT-bench's coding, math, extraction and writing first turns, plus ShareGPT
  first turns that ask to summarise a given text (`summarization`) or to answer or write
  from a given text (`qa`), picked by a keyword filter (`SUMMARY`, `QA` below) among
  turns of 600-2500 characters without code blocks, in file order.
"""

from __future__ import annotations

import gzip
import json
import re
from typing import Any

from eaglejax.datasets import (Question, interleave_categories, mt_bench_questions,
                               shared_datasets_dir)
from eaglejax.target import Target

SUMMARY = re.compile(r"(?<!t )(?<!not )\b(summari[sz]e|summary of|tl;?dr)\b", re.I)
QA = re.compile(r"(based on (the|this) (following |above |given )?(text|passage|article|"
                r"paragraph|document|information)|according to the (text|passage|article|"
                r"paragraph)|(read|given) the (following|above) (text|passage|article|"
                r"paragraph)|answer the (following )?questions?)", re.I)
MIX_MT_BENCH = ("coding", "extraction", "math", "writing")
MIX_ORDER = ("summarization", "coding", "qa", "extraction", "math", "writing")


def sharegpt_text_tasks(per_kind: int) -> list[Question]:
    """Up to `per_kind` ShareGPT first turns each of kind `summarization` and `qa`, whose
    instruction (in the first or last 250 characters) matches the keyword filter."""
    path = shared_datasets_dir() / "sharegpt" / "sharegpt_v3.jsonl.gz"
    found: dict[str, list[Question]] = {"summarization": [], "qa": []}
    with gzip.open(path, "rt") as f:
        for i, line in enumerate(f):
            text = json.loads(line)["conversations"][0]["value"]
            if not 600 <= len(text) <= 2500 or "```" in text:
                continue
            ends = (text[:250], text[-250:])
            kind = ("summarization" if any(SUMMARY.search(e) for e in ends) else
                    "qa" if any(QA.search(e) for e in ends) else None)
            if kind and len(found[kind]) < per_kind:
                found[kind].append(Question(100000 + i, kind, text))
            if all(len(v) >= per_kind for v in found.values()):
                break
    return found["summarization"] + found["qa"]


def mix_questions(count: int) -> list[Question]:
    """`count` mix prompts, round-robin over `MIX_ORDER` (any prefix is balanced)."""
    pool = [q for q in mt_bench_questions() if q.category in MIX_MT_BENCH]
    pool += sharegpt_text_tasks(count)
    by_category = {c: [q for q in pool if q.category == c] for c in MIX_ORDER}
    return interleave_categories([q for c in MIX_ORDER for q in by_category[c]])[:count]


def prompt_sets(target: Target, count_mt_bench: int, count_mix: int
                ) -> dict[str, list[dict[str, Any]]]:
    """{set name: [{id, category, text (rendered), ids}]} for both prompt sets."""
    sets = {"mt_bench": interleave_categories(mt_bench_questions())[:count_mt_bench],
            "mix": mix_questions(count_mix)}
    rendered: dict[str, list[dict[str, Any]]] = {}
    for name, questions in sets.items():
        rendered[name] = []
        for q in questions:
            ids = [int(t) for t in target.tokenizer.render_prompt(q.prompt, chat=True)]
            text = target.tokenizer.decode(ids, skip_special_tokens=False)
            rendered[name].append({"id": q.question_id, "category": q.category,
                                   "text": text, "ids": ids})
    return rendered
