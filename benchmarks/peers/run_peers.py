"""Peer harness: eaglejax against vLLM (CPU), Hugging Face transformers and llama.cpp, on
the same model (SmolLM2-135M-Instruct), the same EAGLE-3 head, the same prompt token ids,
greedy with EOS ignored, in one run; one JSON file and a Markdown table per prompt set.

    python benchmarks/peers/run_peers.py --out peers.json             # the real run
    python benchmarks/peers/run_peers.py --out quick.json --num-prompts 4 --max-new-tokens 32

Each peer runs in its own virtualenv (benchmarks/peers/setup_peers.py, built on first use)
as a subprocess, one at a time; a peer that cannot be set up or fails is reported in the
table with the last line of its error. See benchmarks/peers/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import last_line  # noqa: E402
from setup_peers import DEFAULT_ROOT, ensure_peer  # noqa: E402

MODEL = "smollm2-135m-instruct"
REPO = HERE.parents[1]


def modes(engine: str, ks: list[int], storages: tuple[str, ...] = ("auto",)) -> list[str]:
    """The modes each engine's runner reports (for rows of a runner that died)."""
    spec = {"eaglejax": "eagle3 K={}", "vllm": "eagle3 K={}", "transformers": "prompt lookup {}",
            "llama.cpp": "prompt lookup {}"}[engine]
    extra = ["eagle3 assisted"] if engine == "transformers" else []
    if engine == "eaglejax":
        extra = [f"eagle3 K={k} or lookup" for k in ks] + [f"plain ({s})" for s in storages[1:]]
    return ["plain"] + [spec.format(k) for k in ks] + extra


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def export_head(work: Path) -> Path:
    """The shipped EAGLE-3 head in the speculators layout (`eaglejax convert`), unpatched:
    whatever vLLM needs must come from the exporter itself."""
    from eaglejax.draft.shipped import shipped_head

    dst = work / "head-speculators"
    subprocess.run(["rm", "-rf", str(dst)], check=True)  # exported anew every run
    subprocess.run([sys.executable, "-m", "eaglejax.cli", "convert", str(shipped_head(MODEL)),
                    str(dst), "--target", MODEL, "--to", "speculators"], check=True)
    return dst


def hf_target(work: Path, given: str | None) -> tuple[Path, str]:
    """The target as a Hugging Face directory for vLLM and transformers, and where it came
    from: `--hf-target`, else `eaglejax convert MODEL DST --to hf`."""
    if given:
        return Path(given), f"given (--hf-target {given})"
    dst = work / "target-hf"  # converted anew every run (seconds), never stale
    subprocess.run(["rm", "-rf", str(dst)], check=True)
    subprocess.run([sys.executable, "-m", "eaglejax.cli", "convert", MODEL, str(dst),
                    "--to", "hf"], check=True)
    return dst, f"eaglejax convert {MODEL} DST --to hf"


def run_engine(engine: str, python: str, script: str, job: Path, out: Path, extra: list[str],
               env: dict[str, str], timeout: int) -> tuple[dict[str, Any], str | None]:
    """Run one engine's runner; its (possibly partial) output and, if it died, why."""
    out.unlink(missing_ok=True)
    logfile = out.with_suffix(".log")
    load_before = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    try:
        with open(logfile, "w") as f:
            done = subprocess.run([python, str(HERE / script), str(job), str(out), *extra],
                                  stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                  cwd=HERE)
        error = None if done.returncode == 0 else f"exit {done.returncode}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout} s"
    text = logfile.read_text(errors="replace")
    if error:
        errors = [line for line in text.splitlines()
                  if "Error" in line or "error:" in line or "Exception" in line]
        error += ": " + last_line(errors[-1] if errors else text)
    data = json.loads(out.read_text()) if out.is_file() else {"engine": engine, "info": {},
                                                               "runs": []}
    data["info"]["runner_s"] = round(time.perf_counter() - start, 1)
    data["info"]["load_before"] = load_before  # 1, 5, 15-minute load averages: others'
    data["info"]["load_after"] = [round(x, 2) for x in os.getloadavg()]  # work shows here
    data["info"]["log"] = str(logfile)
    return data, error


def fill_failures(data: dict[str, Any], engine: str, wanted: list[str], sets: list[str],
                  batch_sizes: list[int], error: str) -> None:
    """Rows for every (mode, set, batch) a dead runner did not report."""
    have = {(r["mode"], r["prompt_set"], r["batch"]) for r in data["runs"]}
    for mode in wanted:
        for name in sets:
            for batch in batch_sizes:
                if (mode, name, batch) not in have:
                    data["runs"].append({"mode": mode, "prompt_set": name, "batch": batch,
                                         "status": "failed", "reason": error})


