"""SmolLM2's 30 attention calls of one forward (9 query / 3 KV heads of 64), the native
cache attention vs XLA's reference, side by side in one process (median of repeats).

    python benchmarks/bench_cache_attention.py [--context 300]

Shapes: decode steps (1 query) and verify blocks (6, 9, 13 queries) of one row, and 16
rows decoding (continuous batching) at capacities 512 and 1024; every row holds
`--context` cached tokens.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from eaglejax import hardware
from eaglejax.timing import median_seconds
from eaglejax.native import cache_attention

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
SHAPES = [(1, 1, 512), (1, 6, 512), (1, 9, 512), (1, 13, 512), (16, 1, 512), (16, 1, 1024)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=300)
    args = parser.parse_args()
    if not cache_attention.available():
        raise SystemExit("the native kernel is unavailable here (no compiler or EAGLEJAX_NATIVE=0)")
    reference = functools.partial(pallas_kernels.tree_attention_reference, kv_layout="bhsd")
    kernel = jax.jit(functools.partial(cache_attention.attention, reference=reference))
    xla = jax.jit(reference)
    rng = np.random.default_rng(0)
    rows = []
    for batch, queries, capacity in SHAPES:
        def normal(*shape):
            return jnp.asarray(rng.standard_normal(shape), jnp.float32)
        cache = normal(batch, KV_HEADS, capacity, HEAD_DIM)
        new = normal(batch, queries, KV_HEADS, HEAD_DIM)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((queries, queries), bool)),
                                  (batch, queries, queries))
        operands = (normal(batch, queries, Q_HEADS, HEAD_DIM), cache, cache,
                    jnp.full((batch,), args.context, jnp.int32), new, new, causal)
        native_ms = LAYERS * 1e3 * median_seconds(kernel, operands)
        xla_ms = LAYERS * 1e3 * median_seconds(xla, operands)
        rows.append({"rows": batch, "queries": queries, "capacity": capacity,
                     "native_ms": round(native_ms, 2), "xla_ms": round(xla_ms, 2)})
        print(f"{batch:2d} rows x {queries:2d} queries, capacity {capacity}: native "
              f"{native_ms:6.2f} ms, XLA {xla_ms:6.2f} ms ({LAYERS} layers)", flush=True)
    print(json.dumps({"cpu": hardware.cpu_model(), "context": args.context, "results": rows}))


if __name__ == "__main__":
    main()
