"""Continuous batching, the compiled half: a batch of slots the host refills.

A static batch runs until its longest row ends, so rows that stop early idle. Here the
loop returns to the host when a row that was running finishes, or after a bounded number
of rounds (so the host can stream tokens); the host prefills a queued request into a free
slot (`fill_plain` / `fill_spec` / `fill_target`, one program per prompt-length bucket) and
goes on, without recompiling. The loop runs only the first `rows` slots (a power of two
covering the live ones, which the host keeps low), so a lightly loaded batch costs what a
small one does. Plain and speculative batches alike, and the modes of `auto` over one
speculative batch (`advance_plain_segment`, `advance_probe`, `advance_spec`,
`advance_target`); each row's sampling settings, seed, token limit and stop rules are data
(`SamplingParams` of [S] arrays, `StopTable`), so a row's tokens depend only on its own
request, never on its slot or its neighbours.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp

from eaglejax import native
from eaglejax.config import ModelConfig
from eaglejax.decoding import plain, speculative
from eaglejax.decoding.calibration import round_counts
from eaglejax.decoding.output import Output
from eaglejax.decoding.plain_segment import plain_steps
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.stopping import FINISH_LENGTH, StopTable
from eaglejax.draft.config import DraftConfig
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import Params
from eaglejax.native import cache_attention

State = TypeVar("State", plain.DecodeState, speculative.SpecState)


def _put_rows(state: State, rows: State, start: jax.Array | int) -> State:
    """`state` with the batch rows from `start` replaced by those of `rows` (every leaf but
    the forward counter has the batch axis first; the counter comes from `rows`)."""
    def put(slots: jax.Array, part: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(slots, part.astype(slots.dtype), start, axis=0)

    filled = jax.tree.map(put, state._replace(forwards=None), rows._replace(forwards=None))
    return filled._replace(forwards=rows.forwards)


@functools.partial(jax.jit, static_argnames=("config", "greedy", "attn_impl"),
                   donate_argnames=("state",))
def fill_plain(params: Params, config: ModelConfig, state: plain.DecodeState, slot: jax.Array,
               prompt: jax.Array, prompt_length: jax.Array, row_key: jax.Array,
               sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable, *,
               greedy: bool, attn_impl: AttentionImpl = "auto") -> plain.DecodeState:
    """Prefill one right-padded prompt [1,P] (its settings: [1] arrays) into `slot`, with
    its first token."""
    row = plain.prefill_state(params, config, prompt, prompt_length, row_key, sampling,
                              max_new_tokens, capacity=state.cache.capacity,
                              max_tokens=state.out.tokens.shape[1], greedy=greedy, stop=stop,
                              attn_impl=attn_impl)
    return _put_rows(state, row._replace(forwards=state.forwards), slot)


@functools.partial(jax.jit, static_argnames=("config", "draft_config", "spec", "greedy",
                                             "attn_impl"),
                   donate_argnames=("state",))
def fill_spec(params: Params, config: ModelConfig, draft_params: Params,
              draft_config: DraftConfig, state: speculative.SpecState, slot: jax.Array,
              prompt: jax.Array, prompt_length: jax.Array, row_key: jax.Array,
              sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable, *,
              spec: SpecConfig, greedy: bool,
              attn_impl: AttentionImpl = "auto") -> speculative.SpecState:
    """`fill_plain` for a speculative batch: the target and the head prefilled."""
    row = speculative.prefill_state(
        params, config, draft_params, draft_config, prompt, prompt_length, row_key, sampling,
        max_new_tokens, capacity=state.target_cache.capacity,
        max_tokens=state.out.tokens.shape[1], spec=spec, greedy=greedy, stop=stop,
        attn_impl=attn_impl)
    return _put_rows(state, row._replace(forwards=state.forwards), slot)


@functools.partial(jax.jit, static_argnames=("config", "greedy", "attn_impl"),
                   donate_argnames=("state",))
def fill_target(params: Params, config: ModelConfig, state: speculative.SpecState,
                slot: jax.Array, prompt: jax.Array, prompt_length: jax.Array, row_key: jax.Array,
                sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable, *,
                greedy: bool, attn_impl: AttentionImpl = "auto") -> speculative.SpecState:
    """`fill_plain` into a speculative batch: the target alone, for a row that decodes
    plainly to its end (`advance_target`); the slot's head rows are left as they are, its
    rounds by accepted tokens cleared (the slot's last request's are not this one's)."""
    decoding = plain.DecodeState(state.target_cache, state.last_token, state.out,
                                 state.row_keys, state.forwards)
    done = fill_plain(params, config, decoding, slot, prompt, prompt_length, row_key, sampling,
                      max_new_tokens, stop, greedy=greedy, attn_impl=attn_impl)
    return state._replace(target_cache=done.cache, last_token=done.last_token, out=done.out,
                          row_keys=done.row_keys, forwards=done.forwards,
                          accept_hist=state.accept_hist.at[slot].set(0))


def _first_rows(state: State, rows: int) -> State:
    """The first `rows` slots of `state` (all of it, uncopied, when that is every slot). The
    target cache's K/V buffers stay whole where the native CPU attention reads the first
    rows of a larger cache in place (`models.attention`) and new rows are written into it
    (`kv_cache.write_block`): copying 8 of 32 slots' caches out and back cost ~120 ms per
    call on SmolLM2 (BENCHMARKS.md), more than three decode steps of those rows."""
    if rows == state.out.finish.shape[0]:
        return state
    part = jax.tree.map(lambda x: x[:rows], state._replace(forwards=None))._replace(
        forwards=state.forwards)
    field = "cache" if "cache" in state._fields else "target_cache"
    whole = getattr(state, field)
    if not _read_in_place(whole):
        return part
    return part._replace(**{field: whole._replace(lengths=getattr(part, field).lengths)})


def _read_in_place(cache: kv_cache.KVCache) -> bool:
    """Whether attention reads this cache's first rows without copying them (on a CPU with
    the native kernel: float32 caches)."""
    return (jax.default_backend() == "cpu" and cache.k[0].dtype == jnp.float32
            and native.kernels_allowed() and cache_attention.available())


def _put_back(state: State, part: State, rows: int) -> State:
    return part if rows == state.out.finish.shape[0] else _put_rows(state, part, 0)


def _until_a_row_ends(step: Callable[[State], State], state: State, max_rounds: jax.Array,
                      rows: int) -> State:
    """Run `step` on the first `rows` slots (the rest hold no request) until a row that was
    running finishes, none runs, or `max_rounds` ran."""
    return _counting_until_a_row_ends(lambda s, extra: (step(s), extra), state, (),
                                      max_rounds, rows)[0]


def _counting_until_a_row_ends(step: Callable, state: State, extra, max_rounds: jax.Array,
                               rows: int):
    """`_until_a_row_ends` with `extra` beside the state: step(state, extra) -> (state,
    extra); returns (state, extra)."""
    part = _first_rows(state, rows)
    more = _while_none_ended(part.out.running, max_rounds)

    def body(carry):
        s, e, n = carry
        return (*step(s, e), n + 1)

    part, extra, _ = jax.lax.while_loop(lambda c: more(c[2], c[0].out), body,
                                        (part, extra, jnp.int32(0)))
    return _put_back(state, part, rows), extra


def _while_none_ended(started: jax.Array, max_rounds: jax.Array
                      ) -> Callable[[jax.Array, Output], jax.Array]:
    """(rounds run, output) -> whether to go on: fewer than `max_rounds`, a row running and
    none of the `started` rows finished."""
    return lambda n, out: (n < max_rounds) & jnp.any(out.running) & ~jnp.any(
        started & ~out.running)


@functools.partial(jax.jit, static_argnames=("config", "greedy", "attn_impl", "rows"),
                   donate_argnames=("state",))
def advance_plain(params: Params, config: ModelConfig, state: plain.DecodeState,
                  sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable,
                  max_rounds: jax.Array, *, greedy: bool, rows: int,
                  attn_impl: AttentionImpl = "auto") -> plain.DecodeState:
    """Decode (one token a step) the first `rows` slots until a running row finishes or
    `max_rounds` steps ran; sampling, max_new_tokens and stop are per slot."""
    sampling, max_new_tokens, stop = jax.tree.map(lambda x: x[:rows],
                                                  (sampling, max_new_tokens, stop))
    step = functools.partial(plain.decode_step, params, config, sampling=sampling,
                             max_new_tokens=max_new_tokens, greedy=greedy, stop=stop,
                             attn_impl=attn_impl)
    return _until_a_row_ends(step, state, max_rounds, rows)


@functools.partial(jax.jit, static_argnames=("config", "draft_config", "spec", "greedy",
                                             "attn_impl", "rows"),
                   donate_argnames=("state",))
def advance_spec(params: Params, config: ModelConfig, draft_params: Params,
                 draft_config: DraftConfig, d2t: jax.Array, state: speculative.SpecState,
                 sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable,
                 max_rounds: jax.Array, *, spec: SpecConfig, greedy: bool, rows: int,
                 attn_impl: AttentionImpl = "auto") -> speculative.SpecState:
    """`advance_plain` for a speculative batch: rounds of draft, verify and accept."""
    sampling, max_new_tokens, stop = jax.tree.map(lambda x: x[:rows],
                                                  (sampling, max_new_tokens, stop))
    step = speculative.round_step(params, config, draft_params, draft_config, d2t, sampling,
                                  max_new_tokens, spec=spec, greedy=greedy, stop=stop,
                                  attn_impl=attn_impl)
    return _until_a_row_ends(step, state, max_rounds, rows)


@functools.partial(jax.jit, donate_argnames=("state",))
def release(state: State, slot: jax.Array) -> State:
    """Mark `slot`'s row finished, so the loop stops spending work on it."""
    out = state.out
    return state._replace(out=out._replace(finish=out.finish.at[slot].set(FINISH_LENGTH)))


@functools.partial(jax.jit, static_argnames=("config", "draft_config", "width", "lookup_context",
                                             "greedy", "attn_impl", "rows"),
                   donate_argnames=("state",))
def advance_plain_segment(params: Params, config: ModelConfig, draft_params: Params,
                          draft_config: DraftConfig, state: speculative.SpecState,
                          sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable,
                          max_rounds: jax.Array, *, width: int, lookup_context: bool,
                          greedy: bool, rows: int, attn_impl: AttentionImpl = "auto"
                          ) -> speculative.SpecState:
    """Plain steps in a speculative batch (`decoding.plain_segment`: at most `width`, then
    the head catches up), until a running row finishes or `max_rounds` steps ran."""
    sampling, max_new_tokens, stop = jax.tree.map(lambda x: x[:rows],
                                                  (sampling, max_new_tokens, stop))
    part = _first_rows(state, rows)
    part = plain_steps(params, config, draft_params, draft_config, part, sampling,
                       max_new_tokens, _while_none_ended(part.out.running, max_rounds),
                       width=width, lookup_context=lookup_context, greedy=greedy, stop=stop,
                       attn_impl=attn_impl)
    return _put_back(state, part, rows)


@functools.partial(jax.jit, static_argnames=("config", "draft_config", "spec", "sizes",
                                             "greedy", "attn_impl", "rows"),
                   donate_argnames=("state",))
def advance_probe(params: Params, config: ModelConfig, draft_params: Params,
                  draft_config: DraftConfig, d2t: jax.Array, state: speculative.SpecState,
                  sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable,
                  max_rounds: jax.Array, *, spec: SpecConfig, sizes: tuple[int, ...],
                  greedy: bool, rows: int, attn_impl: AttentionImpl = "auto"
                  ) -> tuple[speculative.SpecState, jax.Array]:
    """`advance_spec` with the largest tree `spec`, also counting per slot what each smaller
    tree would have accepted (`decoding.calibration.round_counts`, summed: [S,C], zero for
    the slots past `rows`)."""
    sampling, max_new_tokens, stop = jax.tree.map(lambda x: x[:rows],
                                                  (sampling, max_new_tokens, stop))
    play = speculative.verified_round(params, config, draft_params, draft_config, d2t, sampling,
                                      max_new_tokens, spec=spec, greedy=greedy, stop=stop,
                                      attn_impl=attn_impl)

    def step(s, counts):
        s, done = play(s)
        return s, counts + round_counts(done, spec, sizes)

    counts = jnp.zeros((rows, len(sizes) * (1 + spec.lookup)), jnp.int32)
    state, counts = _counting_until_a_row_ends(step, state, counts, max_rounds, rows)
    return state, jnp.pad(counts, ((0, state.out.finish.shape[0] - rows), (0, 0)))


@functools.partial(jax.jit, static_argnames=("config", "greedy", "attn_impl", "rows"),
                   donate_argnames=("state",))
def advance_target(params: Params, config: ModelConfig, state: speculative.SpecState,
                   sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable,
                   max_rounds: jax.Array, *, greedy: bool, rows: int,
                   attn_impl: AttentionImpl = "auto") -> speculative.SpecState:
    """`advance_plain` in a speculative batch: the target alone, the head left behind (its
    rows may not speculate again; `serving.engine` lets them decode plainly to the end)."""
    decoding = plain.DecodeState(state.target_cache, state.last_token, state.out,
                                 state.row_keys, state.forwards)
    done = advance_plain(params, config, decoding, sampling, max_new_tokens, stop, max_rounds,
                         greedy=greedy, rows=rows, attn_impl=attn_impl)
    return state._replace(target_cache=done.cache, last_token=done.last_token, out=done.out,
                          forwards=done.forwards)