def compare(rows: list[dict[str, Any]]) -> None:
    """Add, per row, the speed ratio to eaglejax plain and output agreement with it."""
    base = {(r["prompt_set"], r["batch"]): r for r in rows
            if r["engine"] == "eaglejax" and r["mode"] == "plain" and r["status"] == "ok"}
    for r in rows:
        b = base.get((r["prompt_set"], r["batch"]))
        if r["status"] != "ok" or b is None:
            continue
        r["ratio_to_eaglejax_plain"] = r["tokens_per_s"] / b["tokens_per_s"]
        same = sum(x == y for x, y in zip(r["outputs"], b["outputs"]))
        r["identical_to_eaglejax_plain"] = f"{same}/{len(b['outputs'])}"


def markdown(report: dict[str, Any]) -> str:
    """One table per prompt set, then the AL check, n/a reasons and failures."""
    m = report["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, {m.get('copy_bandwidth_gb_s')} GB/s "
             f"copy; {report['max_new_tokens']} new tokens per prompt (EOS ignored), greedy; "
             f"target {MODEL} ({report['hf_target_source']}).", ""]
    notes: dict[str, str] = {}
    for name, prompts in report["prompt_sets"].items():
        cats = sorted({p["category"] for p in prompts})
        lines += [f"### {name}: {len(prompts)} prompts ({', '.join(cats)})", "",
                  "| engine | mode | batch | AL | tokens/s | x eaglejax plain | "
                  "identical to eaglejax plain |", "|---|---|---|---|---|---|---|"]
        for r in report["rows"]:
            if r["prompt_set"] != name:
                continue
            batch = (f"{r['batch']} ({len(prompts)} rows)" if r["batch"] > len(prompts)
                     else str(r["batch"]))
            if r["status"] != "ok":
                key = f"{r['engine']}: {r['reason']}"
                mark = notes.setdefault(key, f"[{len(notes) + 1}]")
                lines.append(f"| {r['engine']} | {r['mode']} | {batch} | "
                             f"{r['status']} {mark} | | | |")
                continue
            al, ratio = r.get("acceptance_length"), r.get("ratio_to_eaglejax_plain")
            lines.append(f"| {r['engine']} | {r['mode']} | {batch} | "
                         f"{'' if al is None else f'{al:.2f}'} | {r['tokens_per_s']:.1f} | "
                         f"{'' if ratio is None else f'{ratio:.2f}'} | "
                         f"{r.get('identical_to_eaglejax_plain', '')} |")
        lines.append("")
    lines += ["### EAGLE-3, same head and K: vLLM vs eaglejax", ""]
    for c in report["al_check"]:
        lines.append(f"- {c['prompt_set']} batch {c['batch']} {c['mode']}: AL vLLM "
                     f"{c['vllm_al']:.3f} vs eaglejax {c['eaglejax_al']:.3f}; outputs "
                     f"identical {c['identical']}")
    lines += ["", "### Notes", ""] + [f"{v} {k}" for k, v in notes.items()]
    lines += [f"- {name}: ran {info.get('runner_s')} s, load average before/after "
              f"{info.get('load_before')} / {info.get('load_after')}"
              + (f"; {info['note']}" if info.get("note") else "")
              for name, info in report["engines"].items()]
    return "\n".join(lines) + "\n"


