"""`make_mesh`: a `dp` x `tp` device mesh (data parallel x tensor parallel)."""

from __future__ import annotations

import contextlib
from typing import ContextManager, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from eaglejax import validation
from eaglejax.errors import InputError

AXES = ("dp", "tp")


def make_mesh(tp: int = 1, dp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of `dp * tp` devices with axes ("dp", "tp"): rows of a batch split over `dp`,
    attention heads, MLP width and vocabulary over `tp` (see `eaglejax.sharding.rules`).

    `devices`: default the first `dp * tp` of `jax.devices()` (all of them, every process's,
    under `jax.distributed`), in that order, so `tp` neighbours are adjacent devices (the fastest links on a
    GPU host, the tightest ring on a TPU slice). Both axes are `AxisType.Auto`: the
    compiler propagates shardings from the weights and the constraints eaglejax places.
    """
    tp = validation.integer("tp", tp, 1)
    dp = validation.integer("dp", dp, 1)
    if devices is None:  # one process may use some of its devices; several use them all
        devices = jax.devices()
        if jax.process_count() == 1:
            devices = devices[:tp * dp]
    devices = list(devices)
    if tp * dp != len(devices):
        raise InputError(f"a mesh of dp={dp} x tp={tp} needs {dp * tp} devices, but "
                         f"{len(devices)} are given (jax.devices(): {len(jax.devices())})")
    grid = np.asarray(devices, dtype=object).reshape(dp, tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_context(mesh: Mesh | None) -> ContextManager:
    """Trace over `mesh` inside the block (`jax.set_mesh`: the loops' sharding constraints
    and `shard_map` find it there); nothing without one."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
