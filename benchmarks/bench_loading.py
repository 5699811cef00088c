"""Load time of the default model: GGUF (dequantize + convert) vs an eaglejax checkpoint.

    python benchmarks/bench_loading.py [--repeats 3]
Writes the checkpoint to a temporary directory, then alternates the two loads.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import eaglejax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "smollm2"
        eaglejax.load_target("smollm2-135m-instruct").save(str(checkpoint))
        times: dict[str, list[float]] = {"gguf_s": [], "checkpoint_s": []}
        for _ in range(args.repeats):
            for key, source in (("gguf_s", "smollm2-135m-instruct"), ("checkpoint_s", checkpoint)):
                start = time.perf_counter()
                eaglejax.load_target(source)
                times[key].append(time.perf_counter() - start)
    report = {key: min(values) for key, values in times.items()}
    report["speedup"] = report["gguf_s"] / report["checkpoint_s"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
