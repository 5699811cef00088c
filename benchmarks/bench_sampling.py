"""Time `sample_tokens` of this tree against another git revision's, in one process.

    python benchmarks/bench_sampling.py [--against REV] [--vocab 49152] [--rows 1 16]

REV's `eaglejax/decoding/sampling.py` is read with `git show` and imported beside the
current module; both are jitted and timed on the same logits (median of 15 calls after
3 warm-ups) for temperature-only, top-k and top-p sampling. b36f62d (the default) is
the last revision that sorted the whole vocabulary on every call.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.timing import median_seconds
from eaglejax.decoding import sampling as current

SETTINGS = [(0.8, 0, 1.0), (0.8, 50, 1.0), (0.8, 0, 0.9)]


def module_at(revision: str):
    """`eaglejax/decoding/sampling.py` as of `revision`, imported as a module."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{revision}:eaglejax/decoding/sampling.py"],
                            cwd=root, check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"sampling_{revision}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="b36f62d", help="git revision to compare with")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    other = module_at(args.against)
    print(f"{jax.default_backend()}, vocabulary {args.vocab}; {args.against} vs this tree")
    for rows in args.rows:
        logits = jnp.asarray(np.random.RandomState(0).randn(rows, args.vocab) * 3, jnp.float32)
        keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(rows, dtype=jnp.uint32))
        for temperature, top_k, top_p in SETTINGS:
            ms = []
            for module in (other, current):
                params = module.SamplingParams.make(temperature, top_k, top_p)
                fn = jax.jit(lambda x, p, k, m=module: m.sample_tokens(x, p, k, False))
                ms.append(1e3 * median_seconds(fn, (logits, params, keys), repeats=15))
            print(f"rows {rows:3d}  temperature {temperature} top_k {top_k:3d} top_p {top_p}: "
                  f"{args.against} {ms[0]:8.2f} ms, this tree {ms[1]:7.2f} ms, "
                  f"{ms[0] / ms[1]:5.1f}x")


if __name__ == "__main__":
    main()