def al_check(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM EAGLE-3 against eaglejax EAGLE-3 with the same head, K, prompts and batch."""
    ours = {(r["prompt_set"], r["batch"], r["mode"]): r for r in rows
            if r["engine"] == "eaglejax" and r["status"] == "ok"}
    checks = []
    for r in rows:
        o = ours.get((r["prompt_set"], r["batch"], r["mode"]))
        if r["engine"] == "vllm" and r["status"] == "ok" and o and r["mode"] != "plain":
            same = sum(x == y for x, y in zip(r["outputs"], o["outputs"]))
            checks.append({"prompt_set": r["prompt_set"], "batch": r["batch"],
                           "mode": r["mode"], "vllm_al": r["acceptance_length"],
                           "eaglejax_al": o["acceptance_length"],
                           "identical": f"{same}/{len(o['outputs'])}"})
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("peers.json"),
                        help="JSON report (the Markdown tables go beside it, .md)")
    parser.add_argument("--num-prompts", type=int, default=16, help="per prompt set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5],
                        help="draft tokens per round (EAGLE-3 chains, prompt lookup)")
    parser.add_argument("--engines", nargs="+", default=["eaglejax", "vllm", "transformers",
                                                         "llama.cpp"])
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_ROOT,
                        help=f"the peers' venvs (default {DEFAULT_ROOT})")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="exported head, HF target, jobs and logs (default PEERS_DIR/work)")
    parser.add_argument("--hf-target", default=None,
                        help="use this HF directory instead of `eaglejax convert --to hf`")
    parser.add_argument("--eaglejax-storage", nargs="+", default=["auto"],
                        choices=["auto", "float32", "bfloat16", "int8", "int4", "gguf"],
                        help="eaglejax's weight storage (load_target's weight_dtype; auto: "
                             "what `eaglejax generate` picks); more than one adds a plain run "
                             "per further storage, the first also speculates")
    parser.add_argument("--threads", type=int, default=None, help="default: all usable cores")
    parser.add_argument("--vllm-cpus", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND (default: every usable core; 'auto' "
                             "is vLLM's own, which reserves a core for its scheduler)")
    parser.add_argument("--vllm-compile", action="store_true",
                        help="let vLLM compile (default: enforce_eager)")
    parser.add_argument("--timeout", type=int, default=7200, help="seconds per runner")
    args = parser.parse_args()

    import eaglejax
    from eaglejax.hardware import cpu_cores, machine_report
    from eaglejax.loading.builtin import resolve_builtin
    from prompts import prompt_sets

    root = args.peers_dir.expanduser()
    work = (args.work_dir or root / "work").expanduser()
    work.mkdir(parents=True, exist_ok=True)
    threads = args.threads or cpu_cores()
    setup = {}
    for engine, peer in (("vllm", "vllm"), ("llama.cpp", "llamacpp")):
        if engine in args.engines:
            log(f"setting up {peer} (first time: minutes)")
            setup[engine] = ensure_peer(peer, root)
            log(f"{peer}: {setup[engine]}")
    gguf = resolve_builtin(MODEL)
    head = export_head(work)
    hf_dir, hf_source = hf_target(work, args.hf_target) \
        if {"vllm", "transformers"} & set(args.engines) else (None, "not needed")
    log(f"HF target {hf_dir} ({hf_source}); head {head}")
    target = eaglejax.load_target(MODEL)
    sets = prompt_sets(target, args.num_prompts, args.num_prompts)
    del target
    job = {"prompt_sets": sets, "max_new_tokens": args.max_new_tokens,
           "batch_sizes": args.batch_sizes, "ks": args.ks, "threads": threads,
           "vllm_eager": not args.vllm_compile, "eaglejax_storages": args.eaglejax_storage,
           "paths": {"gguf": str(gguf), "hf_target": str(hf_dir),
                     "head_speculators": str(head)}}
    job_path = work / "job.json"
    job_path.write_text(json.dumps(job))

    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    vllm_env = dict(env, VLLM_CPU_OMP_THREADS_BIND=args.vllm_cpus or ",".join(
        str(c) for c in sorted(os.sched_getaffinity(0))), VLLM_CPU_KVCACHE_SPACE=os.environ.get(
        "VLLM_CPU_KVCACHE_SPACE", "2"))
    plan: list[tuple[str, str | None, str, list[str], dict[str, str], list[str]]] = []
    if "eaglejax" in args.engines:
        plan.append(("eaglejax", sys.executable, "engine_eaglejax.py", [], env,
                     modes("eaglejax", args.ks, tuple(args.eaglejax_storage))))
    if "vllm" in args.engines:
        for mode, label in [("plain", "plain")] + [(f"eagle3:{k}", f"eagle3 K={k}")
                                                    for k in args.ks]:
            plan.append(("vllm", setup["vllm"].get("python"), "engine_vllm.py", [mode],
                         vllm_env, [label]))
    if "transformers" in args.engines:
        plan.append(("transformers", sys.executable, "engine_transformers.py", [], env,
                     modes("transformers", args.ks)))
    if "llama.cpp" in args.engines:
        plan.append(("llama.cpp", setup["llama.cpp"].get("python"), "engine_llamacpp.py", [],
                     env, modes("llama.cpp", args.ks)))
    rows: list[dict[str, Any]] = []
    engines: dict[str, Any] = {}
    for i, (engine, python, script, extra, run_env, wanted) in enumerate(plan):
        log(f"running {engine} {' '.join(extra)}")
        if python is None:
            data, error = {"engine": engine, "info": {}, "runs": []}, \
                f"venv not built: {setup[engine].get('error')}"
        else:
            data, error = run_engine(engine, python, script, job_path, work / f"out-{i}.json",
                                     extra, run_env, args.timeout)
        if error:
            log(f"{engine} failed: {error}")
            fill_failures(data, engine, wanted, list(sets), args.batch_sizes, error)
        engines[f"{engine} {' '.join(extra)}".strip()] = data["info"]
        rows += [{"engine": engine, **r} for r in data["runs"]]
    compare(rows)
    machine = next((d.get("machine") for d in engines.values() if d.get("machine")), None)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine or machine_report(), "model": MODEL,
              "gguf": str(gguf), "hf_target": str(hf_dir), "hf_target_source": hf_source,
              "head_speculators": str(head),
              "max_new_tokens": args.max_new_tokens, "batch_sizes": args.batch_sizes,
              "ks": args.ks, "threads": threads, "setup": setup, "engines": engines,
              "prompt_sets": sets, "rows": rows, "al_check": al_check(rows)}
    args.out.write_text(json.dumps(report, indent=1))
    table = markdown(report)
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
