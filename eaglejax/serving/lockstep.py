"""Several processes, one engine: process 0 schedules, every process runs the same steps.

On a mesh that spans processes (`jax.distributed`), every compiled call of the engine is a
collective that all processes must make in the same order with the same inputs. Process 0
wraps its engine in `LockstepEngine` (the `Engine` interface): each `step()` first
publishes that step's submissions and cancellations in the run's key-value store, then
applies them and steps. Every other process runs `follow(engine)`, which reads the same
messages in order and replays them on its own engine. Request keys must be strings or
integers (they travel as JSON). A process may run several such sessions one after another:
the k-th `LockstepEngine` of process 0 and the k-th `follow` of every other process share
the k-th session's messages.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Hashable
from typing import Any

from eaglejax.errors import InputError
from eaglejax.serving.engine import Engine, Request, SamplingOptions, Update
from eaglejax.sharding.distributed import forget, publish, receive

PREFIX = "eaglejax/lockstep"
KEEP_MESSAGES = 64  # a follower is at most one step behind: older messages are deleted
_sessions = itertools.count()  # this process's lockstep sessions so far


def _encode(request: Request) -> dict[str, Any]:
    if not isinstance(request.key, (str, int)):
        raise InputError(f"request {request.key!r}: a multi-process engine needs str or int "
                         f"keys")
    return {"op": "submit", "key": request.key, "prompt": list(request.prompt),
            "max_new_tokens": request.max_new_tokens,
            "sampling": dataclasses.asdict(request.sampling),
            "stop_sequences": [list(seq) for seq in request.stop_sequences],
            "ignore_eos": request.ignore_eos,
            "stop_token_ids": [int(t) for t in request.stop_token_ids],
            "logprobs": request.logprobs, "deadline": request.deadline}


def _decode(op: dict[str, Any]) -> Request:
    return Request(op["key"], op["prompt"], op["max_new_tokens"],
                   SamplingOptions(**op["sampling"]),
                   tuple(tuple(seq) for seq in op["stop_sequences"]), op["ignore_eos"],
                   tuple(op["stop_token_ids"]), op["logprobs"], op["deadline"])


def _apply(engine: Engine, ops: list[dict[str, Any]], progress: bool = False
           ) -> list[Update] | None:
    """Replay one message's operations; the step's updates, or None after "stop"."""
    updates: list[Update] = []
    for op in ops:
        kind = op["op"]
        if kind == "submit":
            engine.submit(_decode(op))
        elif kind == "cancel":
            engine.cancel(op["key"])
        elif kind == "warmup":
            engine.warmup(progress=progress)
        elif kind == "step":
            updates = engine.step(op["now"])  # process 0's clock: the same requests end
        elif kind == "stop":
            return None
    return updates


class LockstepEngine:
    """Process 0's engine in a multi-process run; the other processes `follow`. Same
    interface as `Engine` (its other attributes are the wrapped engine's)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._ops: list[dict[str, Any]] = []
        self._sent = 0
        self._channel = f"{PREFIX}/{next(_sessions)}"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    @property
    def idle(self) -> bool:
        return self.engine.idle and not self._ops

    @property
    def num_queued(self) -> int:
        return self.engine.num_queued + sum(op["op"] == "submit" for op in self._ops)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def submit(self, request: Request) -> None:
        """Check `request` now (InputError, QueueFull), queue it at the next step on every
        process (where the queue then holds no more than it does here)."""
        self.engine.check(request)
        self.engine.refuse_if_full(request, self.num_queued)
        op = _encode(request)
        if any(o["op"] == "submit" and o["key"] == request.key for o in self._ops):
            raise InputError(f"request {request.key!r}: a live request already has this key")
        self._ops.append(op)

    def cancel(self, key: Hashable) -> None:
        self._ops.append({"op": "cancel", "key": key})

    def step(self, now: float | None = None) -> list[Update]:
        now = time.monotonic() if now is None else now
        ops, self._ops = self._ops + [{"op": "step", "now": now}], []
        self._send(ops)
        return _apply(self.engine, ops)

    def warmup(self, progress: bool = True) -> None:
        self._send([{"op": "warmup"}])
        self.engine.warmup(progress)

    run = Engine.run  # submit, then step until idle

    def close(self) -> None:
        """Tell the followers to return."""
        self._send([{"op": "stop"}])

    def _send(self, ops: list[dict[str, Any]]) -> None:
        publish(f"{self._channel}/{self._sent}", json.dumps(ops))
        if self._sent >= KEEP_MESSAGES:
            forget(f"{self._channel}/{self._sent - KEEP_MESSAGES}")
        self._sent += 1


def follow(engine: Engine, poll_s: float = 10.0) -> None:
    """Replay process 0's messages on this process's `engine` until it closes."""
    channel, received = f"{PREFIX}/{next(_sessions)}", 0
    while True:
        message = receive(f"{channel}/{received}", poll_s)
        if message is None:
            continue
        received += 1
        if _apply(engine, json.loads(message)) is None:
            return
