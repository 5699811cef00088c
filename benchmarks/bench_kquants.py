"""GGUF K-quant storage's products on CPU beside Q4_1 blocks and bfloat16: the matrices of
Llama-shaped decoder layers (random values), times M rows, through `models.llama.linear` (the
native kernels where they run), one after the other as in a forward, the storages
alternating repeat by repeat (compare them only within one run).

    python benchmarks/bench_kquants.py [--hidden 2048] [--intermediate 8192] [--layers 2]
        [--rows 1 8] [--repeats 15] [--json]

The default widths are Llama-3.2-1B's (32 query heads of 64, 8 KV heads): per layer wqkv
[3072, 2048], wo [2048, 2048], w_gate_up [2 x 8192, 2048], w_down [2048, 8192]. Q4_K and
Q6_K are random super-blocks (any stored values are valid), Q4_1 and bfloat16 the same
random float weights quantized or rounded.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench_native_matmul import side_by_side
from eaglejax import hardware
from eaglejax.models import gguf_blocks
from eaglejax.models.gguf_blocks import KINDS, HostBlocks
from eaglejax.models.llama import linear


def kquant(kind: str, n: int, k: int, rng: np.random.Generator) -> gguf_blocks.BlockMatrix:
    """A random matrix [n, k] in `kind` (Q4_K or Q6_K) super-blocks."""
    spec = KINDS[kind]
    values = rng.integers(0, 1 << spec.bits, size=(n, k), dtype=np.uint8)
    supers = (rng.uniform(0.5, 1.5, size=(n, k // 256, spec.supers)) * 1e-4).astype(np.float16)
    if kind == "Q4_K":
        scales = rng.integers(0, 64, size=(n, k // 32), dtype=np.uint8)
        mins = rng.integers(0, 64, size=(n, k // 32), dtype=np.uint8)
        return gguf_blocks.pack(HostBlocks(spec, values, scales, mins, supers))
    scales = rng.integers(-128, 128, size=(n, k // 16), dtype=np.int8)
    return gguf_blocks.pack(HostBlocks(spec, values, scales, None, supers))


def layer_shapes(hidden: int, intermediate: int) -> list[tuple[int, int]]:
    """The 2-D products of a decoder layer with 32 query and 8 KV heads of hidden / 32."""
    head = hidden // 32
    return [((32 + 16) * head, hidden), (hidden, hidden), (2 * intermediate, hidden),
            (hidden, intermediate)]


def products(x: jax.Array, mats: list) -> jax.Array:
    """Every matrix times x (tiled to its width), each input waiting on the sums before it."""
    total = jnp.float32(0)
    for w in mats:
        width = w.shape[-1]
        rows = jnp.tile(x, (1, -(-width // x.shape[-1])))[:, :width] + 0 * total
        total = total + jnp.sum(linear(rows, w)[:, :8])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shapes = layer_shapes(args.hidden, args.intermediate) * args.layers
    floats = [rng.standard_normal(s, dtype=np.float32) * 0.02 for s in shapes]
    storages = {"Q4_K": [kquant("Q4_K", *s, rng) for s in shapes],
                "Q6_K": [kquant("Q6_K", *s, rng) for s in shapes],
                "Q4_1": [gguf_blocks.quantize(w) for w in floats],
                "bfloat16": [jnp.asarray(w, jnp.bfloat16) for w in floats]}
    del floats
    fn = jax.jit(products)
    report = {"machine": hardware.machine_report(), "shapes": shapes,
              "bytes_per_weight": {name: sum(m.nbytes for m in mats)
                                   / sum(a * b for a, b in shapes)
                                   for name, mats in storages.items()},
              "products_ms": {}}
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, args.hidden), dtype=np.float32))
        report["products_ms"][m] = side_by_side(
            {name: fn for name in storages}, {name: (x, mats) for name, mats in storages.items()},
            args.repeats)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['machine']['cpu']}: {args.layers} layers of {args.hidden} x "
          f"{args.intermediate} ({sum(a * b for a, b in shapes) / 1e6:.0f}M weights); ms per "
          "pass over them (ratio to bfloat16)")
    print("         " + "  ".join(f"{name:>16}" for name in storages))
    print("bits/w   " + "  ".join(f"{8 * b:16.3f}" for b in report["bytes_per_weight"].values()))
    for m, ms in report["products_ms"].items():
        cells = "  ".join(f"{t:8.2f} ({t / ms['bfloat16']:.2f})" for t in ms.values())
        print(f"{m:3d} rows {cells}")


if __name__ == "__main__":
    main()
