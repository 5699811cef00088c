"""What a benchmark ran on: the CPU, its cores, its measured memory bandwidth, and the
memory floor of a decode step (the bytes it must read over that bandwidth)."""

from __future__ import annotations

import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def _cpuinfo_field(name: str) -> str | None:
    """The first `name : value` line of /proc/cpuinfo (None off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def cpu_model() -> str:
    """The CPU's model name with its family/model numbers (virtual machines often show
    only 'AMD EPYC'; family 25 model 17 is Zen 4), e.g. 'AMD EPYC (family 25, model 17)'."""
    name = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    family, model = _cpuinfo_field("cpu family"), _cpuinfo_field("model")
    return f"{name} (family {family}, model {model})" if family and model else name


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, not the host's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def isa_features() -> list[str]:
    """The vector-ISA flags that decide XLA:CPU's kernels (AVX2, AVX-512, bf16, AMX)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return [f for f in ISA_FLAGS if f in flags]


def copy_bandwidth_gb_s(megabytes: int = 256, repeats: int = 7,
                        threads: int | None = None) -> float:
    """Measured memory bandwidth in GB/s, STREAM-copy convention: bytes read plus bytes
    written per second while copying a float32 buffer far larger than the caches.

    The buffer is split over `threads` workers (default: every usable core; numpy releases
    the GIL while copying); the median of `repeats` copies after one warm-up is taken.
    """
    threads = threads or cpu_cores()
    src = np.ones(megabytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    chunks = np.array_split(np.arange(src.size), threads)
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.size]

    def copy_part(lo: int, hi: int) -> None:
        np.copyto(dst[lo:hi], src[lo:hi])

    times = []
    for i in range(repeats + 1):
        workers = [threading.Thread(target=copy_part, args=b) for b in bounds]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if i:
            times.append(time.perf_counter() - start)
    return 2 * src.nbytes / float(np.median(times)) / 1e9


def machine_report(bandwidth: bool = True) -> dict[str, Any]:
    """The machine a benchmark ran on; `bandwidth` adds a measured copy bandwidth (~1 s)."""
    report: dict[str, Any] = {
        "cpu": cpu_model(), "cores": cpu_cores(), "isa": isa_features(),
        "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
    }
    if bandwidth:
        report["copy_bandwidth_gb_s"] = round(copy_bandwidth_gb_s(), 2)
    return report


def memory_floor_ms(bytes_per_step: int, bandwidth_gb_s: float) -> float:
    """The least time a step can take that must read `bytes_per_step` at that bandwidth."""
    return bytes_per_step / (bandwidth_gb_s * 1e9) * 1e3
