"""A target and its optional draft head as the one pair a compiled program takes (its loop,
static, and its weights, arrays) and the one place that knows where they run: inputs put on
the target's mesh, programs run and compiled under it, results fetched to the host.

Every driver (`decoding.batch`, `decoding.adaptive`, `eaglejax.round_split`, the serving
engine) decodes through a `Bundle`; on one device its mesh steps do nothing.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from eaglejax import compilation_cache
from eaglejax.decoding.loops import Loop, PlainLoop, SpecLoop, State, Weights, empty_state
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.stopping import StopTable
from eaglejax.decoding.suffix_history import shared_history
from eaglejax.models.placement import committed, replicate
from eaglejax.sharding.distributed import fetch
from eaglejax.sharding.mesh import mesh_context

if TYPE_CHECKING:
    from eaglejax.draft.draft import Draft
    from eaglejax.target import Target


class Timed(NamedTuple):
    """A compiled call's result, the seconds spent compiling it and running it."""

    result: Any
    compile_s: float
    run_s: float


def compile_once(fn: Callable, *args, **kwargs) -> float:
    """Compile jitted `fn` for these arguments ahead of time (a lookup when this process
    already did; maybe a persistent cache load); the seconds it took. A call with the same
    arguments reuses the program."""
    start = time.perf_counter()
    with compilation_cache.caching_every_program():
        fn.lower(*args, **kwargs).compile()
    return time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Bundle:
    """`loop` over `weights`, placed as the target is (`mesh`: None on one device).

    A program is a jitted function whose first two arguments are the loop and the weights
    (`decoding.loops.prefill`, `decode_loop`, `decoding.slots`' programs, ...): `run(fn,
    *args)` calls `fn(loop, weights, *args)` under the mesh."""

    loop: Loop
    weights: Weights
    mesh: Mesh | None = None

    @classmethod
    def of(cls, target: "Target", draft: "Draft | None" = None,
           spec: SpecConfig | None = None) -> "Bundle":
        """The plain loop of `target` (no `spec`), or its speculative loop with `draft` (None
        for a method that drafts without a head); a shape that reads the history of earlier
        replies (`SpecConfig.uses_history`) with the history as it is now."""
        if spec is None:
            return cls(PlainLoop(target.config, target.attn_impl), Weights(target.params),
                       target.mesh)
        if draft is None:
            models = cls(SpecLoop(target.config, None, spec, target.attn_impl),
                         Weights(target.params), target.mesh)
        else:
            models = cls(SpecLoop(target.config, draft.config, spec, target.attn_impl),
                         Weights(target.params, draft.params, draft.d2t), target.mesh)
        return models.with_current_history() if spec.uses_history else models

    def with_loop(self, loop: Loop) -> "Bundle":
        """The same weights and mesh under another loop (e.g. another speculative shape)."""
        return dataclasses.replace(self, loop=loop)

    def with_spec(self, spec: SpecConfig) -> "Bundle":
        return self.with_loop(self.loop.with_spec(spec))

    def with_current_history(self) -> "Bundle":
        """For suffix drafting or a lookup branch with history: the process's shared history
        of earlier replies as it is now (`decoding.suffix_history`) in the weights (one
        shape: nothing recompiles)."""
        history = self.put(shared_history().tokens)
        return dataclasses.replace(self, weights=self.weights._replace(history=history))

    def put(self, tree: Any) -> Any:
        """Host values as device arrays; on a mesh, global arrays replicated over it (every
        process passes the same values)."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, tree)
        return replicate(tree, self.mesh)

    def run(self, fn: Callable, *args, **static) -> Any:
        """`fn(loop, weights, *args, **static)` under the mesh (returns as soon as it is
        dispatched)."""
        with mesh_context(self.mesh):
            return fn(self.loop, self.weights, *args, **static)

    def compile(self, fn: Callable, *args, **static) -> float:
        """`compile_once` of `run`'s call: the seconds it took."""
        with mesh_context(self.mesh):
            return compile_once(fn, self.loop, self.weights, *args, **static)

    def compile_then_run(self, fn: Callable, *args, **static) -> Timed:
        """`compile`, then `run` to completion: compiling and running timed apart."""
        compile_s = self.compile(fn, *args, **static)
        start = time.perf_counter()
        result = jax.block_until_ready(self.run(fn, *args, **static))
        return Timed(result, compile_s, time.perf_counter() - start)

    def empty_state(self, rows: int, *, capacity: int, max_tokens: int, stop: StopTable,
                    logprobs: int | None = None, paged: tuple[int, int] | None = None
                    ) -> State:
        """`loops.empty_state` of this loop, placed on the mesh: replicated at first, but a
        paged target cache's pools, created with their KV heads split (`kv_cache.
        init_paged_cache`: a replicated pool would hold every head on every device). On one
        device, committed to it (`placement.committed`), as the states programs return are
        wherever a weight is (a head loaded from disk)."""
        def free_slots() -> State:
            return empty_state(self.loop, self.weights, rows, capacity=capacity,
                               max_tokens=max_tokens, stop=stop, logprobs=logprobs,
                               paged=paged)

        if self.mesh is None:
            return committed(free_slots())
        with mesh_context(self.mesh):  # global arrays (every process)
            return jax.jit(free_slots)()

    @staticmethod
    def fetch(tree: Any) -> Any:
        """Host numpy copies of a tree of device arrays (gathered from every process)."""
        return fetch(tree)
