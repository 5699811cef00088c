"""Few-row float32 products on CPU: XLA's dot vs eaglejax's native kernel, side by side.

    python benchmarks/bench_native_matmul.py [--rows 1 2 4 6 8 9 12 16] [--repeats 9]
        [--weight-dtype float32] [--json]

1. Products: the 121 projection matrices of one SmolLM2-135M-Instruct decode step (30 layers
   x qkv, o, gate/up, down, and the tied LM head; 538 MB of float32, half in bfloat16
   storage) times M rows, in one jitted function per path, the two paths alternating repeat
   by repeat. The matrices are stored as `generate` stores them (`--weight-dtype auto`).
2. The target forward over 1, 6 and 9 new tokens after a 200-token context with each path
   (a decode step, a K=5 chain verification, an 8-node tree verification plus its root),
   alternating likewise; the ratios to the 1-token forward of the same path are the verify
   costs in decode steps.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import eaglejax
from eaglejax import hardware, native
from eaglejax.timing import median_seconds
from eaglejax.models import kv_cache
from eaglejax.models.llama import forward, linear, lm_head
from eaglejax.native import few_row_matmul


def step_matrices(params: dict) -> list[jax.Array]:
    """The 2-D weights one forward multiplies, in order."""
    mats = []
    for layer in params["layers"]:
        wqkv, gate_up = layer["wqkv"], layer["w_gate_up"]
        mats += [wqkv.reshape(-1, wqkv.shape[-1]), layer["wo"],
                 gate_up.reshape(-1, gate_up.shape[-1]), layer["w_down"]]
    return mats + [params.get("lm_head", params["embed"])]


def products_fn():
    def run(x: jax.Array, mats: list[jax.Array]) -> jax.Array:
        inputs = {x.shape[-1]: x}
        total = jnp.float32(0)
        for w in mats:
            width = w.shape[1]
            if width not in inputs:
                inputs[width] = jnp.tile(x, (1, -(-width // x.shape[-1])))[:, :width]
            total = total + jnp.sum(linear(inputs[width], w)[:, :8])
        return total
    return jax.jit(run)


def forward_fn(config):
    def run(params, cache, tokens):
        positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
        out = forward(params, config, tokens, positions, cache)
        return jnp.argmax(lm_head(params, out.hidden), -1)
    return jax.jit(run)


def side_by_side(fns: dict, args: dict, repeats: int) -> dict[str, float]:
    """Median ms of each fn on its args, alternating (one warm-up each)."""
    times = {name: [] for name in fns}
    for name, fn in fns.items():
        jax.block_until_ready(fn(*args[name]))
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(median_seconds(fn, args[name], repeats=1, warmup=0))
    return {name: 1e3 * float(np.median(t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 9, 12, 16])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--weight-dtype", default="auto",
                        help="e.g. float32 (default: auto, as `eaglejax generate` stores it)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not few_row_matmul.available():
        raise SystemExit("the native kernel is not available here (no C++ compiler, a failed "
                         "build, or EAGLEJAX_NATIVE=0)")
    target = eaglejax.load_target("smollm2-135m-instruct", weight_dtype=args.weight_dtype)
    mats = step_matrices(target.params)
    report = {"machine": hardware.machine_report(), "weight_dtype": target.storage,
              "products_ms": {}, "forward_ms": {}}
    native_products = products_fn()
    with native.xla_only():
        xla = products_fn()
        xla_forward = forward_fn(target.config)
    native_forward = forward_fn(target.config)
    rng = np.random.default_rng(0)
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, mats[0].shape[1]), dtype=np.float32))
        with native.xla_only():  # a fresh trace per shape must stay on its path
            jax.block_until_ready(xla(x, mats))
        report["products_ms"][m] = side_by_side({"xla": xla, "native": native_products},
                                                {"xla": (x, mats), "native": (x, mats)},
                                                args.repeats)
    c = target.config
    capacity = -(-(args.context + 64) // 128) * 128
    cache = kv_cache.init_cache(c.num_layers, 1, capacity, c.num_kv_heads, c.head_dim,
                                target.dtype)._replace(lengths=jnp.full((1,), args.context,
                                                                        jnp.int32))
    for t in (1, 6, 9):
        tokens = jnp.ones((1, t), jnp.int32)
        with native.xla_only():
            jax.block_until_ready(xla_forward(target.params, cache, tokens))
        report["forward_ms"][t] = side_by_side(
            {"xla": xla_forward, "native": native_forward},
            {"xla": (target.params, cache, tokens), "native": (target.params, cache, tokens)},
            args.repeats)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, "
          f"{report['weight_dtype']} storage")
    print("rows  XLA ms  native ms  (121 SmolLM2 products)")
    for m, t in report["products_ms"].items():
        print(f"{m:4d}  {t['xla']:6.1f}  {t['native']:9.1f}")
    one = report["forward_ms"][1]
    print("tokens  XLA ms (steps)  native ms (steps)  (target forward)")
    for t, ms in report["forward_ms"].items():
        print(f"{t:6d}  {ms['xla']:6.1f} ({ms['xla'] / one['xla']:.2f})  "
              f"{ms['native']:6.1f} ({ms['native'] / one['native']:.2f})")


if __name__ == "__main__":
    main()
