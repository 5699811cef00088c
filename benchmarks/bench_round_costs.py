"""What one speculative round costs, drafter by drafter, on the built-in model.

    python benchmarks/bench_round_costs.py [--prompt TEXT] [--json]

Splits a round (`eaglejax bench --profile`'s split: draft, verify, accept + commit,
catch-up, the loop) for the shipped EAGLE-3 head (chain K=5, tree 4,4,8), the shipped
P-EAGLE head (parallel K=5), a DFlash drafter of its authors' shape (five layers, blocks of
16; randomly initialised: its acceptance means nothing, its cost is what a trained one
costs), suffix drafting and the model drafting for itself, all in plain steps measured in
the same process. Every drafter's matrices are stored as the target's (bfloat16 where that
decodes fastest).
"""

from __future__ import annotations

import argparse
import json

import eaglejax
from eaglejax import DraftModel, SpecConfig
from eaglejax.bench import profile_rounds
from eaglejax.draft.draft import new_dflash_draft
from eaglejax.draft.shipped import shipped_head
from eaglejax.hardware import machine_report

MODEL = "smollm2-135m-instruct"
PROMPT = "Write a short poem about the sea, then explain its imagery line by line."


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    target = eaglejax.load_target(MODEL, weight_dtype="auto")
    eagle3 = eaglejax.load_draft(shipped_head(MODEL, "eagle3"), target=target)
    peagle = eaglejax.load_draft(shipped_head(MODEL, "peagle"), target=target)
    dflash = new_dflash_draft(target, num_layers=5, block_size=16, mask_token_id=0)
    dflash = dflash.with_weight_dtype(target.weight_dtype)
    runs = [("EAGLE-3", eagle3, SpecConfig.chain(5)),
            ("EAGLE-3", eagle3, SpecConfig.tree(4, 4, 8)),
            ("P-EAGLE", peagle, SpecConfig.parallel(5)),
            ("DFlash (untrained, 5 layers)", dflash, SpecConfig.dflash(7)),
            ("DFlash (untrained, 5 layers)", dflash, SpecConfig.dflash(15)),
            ("DFlash (untrained, 5 layers)", dflash, SpecConfig.dflash_tree(4, 4, 8)),
            ("suffix", None, SpecConfig.suffix(4, 6, 8, 0)),
            ("itself", DraftModel.of(target, target), SpecConfig.draft_model(3))]
    rows = []
    for name, draft, spec in runs:
        [split] = profile_rounds(target, draft, args.prompt, spec)
        rows.append({"drafter": name, **split})
    if args.json:
        print(json.dumps({"machine": machine_report(), "rows": rows}, indent=2))
    else:
        print(f"{'drafter':<30} {'shape':<36} {'round':>6} {'draft':>6} {'verify':>6} "
              f"{'catch-up':>8} {'other':>6}  (plain steps)")
        for r in rows:
            p = r["phases_in_plain_steps"]
            print(f"{r['drafter']:<30} {r['speculative']:<36} {r['round_in_plain_steps']:>6.2f} "
                  f"{p['draft']:>6.2f} {p['verify']:>6.2f} {p['catch_up']:>8.2f} "
                  f"{p['other'] + p['accept_commit']:>6.2f}")
    return rows


if __name__ == "__main__":
    main()
