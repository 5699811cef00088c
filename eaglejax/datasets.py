"""Evaluation and training data read from the shared data folder (never copied into the repo)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from eaglejax.errors import InputError

_REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_datasets_dir() -> Path:
    """`$EAGLEJAX_DATASETS`, else `../shared/datasets` beside the current directory or the repo."""
    env = os.environ.get("EAGLEJAX_DATASETS")
    candidates = [Path(env)] if env else []
    candidates += [Path.cwd().parent / "shared" / "datasets", _REPO_ROOT.parent / "shared" / "datasets"]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise InputError("shared datasets folder not found: set EAGLEJAX_DATASETS or place it at "
                     + " or ".join(str(c) for c in candidates))


@dataclasses.dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    prompt: str


def mt_bench_questions(path: str | Path | None = None) -> list[Question]:
    """MT-bench first turns, in file order (80 questions, 8 categories)."""
    path = Path(path) if path else shared_datasets_dir() / "mt_bench" / "question.jsonl"
    if not path.is_file():
        raise InputError(f"{path}: MT-bench question file not found")
    questions = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                questions.append(Question(int(item["question_id"]), str(item["category"]),
                                          str(item["turns"][0])))
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as err:
                raise InputError(f"{path}:{line_no}: not an MT-bench question ({err})") from None
    return questions


def interleave_categories(questions: list[Question]) -> list[Question]:
    """Reorder questions round-robin over their categories (first one of each category,
    then the second of each, ...), so any prefix is balanced across categories."""
    by_category: dict[str, list[Question]] = {}
    for question in questions:
        by_category.setdefault(question.category, []).append(question)
    depth = max(len(group) for group in by_category.values())
    return [group[i] for i in range(depth) for group in by_category.values() if i < len(group)]
