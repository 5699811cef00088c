"""On a GPU or TPU: check the compiled loop, then measure what the roofline predicts.

`eaglejax bench --roofline` predicts an accelerator's decode speed from XLA's cost analysis;
this script measures the same programs on the accelerator JAX sees, with random weights
(no checkpoint travels; speed depends on shapes only):

  parity  a small random Llama (float32) decodes greedily, batch 2 with ragged prompts,
          with the Pallas tree-attention kernel and with XLA's attention: plain decoding,
          an EAGLE-3 chain, a dynamic tree and a P-EAGLE parallel chain (logit-lens heads,
          which accept often on a random model). Reports, per configuration, whether the
          speculative tokens equal plain decoding's under the same attention, and how
          many tokens the two attention paths share.
  rounds  Llama-3.1-8B shapes in bfloat16 with the public EAGLE-3 head shape: the plain
          step and whole speculative rounds in the compiled loop (`round_split`) at about
          `--context` cached tokens, in ms and plain steps, each round split into its
          phases (`--whole`: whole rounds only).
  drafters  the same target drafted for by a DFlash drafter of its authors' shape (five
          layers, blocks of 16: a chain of 15 and a tree over the block) and by
          Llama-3.2-1B (random weights; chain K=4 and a 12-node tree), each round in plain
          steps beside the roofline's prediction for the GPU `--roofline-device` names.
  curve   the target forward over T = 1..64 tokens at `--context` cached tokens, in
          single-token forwards (what verifying T nodes costs).

Each measurement is written to `--out` (JSON) as soon as it is taken, so a run cut short
keeps what it measured. `--small` runs every stage with tiny shapes (a CPU dry run).

    python benchmarks/bench_device.py --out results.json
    python benchmarks/bench_device.py --small --stages parity rounds curve   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eaglejax.config import ModelConfig  # noqa: E402
from eaglejax.decoding.batch import decode  # noqa: E402
from eaglejax.decoding.sampling import SamplingParams  # noqa: E402
from eaglejax.decoding.spec_config import SpecConfig  # noqa: E402
from eaglejax.decoding.stopping import StopCriteria  # noqa: E402
from eaglejax.draft.draft import Draft, new_dflash_draft, new_eagle3_draft  # noqa: E402
from eaglejax.draft.draft_model import DraftModel  # noqa: E402
from eaglejax.models import llama  # noqa: E402
from eaglejax.programs.reference import llama31_8b, llama32_1b  # noqa: E402
from eaglejax.programs.roofline import roofline  # noqa: E402
from eaglejax.round_split import describe_split, round_split  # noqa: E402
from eaglejax.target import Target  # noqa: E402
from eaglejax.timing import single_forward_ms  # noqa: E402

STAGES = ("parity", "rounds", "drafters", "curve")


def small_config(vocab: int = 4096) -> ModelConfig:
    """A 4-layer Llama (grouped-query attention, head_dim 64) for the parity stage."""
    return ModelConfig("llama", vocab_size=vocab, hidden_size=512, intermediate_size=1024,
                       num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64)


def random_target(config: ModelConfig, dtype: jnp.dtype, attn_impl: str, seed: int = 0,
                  params: Any = None) -> Target:
    """A target of random weights (normal * 0.02, norms at 1) stored in `dtype`."""
    if params is None:
        params = llama.init_params(config, jax.random.PRNGKey(seed), dtype)
    return Target(config, params, None, f"random {config.num_layers}-layer llama",
                  attn_impl=attn_impl)


def heads(target: Target, draft_vocab: int) -> dict[str, Draft]:
    """Logit-lens EAGLE-3 and P-EAGLE heads over the first `draft_vocab` ids."""
    used = np.arange(draft_vocab)
    mask = draft_vocab - 1
    return {"eagle3": new_eagle3_draft(target, used_tokens=used, from_target=True),
            "peagle": new_eagle3_draft(target, used_tokens=used, from_target=True,
                                       mask_token_id=mask)}


def _tokens(target: Target, draft: Draft | None, prompts: list[list[int]], spec, new: int
            ) -> list[list[int]]:
    run = decode(target, draft, prompts, [0] * len(prompts), SamplingParams.make(), new,
                 StopCriteria(), spec)
    tokens, counts = np.asarray(run.state.out.tokens), np.asarray(run.state.out.counts)
    return [row[:n].tolist() for row, n in zip(tokens, counts)]


def _shared_prefix(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per row, how many leading tokens the two decodes share."""
    out = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        out.append(n)
    return out


