"""Where a speculative round's time goes, kernel by kernel, from XLA's own profiler.

    python benchmarks/profile_round.py --draft checkpoints/smollm2-135m-instruct-eagle3
        [--mode 1] [--rounds 48] [--prompt "..."]

Runs `--rounds` rounds of one of `auto`'s modes (`--mode`: an index into the plan
`AutoPlan.for_target` gives the target and head, printed first; 1 is the depth-1 tree on a
CPU) and as many plain steps, both in the compiled loop, timed interleaved (median of 5),
then once more each under `jax.profiler.trace`. Every event XLA's thunk executor
recorded is named by its operation in the compiled program: native kernels by their FFI
target (products by their input and output widths), beside where the operation was traced
(the target's decoder layers or the rest of the step: the head, the output head, tree
building, acceptance); XLA's own operations by the function they were traced in. Per target
forward (a plain step, a round), the microseconds each takes in the plain loop and in the
round: the difference is what the round costs beyond a plain step. The thunks of 2 cores
overlap, so the events add up to more than the wall time.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eaglejax
from eaglejax.decoding import loops
from eaglejax.decoding.autotune import AutoPlan
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.hardware import machine_report
from eaglejax.prompting import encode_prompts
from eaglejax.round_split import side_by_side

PROMPT = "Write a short story about a robot who learns to paint, with a twist ending."
PLUMBING = ("ThunkExecutor", "$", "Pjit", "Common", "while", "cond", "end:", "Parse",
            "Handle", "Alloc", "Wait", "Python", "copy")


def operations(compiled_text: str) -> dict[str, str]:
    """Each operation of a compiled program's text -> its label (see the module docstring)."""
    labels = {}
    for line in compiled_text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) ", line)
        if not found:
            continue
        name, result = found.groups()
        scope = re.search(r'op_name="([^"]+)"', line)
        scope = scope.group(1) if scope else ""
        place = "target layers" if "decoder_layer_call" in scope else "rest of the step"
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if target and target.group(1).startswith("eaglejax_"):
            kernel = target.group(1)[len("eaglejax_"):]
            if kernel.endswith("matmul"):  # named by its widths, whatever the rows
                x = re.search(r"operand_layout_constraints=\{\w+\[[\d,]*?(\d+)\]", line)
                y = re.match(r"\w+\[[\d,]*?(\d+)\]", result)
                kernel += f" {x.group(1) if x else '?'} -> {y.group(1) if y else '?'}"
            labels[name] = f"{place}: {kernel}"
        else:
            traced = re.findall(r"jit\(([^)]+)\)", scope)
            labels[name] = f"{place}: XLA {traced[-1] if traced else 'loop'}"
    return labels


def events_per_forward(trace_dir: Path, labels: dict[str, str], forwards: int
                       ) -> collections.Counter:
    """Microseconds per target forward of each label's events in a profiler trace."""
    (path,) = trace_dir.glob("**/*.trace.json.gz")
    totals: collections.Counter = collections.Counter()
    for event in json.load(gzip.open(path))["traceEvents"]:
        if event.get("ph") == "X" and not event["name"].startswith(PLUMBING):
            totals[labels.get(event["name"], f"unnamed: {event['name']}")] += event["dur"]
    return collections.Counter({k: v / forwards for k, v in totals.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--mode", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=48)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--draft-weight-dtype", default=None,
                        help="the head's storage (default: as `load_draft` stores it)")
    args = parser.parse_args()

    target = eaglejax.load_target(args.model, weight_dtype="auto")
    draft = eaglejax.load_draft(args.draft, target=target, weight_dtype=args.draft_weight_dtype)
    plan = AutoPlan.for_target(target, draft)
    for m in range(len(plan.modes)):
        print(f"mode {m}: {plan.name(m)}")
    spec = plan.modes[args.mode]
    prompt = encode_prompts([args.prompt], target, True)[0]
    calls = side_by_side(target, draft, spec, prompt, args.rounds, SamplingParams.make())
    static = dict(greedy=True, stop=StopCriteria())
    copy = lambda state: jax.tree.map(jnp.copy, state)  # noqa: E731  (the loop donates it)
    run = {name: (lambda b=b, a=a: b.run(loops.decode_loop, copy(a[0]), *a[1:], **static))
           for name, (b, a) in calls.items()}
    labels, forwards, seconds = {}, {}, collections.defaultdict(list)
    for name, (models, call_args) in calls.items():  # the program each call runs
        lowered = loops.decode_loop.lower(models.loop, models.weights, *call_args, **static)
        labels[name] = operations(lowered.compile().as_text())
        forwards[name] = int(jax.block_until_ready(run[name]()).forwards)
    for _ in range(5):
        for name in run:
            start = time.perf_counter()
            jax.block_until_ready(run[name]())
            seconds[name].append((time.perf_counter() - start) / forwards[name])
    profiles = {}
    for name in run:
        with tempfile.TemporaryDirectory() as folder:
            with jax.profiler.trace(folder):
                jax.block_until_ready(run[name]())
            profiles[name] = events_per_forward(Path(folder), labels[name], forwards[name])
    wall = {name: 1e3 * float(np.median(s)) for name, s in seconds.items()}
    print(json.dumps({"machine": machine_report(), "storage": target.storage,
                      "head_storage": str(args.draft_weight_dtype or "as loaded"),
                      "mode": plan.name(args.mode), "rounds": args.rounds,
                      "ms_per_forward": wall,
                      "round_in_plain_steps": wall["round"] / wall["plain"]}, indent=1))
    print(f"{'plain us':>9} {'round us':>9} {'extra':>7}  what (per target forward)")
    keys = sorted(set(profiles["plain"]) | set(profiles["round"]),
                  key=lambda k: -profiles["round"][k] - profiles["plain"][k])
    for key in keys:
        p, r = profiles["plain"][key], profiles["round"][key]
        if max(p, r) >= 5:
            print(f"{p:9.1f} {r:9.1f} {r - p:7.1f}  {key}")
    p, r = sum(profiles["plain"].values()), sum(profiles["round"].values())
    print(f"{p:9.1f} {r:9.1f} {r - p:7.1f}  all events (wall: {1e3 * wall['plain']:.0f} and "
          f"{1e3 * wall['round']:.0f} us)")


if __name__ == "__main__":
    main()
