"""Versions of a quantized native kernel side by side in one process: the 121 products of a
SmolLM2-135M-Instruct decode step for M rows, one after the other as in a forward (each
input waits on the sums before it: left independent, XLA ran them side by side and hid each
call's start and tail), each version built from its own source.

    python benchmarks/bench_kernel_variants.py [--kernel block|int8] OLD.cc [NEW.cc ...]
        [--rows 1 6 8 12] [--repeats 21] [--json]

E.g. the repository's kernel against an earlier commit's:

    git show HEAD~3:eaglejax/native/block_matmul.cc > /tmp/before.cc
    python benchmarks/bench_kernel_variants.py /tmp/before.cc eaglejax/native/block_matmul.cc

Each source is compiled as eaglejax builds its kernels (`native.build.FLAGS`, against the
headers of this tree's `eaglejax/native`), its handler registered with XLA under a name of
its own, and the versions run alternately, repeat by repeat (this machine is shared and
noisy: compare versions only within one run). `--kernel block` multiplies the GGUF file's
own blocks (`weight_dtype="gguf"`, `block_matmul.cc`), `--kernel int8` int8 storage
(`int8_matmul.cc`). Every version must give the same sums (checked) and take the current
arguments (block kernels from before the K-quants took no supers).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eaglejax
from bench_native_matmul import step_matrices
from eaglejax import hardware
from eaglejax.native import build
from eaglejax.timing import median_seconds

KERNELS = {"block": ("EaglejaxBlockMatmul", "gguf"), "int8": ("EaglejaxInt8Matmul", "int8")}


def register(source: Path, symbol: str, index: int) -> str:
    """Build `source` with its handler `symbol` renamed, register it; the FFI target name."""
    folder = Path(tempfile.mkdtemp(prefix="eaglejax-variant-"))
    renamed = f"{symbol}Variant{index}"
    (folder / "kernel.cc").write_text(source.read_text().replace(symbol, renamed))
    cxx = build.compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler")
    native_dir = Path(build.__file__).parent
    subprocess.run([cxx, *build.FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{native_dir}",
                    str(folder / "kernel.cc"), "-o", str(folder / "kernel.so")], check=True)
    library = ctypes.cdll.LoadLibrary(str(folder / "kernel.so"))
    target = f"eaglejax_variant_{index}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, renamed)),
                                platform="cpu")
    return target


def products_fn(target: str, kernel: str):
    """One jitted call of every step matrix on x (tiled to each width), through `target`."""
    def run(x: jax.Array, mats: list) -> jax.Array:
        empty = jnp.zeros((0,), jnp.float32)
        total = jnp.float32(0)
        for w in mats:
            width = w.shape[-1]
            # one after the other, as in a forward (each input waits on the sums before it)
            rows = jnp.tile(x, (1, -(-width // x.shape[-1])))[:, :width] + 0 * total
            out = jax.ShapeDtypeStruct((x.shape[0], w.packed.shape[0] * w.packed.shape[2]),
                                       jnp.float32)
            common = dict(prologue=np.int32(0), eps=np.float32(0))
            if kernel == "block":
                kind = w.block_kind
                y = jax.ffi.ffi_call(target, out)(
                    rows, w.packed, w.scales, w.mins, w.supers, empty, empty, **common,
                    offset=np.int32(kind.offset), bits=np.int32(kind.bits))
            else:
                y = jax.ffi.ffi_call(target, out)(rows, w.packed, w.scales.reshape(-1), empty,
                                                  empty, **common)
            total = total + jnp.sum(y[:, :8])
        return total
    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", type=Path, help="kernel sources (.cc)")
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="block")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 6, 8, 12])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    symbol, storage = KERNELS[args.kernel]
    targets = [register(source, symbol, i) for i, source in enumerate(args.sources)]
    model = eaglejax.load_target("smollm2-135m-instruct", weight_dtype=storage)
    mats = step_matrices(model.params)
    fns = [products_fn(target, args.kernel) for target in targets]
    rng = np.random.default_rng(0)
    report = {"machine": hardware.machine_report(), "storage": model.storage,
              "sources": [str(s) for s in args.sources], "products_ms": {}}
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, mats[0].shape[-1]), dtype=np.float32))
        sums = [float(fn(x, mats)) for fn in fns]  # compiles; the versions must agree
        if len(set(sums)) != 1:
            raise SystemExit(f"the versions disagree at {m} rows: {sums}")
        times = [[] for _ in fns]
        for _ in range(args.repeats):
            for fn, t in zip(fns, times):
                t.append(median_seconds(fn, (x, mats), repeats=1, warmup=0))
        report["products_ms"][m] = [1e3 * float(np.median(t)) for t in times]
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['machine']['cpu']}, {report['storage']}: ms for the 121 products of a "
          "decode step (ratio to the first source)")
    for m, ms in report["products_ms"].items():
        cells = "  ".join(f"{s.name}: {t:6.2f} ({t / ms[0]:.2f})"
                          for s, t in zip(args.sources, ms))
        print(f"{m:3d} rows  {cells}")


if __name__ == "__main__":
    main()
