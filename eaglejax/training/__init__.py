"""Draft-head training (EAGLE-3, P-EAGLE): data, draft vocabulary, training-time test, trainer.

data.py (conversations -> token ids + assistant loss mask -> packed rows),
regenerate.py (assistant turns resampled from the target, cached), vocab.py (draft
vocabulary and coverage), ttt.py (the unrolled head and its loss), trainer.py (AdamW,
jitted step, orbax checkpoints, evaluation), run.py (the run directory), pipeline.py
(what `eaglejax train-draft` runs before training).
"""

from eaglejax.training.data import PackedRows, pack, read_conversations, tokenize_all
from eaglejax.training.pipeline import mt_bench_prompts, prepare_rows
from eaglejax.training.regenerate import RegenConfig
from eaglejax.training.trainer import TrainConfig, TrainResult, train
from eaglejax.training.vocab import DraftVocab, select_draft_vocab

__all__ = [
    "DraftVocab", "PackedRows", "RegenConfig", "TrainConfig", "TrainResult", "mt_bench_prompts",
    "pack", "prepare_rows", "read_conversations", "select_draft_vocab",
    "tokenize_all", "train",
]
