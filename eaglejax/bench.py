"""Benchmarks behind `eaglejax bench`: decoding speed on MT-bench first turns."""

from __future__ import annotations

import collections
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.datasets import Question
from eaglejax.decoding.autotune import AutoPlan
from eaglejax.decoding.batch import cache_capacity
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.speculation import default_shape
from eaglejax.decoding.suffix_history import shared_history
from eaglejax.generate import generate
from eaglejax.hardware import machine_report, memory_floor_ms
from eaglejax.programs import roofline
from eaglejax.prompting import encode_prompts
from eaglejax.round_split import round_split
from eaglejax.target import Target
from eaglejax.timing import single_forward_ms


def decode_step_bytes(target: Target, context: int, batch: int = 1) -> int:
    """Bytes one plain decode step must read: every weight once (an untied embedding table
    only the looked-up rows) and each row's `context` cached keys and values."""
    config = target.config
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(target.params))
    if not config.tie_word_embeddings:
        embed = target.params["embed"]
        weights -= embed.nbytes - batch * embed.nbytes // embed.shape[0]
    itemsize = jnp.dtype(target.dtype).itemsize
    cache = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    return int(weights + batch * context * cache)


def run_interleaved(questions: list[Question], batch_size: int,
                    runs: Mapping[str, Callable],
                    histories: Sequence[Sequence[Sequence[int]]] | None = None
                    ) -> dict[str, dict[str, Any]]:
    """Time several ways of decoding the same prompts, interleaved: every run warms every
    shape up first, then each batch goes through every run before the next batch starts
    (the order rotating per batch), so a slow spell of this shared machine hits them all
    alike. Every call starts with the history of earlier replies that suffix drafting and a
    lookup branch with history search (`decoding.suffix_history`) holding `histories[i]`
    for batch i (None: empty): the same prompts run in the warm-up and in every run, and
    their own earlier replies would be copied. Returns per run: summed timings, token counts
    and the results."""
    batches = [[q.prompt for q in questions[i:i + batch_size]]
               for i in range(0, len(questions), batch_size)]

    def with_history(i: int) -> None:
        shared_history().clear()
        shared_history().add(histories[i] if histories is not None else [])

    for run in runs.values():  # warm-up: compiles every prompt-length bucket
        for i, batch in enumerate(batches):
            with_history(i)
            run(batch)
    totals = {name: {"prefill_s": 0.0, "decode_s": 0.0, "new_tokens": 0, "decode_tokens": 0,
                     "steps": 0, "prompt_tokens": [], "results": []} for name in runs}
    names = list(runs)
    for i, batch in enumerate(batches):
        for name in names[i % len(names):] + names[:i % len(names)]:
            with_history(i)
            results, t = runs[name](batch), totals[name]
            t["prefill_s"] += results[0].metrics.prefill_s
            t["decode_s"] += results[0].metrics.decode_s
            t["steps"] += results[0].metrics.target_forwards - 1
            t["new_tokens"] += sum(r.metrics.new_tokens for r in results)
            t["decode_tokens"] += sum(r.metrics.new_tokens - 1 for r in results)
            t["prompt_tokens"] += [r.metrics.prompt_tokens for r in results]
            t["results"] += results
    return totals


def _header(target: Target, questions: list[Question], batch_size: int,
            max_new_tokens: int, sampling: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"model": target.source, "dtype": jnp.dtype(target.dtype).name,
            "storage": target.storage, "machine": machine_report(), "batch_size": batch_size,
            "prompts": len(questions), "max_new_tokens": max_new_tokens,
            "sampling": dict(sampling) if sampling else "greedy"}


