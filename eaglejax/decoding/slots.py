"""Continuous batching for plain decoding: a fixed set of slots that the host refills.

A static batch runs until its longest row ends, so rows that stop early idle. Here the
compiled loop returns to the host as soon as any row finishes (or after a bounded number of
steps); the host collects that row and prefills the next queued request into its slot, at
the position the row left, without recompiling (one program per prompt-length bucket and
one for the loop). A row's tokens depend only on its prompt, its seed and the settings,
never on which slot it ran in or on its neighbours.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.decoding import plain
from eaglejax.decoding.buckets import bucket
from eaglejax.decoding.output import empty_output
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.stopping import (
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_REASONS,
    StopCriteria,
)
from eaglejax.errors import InputError
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import Params, compute_dtype
from eaglejax.target import Target

MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt (token ids) to continue for at most `max_new_tokens`, sampled with `seed`.
    `key` is the caller's name for it, handed back with the completion."""

    key: Hashable
    prompt: Sequence[int]
    seed: int
    max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: its new token ids and why it stopped ("eos", "stop", "length")."""

    key: Hashable
    token_ids: list[int]
    finish_reason: str


@functools.partial(jax.jit, static_argnames=("config", "greedy", "stop", "attn_impl"),
                   donate_argnames=("state",))
def fill_slot(params: Params, config: ModelConfig, state: plain.DecodeState, slot: jax.Array,
              prompt: jax.Array, prompt_length: jax.Array, row_key: jax.Array,
              sampling: SamplingParams, max_new_tokens: jax.Array, *, greedy: bool,
              stop: StopCriteria, attn_impl: AttentionImpl = "auto") -> plain.DecodeState:
    """Prefill one right-padded prompt [1,P] and put it, with its first token, in `slot`."""
    row = plain.prefill(params, config, prompt, prompt_length, row_key, sampling,
                        max_new_tokens, capacity=state.cache.capacity,
                        max_tokens=state.out.tokens.shape[1], greedy=greedy, stop=stop,
                        attn_impl=attn_impl)

    def put(slots: jax.Array, one: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(slots, one.astype(slots.dtype), slot, axis=0)

    # Every leaf but the forward counter has the slot axis first.
    filled = jax.tree.map(put, state._replace(forwards=None), row._replace(forwards=None))
    return filled._replace(forwards=state.forwards)


@functools.partial(jax.jit, static_argnames=("config", "greedy", "stop", "attn_impl"),
                   donate_argnames=("state",))
def advance(params: Params, config: ModelConfig, state: plain.DecodeState,
            sampling: SamplingParams, max_new_tokens: jax.Array, max_steps: jax.Array, *,
            greedy: bool, stop: StopCriteria,
            attn_impl: AttentionImpl = "auto") -> plain.DecodeState:
    """Decode until a row that was running finishes, none runs, or `max_steps` steps ran
    (max_new_tokens [S] is each slot's limit)."""
    started = state.out.running
    step = functools.partial(plain.decode_step, params, config, sampling=sampling,
                             max_new_tokens=max_new_tokens, greedy=greedy, stop=stop,
                             attn_impl=attn_impl)

    def keep_going(carry):
        s, n = carry
        running = s.out.running
        return (n < max_steps) & jnp.any(running) & ~jnp.any(started & ~running)

    state, _ = jax.lax.while_loop(keep_going, lambda c: (step(c[0]), c[1] + 1),
                                  (state, jnp.int32(0)))
    return state


class SlotEngine:
    """Plain decoding of queued requests over `num_slots` rows of `capacity` cache slots
    each (prompt plus reply must fit). Usage: `submit` requests (also while running), then
    call `step` until `idle`; each call returns the requests that finished in it."""

    def __init__(self, target: Target, *, num_slots: int, capacity: int,
                 sampling: SamplingParams, stop: StopCriteria, steps_per_call: int = 64):
        if num_slots < 1 or capacity < 2:
            raise InputError(f"SlotEngine needs num_slots >= 1 and capacity >= 2, got "
                             f"{num_slots} and {capacity}")
        limit = target.config.max_position_embeddings
        if capacity > limit:
            raise InputError(f"capacity {capacity} exceeds the model's context of {limit} tokens")
        self.target, self.capacity = target, capacity
        self.sampling, self.stop = sampling, stop
        self.greedy = bool(sampling.temperature == 0)
        self.steps_per_call = jnp.int32(steps_per_call)
        config = target.config
        cache = kv_cache.init_cache(config.num_layers, num_slots, capacity, config.num_kv_heads,
                                    config.head_dim, compute_dtype(target.params))
        out = empty_output(num_slots, capacity)
        out = out._replace(finish=jnp.full((num_slots,), FINISH_LENGTH, jnp.int32))  # all free
        keys = jax.vmap(jax.random.PRNGKey)(jnp.zeros((num_slots,), jnp.uint32))
        self.state = plain.DecodeState(cache, jnp.zeros((num_slots,), jnp.int32), out, keys,
                                       jnp.int32(0))
        self.max_new = np.zeros((num_slots,), np.int32)
        self.queue: collections.deque[Request] = collections.deque()
        self.slots: list[Request | None] = [None] * num_slots

    @property
    def idle(self) -> bool:
        """No request is queued or running."""
        return not self.queue and all(r is None for r in self.slots)

    @property
    def forwards(self) -> int:
        """Target forwards the loop has run (decode steps over all slots)."""
        return int(self.state.forwards)

    def submit(self, request: Request) -> None:
        """Queue a request (checked here: its prompt and reply must fit a slot)."""
        n = len(request.prompt)
        if n == 0 or n >= self.capacity:
            raise InputError(f"request {request.key!r}: prompt of {n} tokens; a slot holds "
                             f"prompts of 1 to {self.capacity - 1} tokens")
        if request.max_new_tokens < 1:
            raise InputError(f"request {request.key!r}: max_new_tokens must be >= 1, got "
                             f"{request.max_new_tokens}")
        self.queue.append(request)

    def _fill(self, slot: int, request: Request) -> None:
        n = len(request.prompt)
        prompt = np.zeros((1, min(bucket(n, MIN_PROMPT_BUCKET), self.capacity)), np.int32)
        prompt[0, :n] = request.prompt
        # The cache holds the prompt, then every new token but the last.
        self.max_new[slot] = min(request.max_new_tokens, self.capacity - n + 1)
        row_key = jax.random.PRNGKey(jnp.uint32(request.seed))[None]
        self.state = fill_slot(self.target.params, self.target.config, self.state,
                               jnp.int32(slot), jnp.asarray(prompt), jnp.asarray([n], jnp.int32),
                               row_key, self.sampling, jnp.int32(self.max_new[slot]),
                               greedy=self.greedy, stop=self.stop,
                               attn_impl=self.target.attn_impl)
        self.slots[slot] = request

    def step(self) -> list[Completion]:
        """Fill free slots from the queue, decode until some row finishes (at most
        `steps_per_call` steps), and return the completed requests."""
        for slot, request in enumerate(self.slots):
            if request is None and self.queue:
                self._fill(slot, self.queue.popleft())
        filled = np.array([r is not None for r in self.slots])
        finish = np.asarray(jax.device_get(self.state.out.finish))
        if np.any(filled & (finish == FINISH_NONE)):  # else all ended on their first token
            self.state = advance(self.target.params, self.target.config, self.state,
                                 self.sampling, jnp.asarray(self.max_new), self.steps_per_call,
                                 greedy=self.greedy, stop=self.stop,
                                 attn_impl=self.target.attn_impl)
            finish = np.asarray(jax.device_get(self.state.out.finish))
        done = np.flatnonzero(filled & (finish != FINISH_NONE))
        if done.size == 0:
            return []
        tokens, counts = jax.device_get((self.state.out.tokens, self.state.out.counts))
        completions = []
        for i in done:
            completions.append(Completion(self.slots[i].key, tokens[i, :counts[i]].tolist(),
                                          FINISH_REASONS[int(finish[i])]))
            self.slots[i] = None
        return completions

    def run(self, requests: Sequence[Request] = ()) -> list[Completion]:
        """Submit `requests` and decode until idle; completions in finishing order."""
        for request in requests:
            self.submit(request)
        completions = []
        while not self.idle:
            completions.extend(self.step())
        return completions
