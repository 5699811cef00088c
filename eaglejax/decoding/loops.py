"""The decoding loops behind one interface, and the programs every driver compiles.

A run decodes with a *loop* (static: the configs, the speculative shape, the attention
implementation; hashable, so one `jit` argument) over *weights* (arrays: the target's
parameters and, when speculating, the draft head's and its draft-to-target id map; one
pytree). Plain and speculative loops answer the same calls:

- `prefill_state(weights, prompt, prompt_lengths, row_keys, sampling, max_new_tokens, *,
  capacity, max_tokens, greedy, stop, logprobs=None)`: the state after right-padded
  prompts, each row's first new token recorded (`logprobs`: the output also keeps the
  target's log-probabilities of each token and of that many most likely ones);
- `step(weights, sampling, max_new_tokens, *, greedy, stop)`: state -> state, one target
  forward (a plain step, or a speculative round: draft, verify, accept, catch up), traced
  inside a caller's loop;
- `scratch_rows`: cache rows a step needs beyond the tokens it keeps.

Both states carry `target_cache`, `last_token`, `out`, `row_keys` and `forwards`, so code
that reads the output or the target's cache serves either. `prefill` and `decode_loop` are
the compiled programs `generate`, the benchmarks, export and the roofline run;
`decoding.slots` builds the serving engine's programs from the same calls, and
`decoding.bundle` pairs a target and head with their loop and the target's mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Protocol, Union

import jax
import jax.numpy as jnp

from eaglejax.config import ModelConfig
from eaglejax.decoding import plain, speculative
from eaglejax.decoding.drafters.head_state import HeadState
from eaglejax.decoding.prefill import PREFILL_CHUNK
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.stopping import FINISH_LENGTH, StopCriteria, StopTable
from eaglejax.draft.config import DraftConfig
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import Params
from eaglejax.sharding.rules import constrain

State = Union[plain.DecodeState, speculative.SpecState]
Step = Callable[[State], State]


class Weights(NamedTuple):
    """The arrays a loop reads: the target's parameters and, when speculating, the draft
    head's (or draft model's) parameters and its draft-to-target id map [DV], and for a
    shape that searches them (`SpecConfig.uses_history`) the replies decoded before
    (`decoding.suffix_history`: int32 [H], one shape however full, so nothing recompiles)."""

    target: Params
    draft: Params | None = None
    d2t: jax.Array | None = None
    history: jax.Array | None = None


class Loop(Protocol):
    """What `prefill`, `decode_loop` and `decoding.slots` need of a loop (module docstring)."""

    config: ModelConfig
    attn_impl: AttentionImpl

    @property
    def scratch_rows(self) -> int: ...

    def prefill_state(self, weights: Weights, prompt: jax.Array, prompt_lengths: jax.Array,
                      row_keys: jax.Array, sampling: SamplingParams,
                      max_new_tokens: jax.Array, *, capacity: int, max_tokens: int,
                      greedy: bool, stop: StopCriteria | StopTable,
                      prefill_chunk: int = PREFILL_CHUNK, cached: Any = None,
                      logprobs: int | None = None) -> State: ...

    def step(self, weights: Weights, sampling: SamplingParams, max_new_tokens: jax.Array, *,
             greedy: bool, stop: StopCriteria | StopTable) -> Step: ...


@dataclasses.dataclass(frozen=True)
class PlainLoop:
    """Plain decoding: one token per row and target forward (`decoding.plain`)."""

    config: ModelConfig
    attn_impl: AttentionImpl = "auto"

    @property
    def scratch_rows(self) -> int:
        return 0

    def prefill_state(self, weights: Weights, prompt: jax.Array, prompt_lengths: jax.Array,
                      row_keys: jax.Array, sampling: SamplingParams,
                      max_new_tokens: jax.Array, *, capacity: int, max_tokens: int,
                      greedy: bool, stop: StopCriteria | StopTable,
                      prefill_chunk: int = PREFILL_CHUNK,
                      cached: kv_cache.KVCache | None = None,
                      logprobs: int | None = None) -> plain.DecodeState:
        return plain.prefill_state(
            weights.target, self.config, prompt, prompt_lengths, row_keys, sampling,
            max_new_tokens, capacity=capacity, max_tokens=max_tokens, greedy=greedy,
            stop=stop, attn_impl=self.attn_impl, prefill_chunk=prefill_chunk, cached=cached,
            logprobs=logprobs)

    def step(self, weights: Weights, sampling: SamplingParams, max_new_tokens: jax.Array, *,
             greedy: bool, stop: StopCriteria | StopTable) -> Step:
        return functools.partial(plain.decode_step, weights.target, self.config,
                                 sampling=sampling, max_new_tokens=max_new_tokens,
                                 greedy=greedy, stop=stop, attn_impl=self.attn_impl)


@dataclasses.dataclass(frozen=True)
class SpecLoop:
    """Speculative decoding in the shape `spec` (`decoding.speculative`), drafting with a
    head of `draft_config` (a `ModelConfig`: a draft model; None for a method that drafts
    with neither). `through` (one of
    `speculative.PHASES`) other than "catch_up" truncates every round after that phase, for
    timing only (`eaglejax.round_split`)."""

    config: ModelConfig
    draft_config: DraftConfig | ModelConfig | None
    spec: SpecConfig
    attn_impl: AttentionImpl = "auto"
    through: str = "catch_up"

    @property
    def scratch_rows(self) -> int:
        return self.spec.most_nodes

    def prefill_state(self, weights: Weights, prompt: jax.Array, prompt_lengths: jax.Array,
                      row_keys: jax.Array, sampling: SamplingParams,
                      max_new_tokens: jax.Array, *, capacity: int, max_tokens: int,
                      greedy: bool, stop: StopCriteria | StopTable,
                      prefill_chunk: int = PREFILL_CHUNK,
                      cached: speculative.Cached | None = None,
                      logprobs: int | None = None) -> speculative.SpecState:
        return speculative.prefill_state(
            weights.target, self.config, weights.draft, self.draft_config, weights.d2t,
            prompt, prompt_lengths, row_keys, sampling, max_new_tokens, capacity=capacity,
            max_tokens=max_tokens, spec=self.spec, greedy=greedy, stop=stop,
            attn_impl=self.attn_impl, prefill_chunk=prefill_chunk, cached=cached,
            logprobs=logprobs, history=weights.history)

    def step(self, weights: Weights, sampling: SamplingParams, max_new_tokens: jax.Array, *,
             greedy: bool, stop: StopCriteria | StopTable) -> Step:
        play = self.verified_step(weights, sampling, max_new_tokens, greedy=greedy, stop=stop)
        return lambda s: play(s)[0]

    def verified_step(self, weights: Weights, sampling: SamplingParams,
                      max_new_tokens: jax.Array, *, greedy: bool,
                      stop: StopCriteria | StopTable
                      ) -> Callable[[speculative.SpecState],
                                    tuple[speculative.SpecState, speculative.Round | None]]:
        """`step` that also returns what the round drafted and verified
        (`speculative.Round`, for counters kept beside the state)."""
        return speculative.verified_round(
            weights.target, self.config, weights.draft, self.draft_config, weights.d2t,
            sampling, max_new_tokens, spec=self.spec, greedy=greedy, stop=stop,
            attn_impl=self.attn_impl, through=self.through, history=weights.history)

    def with_spec(self, spec: SpecConfig) -> "SpecLoop":
        """This loop in another speculative shape (the same head and state layout)."""
        return dataclasses.replace(self, spec=spec)

    def target_alone(self) -> PlainLoop:
        """The plain loop of this loop's target (for rows that leave the head behind)."""
        return PlainLoop(self.config, self.attn_impl)