def parity(args: argparse.Namespace, result: dict[str, Any]) -> None:
    config = small_config()
    params = llama.init_params(config, jax.random.PRNGKey(1), jnp.float32)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, config.vocab_size, n).tolist() for n in (40, 57)]
    new = 48
    configs = {"chain K=5": ("eagle3", SpecConfig.chain(5)),
               "tree 4/4/12": ("eagle3", SpecConfig.tree(4, 4, 12)),
               "P-EAGLE parallel K=5": ("peagle", SpecConfig.parallel(5))}
    result.update(new_tokens=new, prompt_tokens=[40, 57])
    plain_by_impl = {}
    for impl in ("pallas", "xla"):
        target = random_target(config, jnp.float32, impl, params=params)
        drafts = heads(target, config.vocab_size // 2)
        plain_tokens = _tokens(target, None, prompts, None, new)
        plain_by_impl[impl] = plain_tokens
        rows = {}
        for label, (kind, spec) in configs.items():
            spec_tokens = _tokens(target, drafts[kind], prompts, spec, new)
            shared = _shared_prefix(spec_tokens, plain_tokens)
            rows[label] = {"identical": spec_tokens == plain_tokens, "shared_prefix": shared}
            print(f"parity [{impl}] {label}: identical={spec_tokens == plain_tokens} "
                  f"shared={shared}", flush=True)
        result[impl] = rows
    result["pallas_vs_xla_plain_shared_prefix"] = _shared_prefix(plain_by_impl["pallas"],
                                                                plain_by_impl["xla"])
    print(f"parity: plain decoding, Pallas vs XLA attention, shared tokens per row: "
          f"{result['pallas_vs_xla_plain_shared_prefix']} of {new}", flush=True)


def big_target(args: argparse.Namespace) -> Target:
    config = small_config(8192) if args.small else llama31_8b()
    return random_target(config, jnp.bfloat16, "auto", seed=2)


def rounds(args: argparse.Namespace, target: Target, result: dict[str, Any]) -> None:
    draft_vocab = 1024 if args.small else 32000
    drafts = heads(target, draft_vocab)
    prompt = np.random.RandomState(3).randint(0, target.config.vocab_size,
                                              args.context).tolist()
    shapes = [("chain K=5", "eagle3", SpecConfig.chain(5)),
              ("tree 10/6/60", "eagle3", SpecConfig.tree(10, 6, 60)),
              ("P-EAGLE parallel K=5", "peagle", SpecConfig.parallel(5)),
              ("tree 4/4/12", "eagle3", SpecConfig.tree(4, 4, 12))]
    for label, kind, spec in shapes:
        result[label] = _timed_round(target, drafts[kind], spec, prompt, args, not args.whole)
        args.save()


def _timed_round(target: Target, draft: Any, spec: SpecConfig, prompt: list[int],
                 args: argparse.Namespace, split: bool) -> dict[str, Any]:
    start = time.perf_counter()
    measured = round_split(target, draft, spec, prompt, rounds=args.rounds,
                           repeats=args.repeats, split=split)
    measured["wall_s"] = time.perf_counter() - start
    print(describe_split(measured), f"  ({measured['wall_s']:.0f} s with compiling)",
          flush=True)
    return measured


def drafters(args: argparse.Namespace, target: Target, result: dict[str, Any]) -> None:
    """DFlash and draft-model rounds on the big target, beside the roofline's prediction."""
    config = target.config
    layers, block = (2, 8) if args.small else (5, 16)
    dflash = new_dflash_draft(target, num_layers=layers, block_size=block,
                              mask_token_id=config.vocab_size - 1, seed=5)
    model_config = small_config(config.vocab_size) if args.small else llama32_1b()
    draft_model = DraftModel.of(random_target(model_config, jnp.bfloat16, "auto", seed=6),
                                target)
    prompt = np.random.RandomState(3).randint(0, config.vocab_size, args.context).tolist()
    chain = SpecConfig.dflash(block - 1)
    # split, when not --whole: the draft model's six truncated loops took over 150 s to
    # compile on an H200 (session 47), so its rounds are timed whole
    shapes = [(f"DFlash {layers} layers, {chain.describe()}", dflash, chain, True),
              ("draft model, chain K=4", draft_model, SpecConfig.draft_model(4), False),
              (f"DFlash {layers} layers, tree 4/{block - 1}/32", dflash,
               SpecConfig.dflash_tree(4, block - 1, 32), False),
              ("draft model, tree 4/4/12", draft_model, SpecConfig.draft_model_tree(4, 4, 12),
               False)]
    result["draft_model"] = "small llama" if args.small else "Llama-3.2-1B"
    if not args.small:
        predicted = roofline([args.roofline_device], batches=(1,), context=args.context)
        steps = {row["program"]: row["ms"] for row in predicted["rows"]}
        result["roofline_plain_steps"] = {p: ms / steps["plain step"] for p, ms in steps.items()}
        print("roofline", args.roofline_device, json.dumps(result["roofline_plain_steps"]),
              flush=True)
    for label, draft, spec, split in shapes:
        result[label] = _timed_round(target, draft, spec, prompt, args, split and not args.whole)
        args.save()


def curve(args: argparse.Namespace, target: Target, result: dict[str, Any]) -> None:
    sizes = (1, 2, 4, 8, 12, 16, 32, 64)
    capacity = -(-(args.context + max(sizes) + 1) // 128) * 128
    ms = {}
    for t in sizes:
        ms[t] = single_forward_ms(target, args.context, capacity, tokens=t, repeats=20)
        print(f"curve T={t:>2}: {ms[t]:7.3f} ms  {ms[t] / ms[1]:5.2f} single-token forwards",
              flush=True)
    result.update(context=args.context, forward_ms=ms,
                  in_single_steps={t: v / ms[1] for t, v in ms.items()})


def environment() -> dict[str, Any]:
    devices = jax.devices()
    return {"jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [getattr(d, "device_kind", str(d)) for d in devices],
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--context", type=int, default=1008)
    parser.add_argument("--rounds", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU dry run)")
    parser.add_argument("--whole", action="store_true",
                        help="time whole rounds only, not their phases (faster)")
    parser.add_argument("--roofline-device", default="h200",
                        help="the roofline's device the drafters stage compares against")
    parser.add_argument("--out", type=Path, default=Path("bench_device.json"))
    args = parser.parse_args()
    if args.small:
        args.context, args.rounds, args.repeats = min(args.context, 100), 4, 2
    report: dict[str, Any] = {"environment": environment(), "small": args.small}
    args.save = lambda: args.out.write_text(json.dumps(report, indent=2, default=str))
    print(report["environment"], flush=True)
    target = None

    def stage(name: str, run: Callable[[dict[str, Any]], None]) -> None:
        """Run a stage that fills its own entry of the report as it measures (saved after
        each measurement), so that a stage cut short keeps what it measured."""
        start = time.perf_counter()
        try:
            run(report.setdefault(name, {}))
        except Exception as error:  # noqa: BLE001  (keep the other stages' measurements)
            traceback.print_exc()
            report[name]["error"] = f"{type(error).__name__}: {error}"
        report.setdefault("stage_seconds", {})[name] = time.perf_counter() - start
        args.save()

    for name in args.stages:
        if name == "parity":
            stage(name, lambda result: parity(args, result))
            continue
        if target is None:
            target = big_target(args)
        run = {"rounds": rounds, "drafters": drafters, "curve": curve}[name]
        stage(name, lambda result, run=run: run(args, target, result))
    print(json.dumps(report.get("stage_seconds", {})), flush=True)


if __name__ == "__main__":
    main()
