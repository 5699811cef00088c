"""Benchmark the Pallas tree-attention kernel against the XLA reference.

Reports the median time per call and the achieved bandwidth (bytes of K/V cache the
kernel must read, i.e. ``2 * B * prefix * Hkv * D * itemsize``, divided by the time),
next to a device-to-device copy bandwidth measured on the same device. The cache is in
the head-major ``[B, Hkv, S, D]`` layout the model keeps (``kv_layout="bhsd"``) unless
``--kv-layout`` says otherwise.

    python benchmarks/bench_tree_attention.py            # Llama-3-8B layer shapes, bf16
    python benchmarks/bench_tree_attention.py --quick    # tiny CPU smoke run (interpret mode)
    python benchmarks/bench_tree_attention.py --json     # machine-readable output
    python benchmarks/bench_tree_attention.py --kv-layout both   # bhsd and bshd side by side

On CPU there is no compiled kernel: only --quick runs it (in interpret mode, tiny shapes);
otherwise only the reference is timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eaglejax.timing import median_seconds  # noqa: E402
from pallas_kernels import tree_attention, tree_attention_reference  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32, "f16": jnp.float16}


def copy_bandwidth(n_bytes: int, repeats: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write."""
    x = jnp.zeros((n_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: jnp.copy(a))
    return 2 * x.nbytes / median_seconds(copy, (x,), repeats, warmup=2)


def tree_mask(rng: np.random.Generator, batch: int, t_new: int) -> np.ndarray:
    """Ancestor-or-self masks of random draft trees (nodes in topological order)."""
    masks = np.zeros((batch, t_new, t_new), bool)
    for b in range(batch):
        parent = [-1] + [int(rng.integers(0, j)) for j in range(1, t_new)]
        for t in range(t_new):
            j = t
            while j >= 0:
                masks[b, t, j] = True
                j = parent[j]
    return masks


def make_inputs(batch, prefix, capacity, t_new, n_q, n_kv, head_dim, dtype, kv_layout="bhsd",
                seed=0):
    """Inputs with the cache allocated directly in ``kv_layout`` (no transposed copy)."""
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    ks = jax.random.split(key, 5)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)  # noqa: E731
    q = normal(ks[0], (batch, t_new, n_q, head_dim))
    cache_shape = ((batch, capacity, n_kv, head_dim) if kv_layout == "bshd"
                   else (batch, n_kv, capacity, head_dim))
    k_cache = normal(ks[1], cache_shape)
    v_cache = normal(ks[2], cache_shape)
    k_new = normal(ks[3], (batch, t_new, n_kv, head_dim))
    v_new = normal(ks[4], (batch, t_new, n_kv, head_dim))
    lengths = jnp.full((batch,), prefix, jnp.int32)
    mask = jnp.asarray(tree_mask(rng, batch, t_new))
    return q, k_cache, v_cache, lengths, k_new, v_new, mask


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes; runs on CPU in interpret mode")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prefix", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--new-tokens", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--capacity", type=int, default=None,
                   help="cache slots S (default: the prefix); > prefix shows length skipping")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--block-k", type=int, default=None)
    p.add_argument("--kv-layout", choices=["bhsd", "bshd", "both"], default="bhsd",
                   help="cache layout: bhsd = [B,Hkv,S,D] (the model's), bshd = [B,S,Hkv,D]")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.prefix, args.new_tokens = [1, 2], [40, 100], [1, 5]
        args.q_heads, args.kv_heads, args.head_dim = 4, 2, 64
        args.dtype, args.repeats = "f32", 3
    return args


def bench_one(args, kernel, reference, kv_layout, batch, prefix, t_new, dtype, run_kernel,
              copy_bw) -> dict:
    capacity = max(args.capacity or prefix, prefix)
    inputs = make_inputs(batch, prefix, capacity, t_new, args.q_heads, args.kv_heads,
                         args.head_dim, dtype, kv_layout)
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * batch * prefix * args.kv_heads * args.head_dim * itemsize
    ref_s = median_seconds(reference, inputs, args.repeats, warmup=2)
    ker_s = median_seconds(kernel, inputs, args.repeats, warmup=2) if run_kernel else None
    return {
        "kv_layout": kv_layout,
        "batch": batch, "prefix": prefix, "capacity": capacity, "new_tokens": t_new,
        "q_heads": args.q_heads, "kv_heads": args.kv_heads,
        "head_dim": args.head_dim, "dtype": args.dtype, "kv_bytes": kv_bytes,
        "reference_us": ref_s * 1e6, "reference_gbps": kv_bytes / ref_s / 1e9,
        "kernel_us": None if ker_s is None else ker_s * 1e6,
        "kernel_gbps": None if ker_s is None else kv_bytes / ker_s / 1e9,
        "kernel_fraction_of_copy": None if ker_s is None else kv_bytes / ker_s / copy_bw,
    }


def print_row(row: dict) -> None:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    ker_us, ref_us = row["kernel_us"], row["reference_us"]
    speedup = None if ker_us is None else ref_us / ker_us
    print(f"{row['kv_layout']:>6} {row['batch']:>3} {row['prefix']:>6} {row['new_tokens']:>3} "
          f"{fmt(ker_us, '10.1f')} {ref_us:>10.1f} {fmt(speedup, '7.2f')} "
          f"{fmt(row['kernel_gbps'], '11.1f')} {row['reference_gbps']:>9.1f} "
          f"{fmt(row['kernel_fraction_of_copy'], '11.2%')}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    run_kernel = not on_cpu or args.quick
    dtype = DTYPES[args.dtype]
    layouts = ["bhsd", "bshd"] if args.kv_layout == "both" else [args.kv_layout]
    kernels = {lay: jax.jit(functools.partial(tree_attention, interpret=on_cpu,
                                              block_k=args.block_k, kv_layout=lay))
               for lay in layouts}
    references = {lay: jax.jit(functools.partial(tree_attention_reference, kv_layout=lay))
                  for lay in layouts}
    copy_bw = copy_bandwidth((64 if on_cpu else 1024) << 20, max(3, args.repeats // 2))
    mode = ("interpret" if on_cpu else "compiled") if run_kernel else "skipped"
    if not args.json:
        print(f"device: {jax.devices()[0].device_kind} ({platform}); kernel: {mode}")
        print(f"device-to-device copy: {copy_bw / 1e9:.1f} GB/s (read + write)")
        print(f"{'layout':>6} {'B':>3} {'prefix':>6} {'T':>3} {'kernel_us':>10} {'ref_us':>10} "
              f"{'speedup':>7} {'kernel_GB/s':>11} {'ref_GB/s':>9} {'kernel/copy':>11}")
    results = []
    for batch in args.batch:
        for prefix in args.prefix:
            for t_new in args.new_tokens:
                for kv_layout in layouts:
                    row = bench_one(args, kernels[kv_layout], references[kv_layout], kv_layout,
                                    batch, prefix, t_new, dtype, run_kernel, copy_bw)
                    results.append(row)
                    if not args.json:
                        print_row(row)
    if args.json:
        print(json.dumps({
            "device": jax.devices()[0].device_kind, "platform": platform,
            "kernel_mode": mode,
            "copy_gbps": copy_bw / 1e9, "results": results,
        }, indent=2))


if __name__ == "__main__":
    main()
