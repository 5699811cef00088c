"""Prefix caching in the serving engine, measured in one process: an engine with the cache
beside one without, alternating request by request (this machine is shared and noisy:
compare within one run).

- Multi-turn chats: MT-bench questions (categories interleaved), each a first turn and then
  its second turn, whose prompt is the whole conversation (the first turn, the model's own
  reply, the second question) rendered with the chat template; time to first token of each.
- A shared system prompt: `--system-tokens` tokens of text before each of `--clients`
  different questions, all submitted at once: prompt tokens prefilled and the time until
  every request has its first token.

    python benchmarks/bench_prefix_cache.py [--model smollm2-135m-instruct] [--chats 8]
        [--max-new-tokens 128] [--system-tokens 500] [--clients 16] [--draft HEAD]
        [--kv-tokens N] [--json]

Plain decoding, or with `--draft` `auto` over that head (as `eaglejax serve` runs a model with
a shipped head); greedy; the model in the storage `auto` picks; 16 slots. With `--kv-tokens`
both engines page their KV cache in a pool of that many positions, and the cache's hits share
the pool's blocks instead of copying rows.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import eaglejax
from eaglejax.datasets import interleave_categories, mt_bench_questions, shared_datasets_dir
from eaglejax.hardware import machine_report
from eaglejax.serving.engine import Engine, Request

# The engines decode the same requests in turn: none may copy another's replies from the
# history of earlier replies that `auto`'s lookup branches search (`decoding.suffix_history`).
os.environ["EAGLEJAX_REPLY_HISTORY"] = "0"

SLOTS, CAPACITY = 16, 2048


def first_token_seconds(engine: Engine, requests: list[Request]) -> tuple[float, dict]:
    """Submit `requests` together; seconds until each has its first token, and every
    request's final update."""
    for request in requests:
        engine.submit(request)
    start, waiting, first, done = time.perf_counter(), {r.key for r in requests}, 0.0, {}
    tokens: dict = {}
    while not engine.idle:
        for update in engine.step():
            tokens.setdefault(update.key, []).extend(update.token_ids)
            waiting.discard(update.key)
            if update.finish_reason is not None:
                done[update.key] = (update, tokens[update.key])
        if not waiting and not first:
            first = time.perf_counter() - start
    return first, done


def second_turns() -> dict[int, str]:
    """MT-bench's second turn of each question, by question id."""
    path = shared_datasets_dir() / "mt_bench" / "question.jsonl"
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(item["question_id"]): item["turns"][1] for item in items}


def chats(engines: dict[str, Engine], tokenizer, count: int, max_new: int) -> dict:
    """Per engine: time to first token of each first and second turn (seconds)."""
    times = {name: {"first": [], "second": []} for name in engines}
    follow_ups = second_turns()
    for i, question in enumerate(interleave_categories(mt_bench_questions())[:count]):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        replies = {}
        for name in order:
            messages = [{"role": "user", "content": question.prompt}]
            prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
            seconds, done = first_token_seconds(engines[name], [Request((name, i, 1), prompt,
                                                                       max_new)])
            times[name]["first"].append(seconds)
            replies[name] = tokenizer.decode(done[(name, i, 1)][1], skip_special_tokens=True)
        assert len(set(replies.values())) == 1, "the engines' replies differ"
        for name in order:
            messages = [{"role": "user", "content": question.prompt},
                        {"role": "assistant", "content": replies[name]},
                        {"role": "user", "content": follow_ups[question.question_id]}]
            prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
            seconds, _ = first_token_seconds(engines[name], [Request((name, i, 2), prompt,
                                                                    max_new)])
            times[name]["second"].append(seconds)
    return times


def shared_system_prompt(engines: dict[str, Engine], tokenizer, system_tokens: int,
                         clients: int) -> dict:
    """Per engine: prompt tokens prefilled and seconds until all `clients` requests (one
    long system prompt, different questions) have their first token."""
    text = " ".join(q.prompt for q in mt_bench_questions())
    system = tokenizer.decode(tokenizer.encode(text)[:system_tokens])
    questions = interleave_categories(mt_bench_questions())[:clients]
    result = {}
    for name, engine in engines.items():
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q.prompt}]))
            for q in questions]
        hits = engine.prefix.hit_tokens if engine.prefix else 0
        seconds, _ = first_token_seconds(engine, [Request((name, "system", j), p, 1)
                                                  for j, p in enumerate(prompts)])
        cached = (engine.prefix.hit_tokens - hits) if engine.prefix else 0
        result[name] = {"first_tokens_s": seconds,
                        "prompt_tokens": sum(map(len, prompts)),
                        "prefilled_tokens": sum(map(len, prompts)) - cached}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--system-tokens", type=int, default=500)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--draft", help="a draft head: engines run `auto` over it")
    parser.add_argument("--kv-tokens", type=int,
                        help="page both engines' KV cache in a pool of this many positions")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    target = eaglejax.load_target(args.model, weight_dtype="auto")
    tokenizer = target.tokenizer
    draft = eaglejax.load_draft(args.draft, target=target) if args.draft else None
    shape = {"num_slots": SLOTS, "capacity": CAPACITY, "kv_tokens": args.kv_tokens}
    engines = {"prefix cache": Engine(target, draft, prefix_cache_tokens=16 * CAPACITY, **shape),
               "no cache": Engine(target, draft, prefix_cache_tokens=0, **shape)}
    for engine in engines.values():
        engine.warmup(progress=False)
    times = chats(engines, tokenizer, args.chats, args.max_new_tokens)
    system = shared_system_prompt(engines, tokenizer, args.system_tokens, args.clients)
    median = {name: {turn: float(np.median(v)) for turn, v in t.items()}
              for name, t in times.items()}
    report = {"machine": machine_report(bandwidth=False), "storage": target.storage,
              "draft": args.draft, "kv_tokens": args.kv_tokens,
              "chats": {"ttft_s": times, "median_s": median,
                        "second_turn_ratio": median["prefix cache"]["second"]
                        / median["no cache"]["second"]},
              "shared_system_prompt": system}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    paging = f", paged in {args.kv_tokens} positions" if args.kv_tokens else ""
    print(f"{report['machine']['cpu']}, {target.storage}{paging}")
    for name, m in median.items():
        print(f"  {name:<13} time to first token p50: first turn {1e3 * m['first']:.0f} ms, "
              f"second turn {1e3 * m['second']:.0f} ms")
    print(f"  second turns with the cache: {report['chats']['second_turn_ratio']:.2f}x")
    for name, s in system.items():
        print(f"  {name:<13} {args.clients} requests after a {args.system_tokens}-token system "
              f"prompt: {s['prefilled_tokens']} of {s['prompt_tokens']} prompt tokens "
              f"prefilled, all first tokens in {s['first_tokens_s']:.2f} s")


if __name__ == "__main__":
    main()
