"""Accuracy of quantized weight storage against float32 storage (issue 34): teacher-forced on
ShareGPT conversations (chat template, the first `--tokens` tokens of the first
`--conversations` at least that long), every position scored by each storage: agreement of
its top-1 token with float32 storage's, mean KL(float32 || storage) and perplexity of the
conversation's own next tokens. Storages: float32, bfloat16, int8, int4, int4-sym and the
GGUF file's own blocks ("gguf"), each loaded with `load_target(..., weight_dtype=)`.

    EAGLEJAX_DATASETS=../shared/datasets python benchmarks/bench_quant_accuracy.py
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import eaglejax
from eaglejax.datasets import shared_datasets_dir
from eaglejax.hardware import machine_report
from eaglejax.training.data import read_conversations, render_messages

STORAGES = ("float32", "bfloat16", "int8", "int4", "int4-sym", "gguf")


def token_rows(tokenizer, count: int, length: int) -> np.ndarray:
    """[count, length] ids: the first `length` tokens of the first `count` ShareGPT
    conversations whose rendering is at least that long."""
    path = shared_datasets_dir() / "sharegpt" / "sharegpt_v3.jsonl.gz"
    rows = []
    for conversation in read_conversations(path, 20 * count):
        ids = tokenizer.encode(render_messages(tokenizer, conversation.messages, False))
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == count:
            return np.asarray(rows, np.int32)
    raise SystemExit(f"{path}: fewer than {count} conversations of {length} tokens")


@jax.jit
def log_probs(logits: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def scores(target, rows: np.ndarray, batch: int) -> list[np.ndarray]:
    """Per batch of rows, the log-probabilities [B, T - 1, V] of the next tokens."""
    return [np.asarray(log_probs(target.logits(rows[i:i + batch])[:, :-1]))
            for i in range(0, len(rows), batch)]


def compare(reference: list[np.ndarray], got: list[np.ndarray], rows: np.ndarray,
            batch: int) -> dict:
    """Top-1 agreement with `reference`, mean KL(reference || got), perplexity."""
    agree, kl, nll, count = 0, 0.0, 0.0, 0
    for i, (ref, lp) in enumerate(zip(reference, got)):
        nxt = rows[i * batch:(i + 1) * batch, 1:]
        agree += int(np.sum(ref.argmax(-1) == lp.argmax(-1)))
        kl += float(np.sum(np.exp(ref) * (ref - lp)))
        nll -= float(np.sum(np.take_along_axis(lp, nxt[..., None], -1)))
        count += nxt.size
    return {"top1_agreement": agree / count, "mean_kl": kl / count,
            "perplexity": float(np.exp(nll / count)), "positions": count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--storages", nargs="+", default=list(STORAGES), choices=STORAGES)
    args = parser.parse_args()
    reference, rows, results = None, None, {}
    for storage in ("float32", *[s for s in args.storages if s != "float32"]):
        start = time.perf_counter()
        target = eaglejax.load_target(args.model, weight_dtype=storage)
        if rows is None:
            rows = token_rows(target.tokenizer, args.conversations, args.tokens)
        got = scores(target, rows, args.batch)
        reference = got if reference is None else reference
        results[storage] = {"storage": target.storage,
                            **compare(reference, got, rows, args.batch),
                            "seconds": round(time.perf_counter() - start, 1)}
        print(json.dumps({storage: results[storage]}), flush=True)
    print("| storage | top-1 agreement | mean KL | perplexity |\n|---|---:|---:|---:|")
    for storage, r in results.items():
        print(f"| {storage} ({r['storage']}) | {100 * r['top1_agreement']:.1f}% | "
              f"{r['mean_kl']:.4f} | {r['perplexity']:.2f} |")
    print(json.dumps({"machine": machine_report(bandwidth=False), "conversations": args.conversations,
                      "tokens": args.tokens, "positions": results["float32"]["positions"]}))


if __name__ == "__main__":
    main()
