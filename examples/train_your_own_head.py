"""Train an EAGLE-3 draft head on your own chat data, then export it for vLLM.

    python examples/train_your_own_head.py my_chats.jsonl \
        [--target meta-llama/Llama-3.1-8B-Instruct] [--out runs/my-head] [--steps 2000] \
        [--seq-len 1024] [--batch-size 4] [--lr 1e-4] [--ttt-length 7] \
        [--draft-vocab-size 32000]

`my_chats.jsonl` holds one conversation per line, in the OpenAI messages shape

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}

or ShareGPT's (`{"conversations": [{"from": "human", "value": "..."}, ...]}`). Each is
rendered with the target's chat template; the head learns to predict the assistant turns
(the loss covers those tokens only) from the frozen target's hidden states, unrolled over
its own predictions (training-time test). The run directory OUT holds checkpoints (run the
same command again to resume), `log.jsonl` and the head in eaglejax format (`OUT/head`,
for `eaglejax generate --draft OUT/head`). The head is then written in the speculators
layout (`OUT/speculators`), which vLLM loads as an EAGLE-3 drafter; the script prints the
`vllm serve` command. `eaglejax train-draft` and `eaglejax convert --to speculators` do the
same from the command line.

CI runs it on a tiny random model and three conversations, for two steps:

    python examples/train_your_own_head.py chats.jsonl --target TINY_MODEL --out OUT \
        --steps 2 --seq-len 32 --batch-size 2 --ttt-length 2 --draft-vocab-size 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import eaglejax
from eaglejax.draft import export_speculators
from eaglejax.training import TrainConfig, prepare_rows, train


def to_sharegpt(source: Path, destination: Path) -> Path:
    """The conversations of `source` in the ShareGPT shape the trainer reads: records in the
    OpenAI messages shape are converted, ShareGPT ones copied as they are."""
    with open(source, encoding="utf-8") as f, open(destination, "w", encoding="utf-8") as out:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "messages" in record:
                record = {"id": record.get("id", f"{source.name}:{line_no}"),
                          "conversations": [{"from": m["role"], "value": m["content"]}
                                            for m in record["messages"]]}
            out.write(json.dumps(record) + "\n")
    return destination


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path, help="your conversations, one JSON object a line")
    parser.add_argument("--target", default="meta-llama/Llama-3.1-8B-Instruct")
    parser.add_argument("--out", type=Path, default=Path("runs/my-head"))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--ttt-length", type=int, default=7,
                        help="steps the head is unrolled over its own predictions")
    parser.add_argument("--draft-vocab-size", type=int, default=32000,
                        help="the head predicts this many of the most frequent tokens")
    parser.add_argument("--num-speculative-tokens", type=int, default=3,
                        help="the chain length written into the vLLM export's config")
    args = parser.parse_args(argv)

    # 1. The frozen target whose hidden states the head learns from.
    target = eaglejax.load_target(args.target)

    # 2. Your conversations: rendered with the chat template, loss on assistant tokens,
    #    packed into rows of seq_len tokens.
    args.out.mkdir(parents=True, exist_ok=True)
    data = to_sharegpt(args.data, args.out / "conversations.jsonl")
    rows = prepare_rows(target, data, seq_len=args.seq_len, progress=False)
    print(f"{len(rows)} rows of {args.seq_len} tokens from {args.data}")

    # 3. Training: AdamW with a warm-up and cosine decay, checkpoints every 50 steps.
    #    `TrainConfig(mask_token_id=...)` trains a P-EAGLE head instead (parallel drafting).
    config = TrainConfig(seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps,
                         lr=args.lr, ttt_length=args.ttt_length,
                         draft_vocab_size=args.draft_vocab_size)
    result = train(target, rows, args.out / "run", config, progress=True)
    last = [entry for entry in result.log if "loss" in entry][-1]  # logged every 10 steps
    print(f"trained {last['step']} steps, loss {last['loss']:.3f} (log: "
          f"{result.out / 'log.jsonl'}); head in {result.out / 'head'}")

    # 4. The speculators layout: config.json naming the target as its verifier, the weights
    #    in model.safetensors (d2t/t2d map the draft vocabulary to the target's).
    exported = export_speculators(result.draft, args.out / "speculators",
                                  speculative_tokens=args.num_speculative_tokens)
    print(f"exported for vLLM: {exported}")
    spec = {"method": "eagle3", "model": str(exported.absolute()),
            "num_speculative_tokens": args.num_speculative_tokens}
    print(f"vllm serve {args.target} --speculative-config '{json.dumps(spec)}'")
    return exported


if __name__ == "__main__":
    main()