def plain_run(target: Target, questions: list[Question], *, batch_size: int = 1,
              max_new_tokens: int = 128, chat: bool = True, ignore_eos: bool = True,
              sampling: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Plain decoding over `questions` in batches (after a warm-up pass): summed timings,
    token counts and the results. `sampling`: `generate`'s temperature / top_p / top_k /
    seed (None: greedy)."""
    run = functools.partial(generate, target=target, max_new_tokens=max_new_tokens, chat=chat,
                            ignore_eos=ignore_eos, **(sampling or {}))
    return run_interleaved(questions, batch_size, {"plain": run})["plain"]


def bench_plain(target: Target, questions: list[Question], *, batch_size: int = 1,
                max_new_tokens: int = 128, chat: bool = True, ignore_eos: bool = True,
                sampling: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Plain decoding over `questions` in batches (greedy, or `sampling` as in `plain_run`);
    a warm-up pass compiles every shape."""
    t = plain_run(target, questions, batch_size=batch_size, max_new_tokens=max_new_tokens,
                  chat=chat, ignore_eos=ignore_eos, sampling=sampling)
    mean_context = int(np.mean(t["prompt_tokens"])) + max_new_tokens // 2
    capacity = cache_capacity(max(t["prompt_tokens"]), max_new_tokens)
    forward_ms = single_forward_ms(target, mean_context, capacity, batch=batch_size)
    decode_ms_per_step = 1e3 * t["decode_s"] / t["steps"]
    header = _header(target, questions, batch_size, max_new_tokens, sampling)
    step_bytes = decode_step_bytes(target, mean_context, batch_size)
    floor_ms = memory_floor_ms(step_bytes, header["machine"]["copy_bandwidth_gb_s"])
    return {
        "mode": "plain", **header,
        "mean_context_tokens": mean_context,
        "new_tokens": t["new_tokens"],
        "decode_tokens_per_s": t["decode_tokens"] / t["decode_s"],
        "end_to_end_tokens_per_s": t["new_tokens"] / (t["prefill_s"] + t["decode_s"]),
        "prefill_s_per_batch": t["prefill_s"] / (len(t["results"]) / batch_size),
        "decode_ms_per_step": decode_ms_per_step,
        "single_forward_ms": forward_ms,
        "step_over_forward": decode_ms_per_step / forward_ms,
        "step_bytes": step_bytes,
        "memory_floor_ms": floor_ms,
        "step_over_memory_floor": decode_ms_per_step / floor_ms,
    }


def bench_speculative(target: Target, draft, questions: list[Question], *, batch_size: int = 1,
                      max_new_tokens: int = 128, speculative: SpecConfig | str | None = None,
                      chat: bool = True, ignore_eos: bool = True,
                      sampling: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Plain and speculative decoding side by side on the same prompts (interleaved, see
    `run_interleaved`), with acceptance statistics. Greedy, or `sampling` as in `plain_run`
    (lossless speculative sampling: the same distribution, not the same tokens).
    `speculative` as in `generate` (None: the device preset)."""
    return compare_speculative(target, draft, questions, [speculative], batch_size=batch_size,
                               max_new_tokens=max_new_tokens, chat=chat, ignore_eos=ignore_eos,
                               sampling=sampling)[0]


def compare_speculative(target: Target, draft, questions: list[Question],
                        configs: list[SpecConfig | str | None], **kwargs: Any
                        ) -> list[dict[str, Any]]:
    """`bench_speculative` for several speculation shapes at once: plain decoding and every
    shape timed interleaved in one run; one report per shape, each against that plain run
    (keyword arguments as for `compare_drafts`)."""
    return compare_drafts(target, [(draft, spec) for spec in configs], questions, **kwargs)


def compare_drafts(target: Target, runs: Sequence[tuple[Any, SpecConfig | str | None]],
                   questions: list[Question], *, batch_size: int = 1,
                   max_new_tokens: int = 128, chat: bool = True, ignore_eos: bool = True,
                   sampling: Mapping[str, Any] | None = None,
                   histories: Sequence[Sequence[Sequence[int]]] | None = None
                   ) -> list[dict[str, Any]]:
    """Several (draft head, speculation shape) pairs and plain decoding, timed interleaved in
    one run (`run_interleaved`, each batch's calls starting from `histories`); one report
    per pair, each against that plain run."""
    common = dict(target=target, max_new_tokens=max_new_tokens, chat=chat,
                  ignore_eos=ignore_eos, **(sampling or {}))
    timed: dict[str, Callable] = {"plain": functools.partial(generate, **common)}
    for i, (draft, spec) in enumerate(runs):
        timed[f"spec {i}"] = functools.partial(generate, draft=draft, speculative=spec, **common)
    totals = run_interleaved(questions, batch_size, timed, histories)
    header = _header(target, questions, batch_size, max_new_tokens, sampling)
    mean_context = int(np.mean(totals["plain"]["prompt_tokens"])) + max_new_tokens // 2
    header["mean_context_tokens"] = mean_context
    floor_ms = memory_floor_ms(decode_step_bytes(target, mean_context, batch_size),
                               header["machine"]["copy_bandwidth_gb_s"])
    return [_speculative_report(header, floor_ms, draft, questions, totals["plain"],
                                totals[f"spec {i}"], sampling is None)
            for i, (draft, _) in enumerate(runs)]


def shapes_to_profile(target: Target, draft,
                      speculative: SpecConfig | str | None) -> list[SpecConfig]:
    """The shapes `speculative` may run: itself, the device preset for None, every
    speculative mode of `target`'s plan for "auto"."""
    platform = jax.default_backend()
    if speculative == "auto":
        return [spec for spec in AutoPlan.for_target(target, draft).modes if spec is not None]
    if speculative is None:
        return [default_shape(draft, platform)]
    return [speculative]


def profile_rounds(target: Target, draft, prompt: str | list[int],
                   speculative: SpecConfig | str | None, *, chat: bool = True,
                   sampling: Mapping[str, Any] | None = None, rounds: int = 32,
                   repeats: int = 5) -> list[dict[str, Any]]:
    """`round_split` of each shape `speculative` may run (`shapes_to_profile`) on one
    prompt (text or token ids)."""
    params = SamplingParams.make(sampling["temperature"], sampling["top_k"], sampling["top_p"]
                                 ) if sampling else None
    [ids] = encode_prompts([prompt], target, chat)
    return [round_split(target, draft, spec, ids, sampling=params, rounds=rounds,
                        repeats=repeats)
            for spec in shapes_to_profile(target, draft, speculative)]


def _speculative_report(header: dict[str, Any], floor_ms: float, draft,
                        questions: list[Question], plain: dict[str, Any], spec: dict[str, Any],
                        greedy: bool) -> dict[str, Any]:
    """Speed, acceptance and round cost of one speculative run against the plain run."""
    rows = spec["results"]
    # Pooled over rows as vLLM pools its counters: each row weighted by its own rounds.
    # With speculative="auto" a row may have run plainly (AL 1, a round per decode step,
    # no draft position reached) and rows may have run shapes of different depths.
    rounds = [r.metrics.verify_rounds or r.metrics.new_tokens - 1 for r in rows]
    lengths = [r.metrics.acceptance_length or 1.0 for r in rows]
    positions = [r.metrics.acceptance_by_position or [] for r in rows]
    depth = max(len(p) for p in positions)
    al = float(np.average(lengths, weights=rounds))
    by_position = np.average([p + [0.0] * (depth - len(p)) for p in positions], axis=0,
                             weights=rounds) if depth else np.zeros(0)
    by_category: dict[str, list] = {}
    for question, length, n in zip(questions, lengths, rounds):
        by_category.setdefault(question.category, []).append((length, n))
    shapes = collections.Counter(r.metrics.speculative for r in rows)
    plain_step_ms = 1e3 * plain["decode_s"] / plain["steps"]
    spec_step_ms = 1e3 * spec["decode_s"] / spec["steps"]
    return {
        "mode": "speculative", **header,
        "draft": draft.source if draft is not None else None,
        "speculative": shapes.most_common(1)[0][0],
        "speculative_shapes": dict(shapes),
        "plain_decode_tokens_per_s": plain["decode_tokens"] / plain["decode_s"],
        "spec_decode_tokens_per_s": spec["decode_tokens"] / spec["decode_s"],
        "speedup": (spec["decode_tokens"] / spec["decode_s"])
        / (plain["decode_tokens"] / plain["decode_s"]),
        "acceptance_length": al,
        "acceptance_by_position": [round(float(x), 4) for x in by_position],
        "acceptance_length_by_category": {
            category: float(np.average([al for al, _ in pairs], weights=[n for _, n in pairs]))
            for category, pairs in sorted(by_category.items())},
        "plain_ms_per_step": plain_step_ms,
        "memory_floor_ms": floor_ms,
        "plain_step_over_memory_floor": plain_step_ms / floor_ms,
        "spec_ms_per_round": spec_step_ms,
        "round_over_plain_step": spec_step_ms / plain_step_ms,
        **({} if not greedy else {"identical_tokens": all(
            p.token_ids == s.token_ids for p, s in zip(plain["results"], rows))}),
    }


def beside_roofline(report: dict[str, Any], target: Target, draft,
                    speculative: SpecConfig | str | None, device_name: str) -> dict[str, Any]:
    """A bench `report` of `target` (and `draft`) beside the roofline prediction for
    `device_name` (`programs.roofline.predict`) of the same model, batch, mean context and
    measured acceptance length: the shape run when one was asked for, else (the preset,
    "auto") the device's preset shape; the target's weights as it stores them (bfloat16 for
    float storage, else its quantized matrices' bytes). Measured over predicted is how far
    the run is from the device's limits, meaningful where the run was on that device
    (`same_device`)."""
    spec = speculative if isinstance(speculative, SpecConfig) or draft is None \
        else default_shape(draft, roofline.platform_of(device_name), report["batch_size"])
    al = report.get("acceptance_length", 1.0)
    rows = roofline.predict(device_name, target.config, batch=report["batch_size"],
                            context=report["mean_context_tokens"],
                            draft=None if draft is None else draft.config, spec=spec,
                            accept_length=al, storage=target_weight_bytes(target))
    measured = [report.get("plain_decode_tokens_per_s", report.get("decode_tokens_per_s")),
                report.get("spec_decode_tokens_per_s")]
    for row, tokens_per_s in zip(rows, measured):
        row["measured_tokens_per_s"] = tokens_per_s
        row["measured_over_predicted"] = tokens_per_s / row["tokens_per_s"]
    device = jax.devices()[0]
    here = report["machine"].get("cpu") if device.platform == "cpu" else device.device_kind
    return {"device": roofline.device(device_name).name,
            "measured_on": f"{device.platform}: {here}",
            "same_device": roofline.runs_on(device_name, device.device_kind),
            "ran": report.get("speculative"), "rows": rows}


def target_weight_bytes(target: Target) -> roofline.WeightBytes:
    """`target`'s weights as an accelerator would hold them: its quantized matrices as
    stored (int8, int4, GGUF blocks), everything else in bfloat16."""
    if target.weight_dtype != jnp.int8:
        return roofline.weight_bytes(target.config)
    return roofline.weight_bytes(target.config, target.storage, target.params)


def describe_beside_roofline(beside: dict[str, Any]) -> str:
    """`beside_roofline`'s result as a few lines of text."""
    labels = [r["program"] + (f" at AL {r['accept_length']:.2f} (measured)"
                              if r["program"] != "plain step" else "") for r in beside["rows"]]
    width = max(len(label) for label in labels)
    first = beside["rows"][0]
    lines = [f"roofline for {beside['device']} ({first['storage']} weights, "
             f"{first['weights_gb']:.2f} GB: "
             f"{'fit' if first['weights_fit'] else 'do not fit'}; greedy, from XLA's cost "
             f"analysis) beside this run, measured on {beside['measured_on']}:",
             f"  {'program':<{width}} {'pred. ms':>8} {'pred. tok/s':>11} {'measured':>9} "
             f"{'meas./pred.':>11}"]
    for label, r in zip(labels, beside["rows"]):
        lines.append(f"  {label:<{width}} {r['ms']:>8.2f} {r['tokens_per_s']:>11.1f} "
                     f"{r['measured_tokens_per_s']:>9.1f} {r['measured_over_predicted']:>11.3f}")
    if beside["ran"] and len(beside["rows"]) > 1 and beside["ran"] != beside["rows"][1]["program"]:
        lines.append(f"  (the run decoded with {beside['ran']}; predicted: the device's preset)")
    if not beside["same_device"]:
        lines.append(f"  not measured on the {beside['device']}: run the same command on one "
                     f"to see how far the run is from the prediction")
    return "\n".join(lines)
