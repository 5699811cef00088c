"""Several processes, one program (`jax.distributed`): starting them, agreeing on inputs,
and bringing results back to every process."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from eaglejax.errors import ConfigError, InputError

ENV = {"coordinator": "EAGLEJAX_COORDINATOR", "num_processes": "EAGLEJAX_NUM_PROCESSES",
       "process_id": "EAGLEJAX_PROCESS_ID"}


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join a multi-process run: arguments, else `EAGLEJAX_COORDINATOR`,
    `EAGLEJAX_NUM_PROCESSES` and `EAGLEJAX_PROCESS_ID`. Nothing given: a single process
    (returns False). CPU processes exchange collectives over gloo."""
    given = {"coordinator": coordinator, "num_processes": num_processes,
             "process_id": process_id}
    for name, variable in ENV.items():
        if given[name] is None and os.environ.get(variable):
            given[name] = os.environ[variable]
    if all(value is None for value in given.values()):
        return False
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise InputError(f"a multi-process run needs coordinator, num_processes and "
                         f"process_id; missing {', '.join(missing)} (flags --coordinator, "
                         f"--num-processes, --process-id or ${ENV[missing[0]]})")
    try:
        count, rank = int(given["num_processes"]), int(given["process_id"])
    except ValueError:
        raise InputError(f"num_processes and process_id must be integers, got "
                         f"{given['num_processes']!r} and {given['process_id']!r}") from None
    if count < 1 or not 0 <= rank < count:
        raise InputError(f"process_id must be in [0, num_processes={count}), got {rank}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(str(given["coordinator"]), count, rank)
    return True


def broadcast_from_first(value: Any) -> Any:
    """Process 0's `value` (a tree of arrays) on every process; `value` itself alone."""
    if jax.process_count() == 1:
        return value
    return multihost_utils.broadcast_one_to_all(value)


def prompts_from_first(prompts: list[list[int]], seeds: list[int]
                       ) -> tuple[list[list[int]], list[int]]:
    """Process 0's token-id prompts and row seeds on every process (each process may have
    read its own copy of the input; process 0's is the one that runs)."""
    if jax.process_count() == 1:
        return prompts, seeds
    header = np.array([len(prompts), max(map(len, prompts))], np.int64)
    count, longest = (int(n) for n in broadcast_from_first(header))
    table = np.full((count, longest + 2), -1, np.int64)  # seed, length, ids...
    if jax.process_index() == 0:
        for row, (ids, seed) in enumerate(zip(prompts, seeds)):
            table[row, :len(ids) + 2] = [seed, len(ids), *ids]
    table = np.asarray(broadcast_from_first(table))
    return ([row[2:2 + row[1]].tolist() for row in table], [int(row[0]) for row in table])


def fetch(tree: Any) -> Any:
    """Host numpy copies of a tree of (global) arrays on every process, gathered from the
    other processes where this one holds only part of an array."""
    def one(x: Any) -> np.ndarray:
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(jax.device_get(x))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def _store():
    """The jax.distributed client (its key-value store), or ConfigError outside a
    multi-process run."""
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise ConfigError("not a multi-process run: call eaglejax.sharding.distributed."
                          "initialize (or pass --coordinator/--num-processes/--process-id)")
    return client


def publish(key: str, message: str) -> None:
    """Store `message` under `key` in the run's key-value store (for every process)."""
    _store().key_value_set(key, message)


def receive(key: str, timeout_s: float) -> str | None:
    """The message under `key`, waiting up to `timeout_s`; None if none came."""
    try:
        return _store().blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as err:  # the client raises a runtime error on its deadline
        if "DEADLINE_EXCEEDED" in str(err) or "timed out" in str(err).lower():
            return None
        raise


def forget(key: str) -> None:
    """Delete `key` from the key-value store."""
    _store().key_value_delete(key)
