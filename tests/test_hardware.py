"""The machine a benchmark names, and the memory floor it compares a decode step with."""

import jax
import numpy as np

from eaglejax.bench import decode_step_bytes
from eaglejax.hardware import copy_bandwidth_gb_s, cpu_cores, cpu_model, machine_report, \
    memory_floor_ms


def test_machine_report_names_the_cpu_and_measures_bandwidth():
    report = machine_report()
    assert report["cpu"] == cpu_model() and report["cpu"].strip()
    assert report["cores"] == cpu_cores() >= 1
    assert isinstance(report["isa"], list) and report["jax"] == jax.__version__
    # Any machine this runs on moves between 0.1 GB/s and 10 TB/s.
    assert 0.1 < report["copy_bandwidth_gb_s"] < 1e4
    assert 0.1 < copy_bandwidth_gb_s(megabytes=16, repeats=2, threads=1) < 1e4


def test_memory_floor_is_bytes_over_bandwidth():
    assert memory_floor_ms(540_000_000, 19.0) == 540_000_000 / 19e9 * 1e3


def _count_bytes(target, context, batch):
    """Independent count: every parameter, minus the untied embedding table except the
    looked-up rows, plus K and V of every cached position of every layer."""
    c, p = target.config, target.params
    total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(p))
    if "lm_head" in p:
        total -= p["embed"].size * p["embed"].dtype.itemsize
        total += batch * c.hidden_size * p["embed"].dtype.itemsize
    return total + batch * context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4


def test_decode_step_bytes(target_of):
    for family in ("llama", "tied"):
        target = target_of(family)
        for context, batch in ((0, 1), (100, 1), (37, 4)):
            assert decode_step_bytes(target, context, batch) == _count_bytes(target, context,
                                                                             batch)
    stored = target_of("tied").with_weight_dtype("bfloat16")
    matrices = sum(x.size for x in jax.tree.leaves(stored.params) if x.dtype.itemsize == 2)
    assert decode_step_bytes(target_of("tied"), 0) - decode_step_bytes(stored, 0) \
        == 2 * matrices