def goes_on(state: State, until: jax.Array | None) -> jax.Array:
    """Whether a loop runs another step: a row is running and (given `until`) the state has
    run fewer than `until` target forwards."""
    running = jnp.any(state.out.running)
    return running if until is None else running & (state.forwards < until)


@functools.partial(jax.jit, static_argnames=("loop", "capacity", "max_tokens", "greedy",
                                             "stop", "prefill_chunk", "logprobs"))
def prefill(loop: Loop, weights: Weights, prompt: jax.Array, prompt_lengths: jax.Array,
            row_keys: jax.Array, sampling: SamplingParams, max_new_tokens: jax.Array, *,
            capacity: int, max_tokens: int, greedy: bool, stop: StopCriteria,
            prefill_chunk: int = PREFILL_CHUNK, logprobs: int | None = None) -> State:
    """`loop.prefill_state`, compiled: right-padded prompts [B,P] (`prefill_chunk` tokens at
    a time) into caches of `capacity` rows, outputs of `max_tokens` (keeping `logprobs`
    most likely tokens' log-probabilities, if not None), first tokens recorded."""
    return loop.prefill_state(weights, prompt, prompt_lengths, row_keys, sampling,
                              max_new_tokens, capacity=capacity, max_tokens=max_tokens,
                              greedy=greedy, stop=stop, prefill_chunk=prefill_chunk,
                              logprobs=logprobs)


