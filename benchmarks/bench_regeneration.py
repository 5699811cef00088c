"""Throughput of regenerating ShareGPT assistant turns with SmolLM2 (training data for a
self-distilled head): generated tokens per second over the first N conversations.

    python benchmarks/bench_regeneration.py [--conversations 16] [--temperature 0.8]
        [--max-new-tokens 512] [--max-context 1024] [--slots 16]

Without setting flags it runs `RegenConfig()`'s defaults, so the same command measures an
older checkout too. Writes into a fresh temporary cache (nothing is reused); prints JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time

import eaglejax
from eaglejax.datasets import shared_datasets_dir
from eaglejax.hardware import cpu_model
from eaglejax.training.data import read_conversations
from eaglejax.training.regenerate import RegenConfig, regenerate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--max-context", type=int)
    parser.add_argument("--slots", type=int, dest="num_slots")
    args = parser.parse_args()
    chosen = {k: v for k, v in vars(args).items() if v is not None and k != "conversations"}
    config = dataclasses.replace(RegenConfig(), **chosen)
    target = eaglejax.load_target("smollm2-135m-instruct")
    data = shared_datasets_dir() / "sharegpt" / "sharegpt_v3.jsonl.gz"
    conversations = read_conversations(data, args.conversations)
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        out = regenerate(conversations, target, "bench", config, cache, progress=False)
        seconds = time.perf_counter() - start
    replies = [text for c in out for role, text in c.messages if role == "assistant"]
    tokens = sum(len(target.tokenizer.encode(text)) for text in replies)
    print(json.dumps({"cpu": cpu_model(), "machine": platform.machine(),
                      "settings": dataclasses.asdict(config), "conversations": len(out),
                      "replies": len(replies), "tokens": tokens, "seconds": round(seconds, 1),
                      "tokens_per_s": round(tokens / seconds, 1)}))


if __name__ == "__main__":
    main()
