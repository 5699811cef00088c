"""Export Llama-3.1-8B's decoding loops for accelerators from a CPU host, and count the
collectives their tensor-parallel sharding implies.

    python benchmarks/export_sharded.py [--layers 32] [--batch 1] [--json out.json]

1. `jax.export` of the plain loop (prefill, decode_loop) and the speculative loop
   (spec_prefill, spec_loop with a one-layer EAGLE-3 head; chain K=5 and the GPU preset's
   dynamic tree 8/6/60) with the Pallas tree-attention kernel inside (Triton for "cuda",
   Mosaic for "tpu"), weights abstract (bf16 shape structs in their shardings), on a
   1-device mesh and on tp=8 (8 simulated host CPU devices).
2. The tp=8 programs compiled for the host (XLA attention) at 1 and 2 layers of the same
   widths: the collectives per decoder layer are the difference (GSPMD's exported
   StableHLO carries sharding annotations, not collectives).
3. Per decode step / speculation round: the all-reduces' payload (B x T x hidden x 2 bytes)
   and what a ring all-reduce on 8 x H100 would take at `--bandwidth` bytes/s per
   direction per GPU plus `--latency` seconds per call (assumptions, not measurements).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import time

import jax

from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.programs import export
from eaglejax.programs.reference import llama31_8b
from eaglejax.sharding import make_mesh

KERNEL_MARK = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
         "collective-permute": "CP"}


def brief(counts: dict[str, int]) -> str:
    return " ".join(f"{n}{SHORT[op]}" for op, n in counts.items() if n) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--bandwidth", type=float, default=450e9,
                        help="NVLink bytes/s per direction per GPU (H100 SXM: 900 GB/s total)")
    parser.add_argument("--latency", type=float, default=10e-6,
                        help="seconds per collective call (NCCL small-message floor, assumed)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()
    if len(jax.devices()) < 8:
        raise SystemExit("needs 8 host devices: XLA_FLAGS=--xla_force_host_platform_"
                         "device_count=8 before jax is imported")

    config = llama31_8b(args.layers)
    shapes = export.LoopShapes(args.batch, args.prompt_len, args.max_new_tokens)
    specs = {"chain5": SpecConfig.chain(5), "tree60": SpecConfig.tree(8, 6, 60)}
    meshes = {1: make_mesh(tp=1, devices=jax.devices()[:1]), 8: make_mesh(tp=8)}

    start = time.perf_counter()
    counts = export.layer_collectives(config, meshes[8], shapes, specs=specs)
    count_s = time.perf_counter() - start
    exports, traffic = [], []
    for mesh in meshes.values():
        programs = export.loop_programs(config, mesh, shapes, specs=specs)
        for platform in ("cuda", "tpu"):
            start = time.perf_counter()
            exported = export.export_programs(programs, (platform,))
            seconds = time.perf_counter() - start
            for program in programs:
                ex = exported[program.name, platform]
                exports.append({
                    "program": program.name, "platform": platform, "devices": ex.nr_devices,
                    "layers": config.num_layers, "module_kb": round(
                        len(ex.mlir_module_serialized) / 1024),
                    "kernel_calls": ex.mlir_module().count(KERNEL_MARK[platform]),
                    "export_s": round(seconds / len(programs), 1)})
    for program in export.loop_programs(config, meshes[8], shapes, specs=specs):
        per_layer, fixed = (counts[program.name][k] for k in ("per_layer", "fixed"))
        where = "call" if "prefill" in program.name else "step"
        per_round = {op: config.num_layers * per_layer[where][op] + fixed[where][op]
                     for op in export.COLLECTIVES}
        payload = export.allreduce_bytes(shapes.batch, program.tokens, config.hidden_size)
        reduces = per_round["all-reduce"]
        others = sum(per_round.values()) - reduces
        traffic.append({
            "program": program.name, "per": where, "per_layer": per_layer, "fixed": fixed,
            "tokens_per_forward": program.tokens, "allreduces": reduces,
            "allreduce_bytes": payload, "other_collectives": others,
            "allreduce_bandwidth_us": reduces * 1e6 * export.ring_allreduce_seconds(
                payload, 8, args.bandwidth),
            "allreduce_latency_us": reduces * args.latency * 1e6,
            "others_latency_us": others * args.latency * 1e6})

    print(f"Exports ({config.num_layers} layers, batch {shapes.batch}, prompt "
          f"{shapes.prompt_len}, {shapes.max_new_tokens} new tokens):\n")
    print("| program | platform | devices | module KB | kernel calls | export s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in exports:
        print(f"| {r['program']} | {r['platform']} | {r['devices']} | {r['module_kb']} | "
              f"{r['kernel_calls']} | {r['export_s']} |")
    print(f"\nCollectives on tp=8 (host-compiled, {count_s:.0f} s), per prefill call or per "
          f"decode step / speculation round, and their predicted time on 8 x H100 "
          f"({args.bandwidth / 1e9:g} GB/s per direction, {args.latency * 1e6:g} us per "
          f"call):\n")
    print("| program | per layer | per layer, hoisted out of the loop | fixed | AR per round "
          "| AR bytes | AR bandwidth time | AR latency | other collectives' latency |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in traffic:
        hoisted = brief(r["per_layer"]["call"]) if r["per"] == "step" else "(no loop)"
        print(f"| {r['program']} | {brief(r['per_layer'][r['per']])} | {hoisted} | "
              f"{brief(r['fixed'][r['per']])} | {r['allreduces']} | "
              f"{r['allreduce_bytes']:,} | {r['allreduce_bandwidth_us']:.1f} us | "
              f"{r['allreduce_latency_us']:.0f} us | {r['others_latency_us']:.0f} us "
              f"({r['other_collectives']}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "exports": exports, "collectives": traffic}, f,
                      indent=1)


if __name__ == "__main__":
    main()