@functools.partial(jax.jit, static_argnames=("loop", "greedy", "stop"),
                   donate_argnames=("state",))
def decode_loop(loop: Loop, weights: Weights, state: State, sampling: SamplingParams,
                max_new_tokens: jax.Array, until: jax.Array | None = None, *, greedy: bool,
                stop: StopCriteria) -> State:
    """`loop.step` until every row has finished, or (given `until`) until the state has run
    `until` target forwards."""
    step = loop.step(weights, sampling, max_new_tokens, greedy=greedy, stop=stop)
    return jax.lax.while_loop(lambda s: goes_on(s, until), step, state)


def map_caches(state: State, fn: Callable[[kv_cache.KVCache], kv_cache.KVCache]) -> State:
    """`state` with `fn` applied to its target cache and, where the drafter is an EAGLE head's
    (`HeadState`), to the head's cache: the caches a paged batch keeps in block pools (a
    draft model's or DFlash drafter's cache stays per slot)."""
    state = state._replace(target_cache=fn(state.target_cache))
    head = getattr(state, "drafter", None)
    if isinstance(head, HeadState):
        state = state._replace(drafter=head._replace(cache=fn(head.cache)))
    return state


def empty_state(loop: Loop, weights: Weights, rows: int, *, capacity: int, max_tokens: int,
                stop: StopTable, logprobs: int | None = None,
                paged: tuple[int, int] | None = None) -> State:
    """A batch of `rows` free slots (every row finished, every value zero), shaped as
    `loop`'s prefill of `rows` prompts (traced abstractly, never run). `paged` (blocks,
    block size): the target's cache, and an EAGLE head's, are paged ones of that many blocks
    each (`kv_cache`; the same block ids and tables), their tables pointing at none. Traced
    over a mesh, every array is replicated but the target's pools (KV heads split)."""
    prompt = jnp.zeros((rows, 1), jnp.int32)  # the state's shapes do not depend on it
    keys = jax.vmap(jax.random.PRNGKey)(jnp.zeros((rows,), jnp.uint32))
    sampling = SamplingParams(jnp.zeros(rows), jnp.zeros(rows, jnp.int32), jnp.ones(rows))
    shapes = jax.eval_shape(lambda w: loop.prefill_state(
        w, prompt, jnp.ones((rows,), jnp.int32), keys, sampling, jnp.ones((rows,), jnp.int32),
        capacity=capacity, max_tokens=max_tokens, greedy=True, stop=stop, logprobs=logprobs),
        weights)
    if paged is None:
        state = _replicated_zeros(shapes)
    else:
        state = _with_paged_caches(_replicated_zeros(map_caches(shapes, lambda cache: None)),
                                   shapes, *paged)
    finish = jnp.full((rows,), FINISH_LENGTH, jnp.int32)
    return state._replace(out=state.out._replace(finish=finish))


def _replicated_zeros(shapes: Any) -> Any:
    """Zeros of the shapes in the tree `shapes`, replicated over a mesh being traced over."""
    return jax.tree.map(lambda s: constrain(jnp.zeros(s.shape, s.dtype), (None,) * s.ndim),
                        shapes)


def _with_paged_caches(state: State, shapes: State, blocks: int, size: int) -> State:
    """`state` (without caches) with empty paged caches of `blocks` blocks of `size`
    positions for the rows and layers of the contiguous caches `shapes` has: the target's,
    its KV heads split over a mesh as a slot cache's are, and an EAGLE head's, replicated as
    the head is (every device runs the head's attention whole; its one layer's pool is
    small)."""
    def paged(cache: kv_cache.KVCache, heads_axis: str | None) -> kv_cache.KVCache:
        rows, kv, width, dim = cache.k[0].shape
        return kv_cache.init_paged_cache(len(cache.k), rows, blocks, size, width // size, kv,
                                         dim, cache.k[0].dtype, heads_axis)

    state = state._replace(target_cache=paged(shapes.target_cache, "kv_heads"))
    head = getattr(shapes, "drafter", None)
    if isinstance(head, HeadState):
        state = state._replace(drafter=state.drafter._replace(cache=paged(head.cache, None)))
    return state
