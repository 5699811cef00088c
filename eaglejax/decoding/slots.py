"""Continuous batching, the compiled half: a batch of slots the host refills.

A static batch runs until its longest row ends, so rows that stop early idle. Here the
loop returns to the host when a row that was running finishes, or after a bounded number
of rounds (so the host can stream tokens); the host prefills a queued request into a free
slot (`fill`, or `fill_target` for the target alone; one program per prompt-length bucket) and
goes on, without recompiling. The loop runs only the first `rows` slots (a power of two
covering the live ones, which the host keeps low), so a lightly loaded batch costs what a
small one does. Every program takes a loop and its weights first (`decoding.loops`): plain
and speculative batches alike run `fill` and `advance`, and the modes of `auto` over one
speculative batch also `advance_plain_segment`, `advance_probe` and `advance_target`; each
row's sampling settings, seed, token limit and stop rules are data (`SamplingParams` of [S]
arrays, `StopTable`), so a row's tokens depend only on its own request, never on its slot
or its neighbours.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp

from eaglejax import native
from eaglejax.decoding import plain, speculative
from eaglejax.decoding.calibration import check_long_copy, count_columns, round_counts
from eaglejax.decoding.loops import Loop, SpecLoop, Weights, map_caches
from eaglejax.decoding.output import Output
from eaglejax.decoding.plain_segment import plain_steps
from eaglejax.decoding.prefix_pool import PrefixPool, load_rows
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.stopping import FINISH_LENGTH, FINISH_NONE, StopTable
from eaglejax.models import kv_cache
from eaglejax.native import cache_attention

State = TypeVar("State", plain.DecodeState, speculative.SpecState)


def _is_cache(x: Any) -> bool:
    return isinstance(x, kv_cache.KVCache)


def _put_rows(state: State, rows: State, start: jax.Array | int) -> State:
    """`state` with the batch rows from `start` replaced by those of `rows` (every leaf but
    the forward counter has the batch axis first, and a paged cache's pools none: its rows'
    blocks are written, `kv_cache.put_rows`; the counter comes from `rows`)."""
    def put(slots: jax.Array, part: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(slots, part.astype(slots.dtype), start, axis=0)

    def put_part(slots: Any, part: Any) -> Any:
        if _is_cache(slots) and slots.tables is not None:
            return kv_cache.put_rows(slots, part, start)
        return jax.tree.map(put, slots, part)

    filled = jax.tree.map(put_part, state._replace(forwards=None), rows._replace(forwards=None),
                          is_leaf=_is_cache)
    return filled._replace(forwards=rows.forwards)


@functools.partial(jax.jit, static_argnames=("loop", "greedy"), donate_argnames=("state",))
def fill(loop: Loop, weights: Weights, state: State, slot: jax.Array, prompt: jax.Array,
         prompt_length: jax.Array, row_key: jax.Array, sampling: SamplingParams,
         max_new_tokens: jax.Array, stop: StopTable, *, greedy: bool) -> State:
    """Prefill one right-padded prompt [1,P] (its settings: [1] arrays) into `slot`, with
    its first token (a speculative loop prefills the head too)."""
    return _prefilled(loop, weights, state, slot, prompt, prompt_length, row_key, sampling,
                      max_new_tokens, stop, greedy)


def _prefilled(loop: Loop, weights: Weights, state: State, slot: jax.Array, prompt: jax.Array,
               prompt_length: jax.Array, row_key: jax.Array, sampling: SamplingParams,
               max_new_tokens: jax.Array, stop: StopTable, greedy: bool,
               cached: Any = None) -> State:
    """`fill`'s work inside a program; with `cached`, after the rows it holds (the loop's
    `prefill_state` takes it)."""
    kept = state.out.logprobs
    row = loop.prefill_state(weights, prompt, prompt_length, row_key, sampling, max_new_tokens,
                             capacity=state.target_cache.capacity,
                             max_tokens=state.out.tokens.shape[1], greedy=greedy, stop=stop,
                             cached=cached, logprobs=None if kept is None else kept.width)
    return _put_rows(state, row._replace(forwards=state.forwards), slot)


def _with_target_row(state: speculative.SpecState, done: plain.DecodeState,
                     slot: jax.Array) -> speculative.SpecState:
    """A speculative batch whose target part is `done` (a row filled by the target alone):
    the slot's head rows left as they are, its rounds by accepted tokens cleared (the slot's
    last request's are not this one's)."""
    return state._replace(**done._asdict(), accept_hist=state.accept_hist.at[slot].set(0))


def _target_part(state: speculative.SpecState) -> plain.DecodeState:
    """The fields of a speculative state that plain decoding carries."""
    return plain.DecodeState(*(getattr(state, name) for name in plain.DecodeState._fields))


@functools.partial(jax.jit, static_argnames=("loop", "greedy"), donate_argnames=("state",))
def fill_target(loop: SpecLoop, weights: Weights, state: speculative.SpecState,
                slot: jax.Array, prompt: jax.Array, prompt_length: jax.Array, row_key: jax.Array,
                sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable, *,
                greedy: bool) -> speculative.SpecState:
    """`fill` into a speculative batch: the target alone, for a row that decodes plainly to
    its end (`advance_target`; `_with_target_row`)."""
    done = _prefilled(loop.target_alone(), weights, _target_part(state), slot, prompt,
                      prompt_length, row_key, sampling, max_new_tokens, stop, greedy)
    return _with_target_row(state, done, slot)


@functools.partial(jax.jit, static_argnames=("loop", "greedy", "head"),
                   donate_argnames=("state",))
def fill_cached(loop: Loop, weights: Weights, state: State, slot: jax.Array,
                pool: PrefixPool | None, head_pool: PrefixPool | None, blocks: jax.Array,
                cached: jax.Array, rest: jax.Array, rest_length: jax.Array, prompt: jax.Array,
                row_key: jax.Array, sampling: SamplingParams, max_new_tokens: jax.Array,
                stop: StopTable, *, greedy: bool, head: bool) -> State:
    """`fill` of a `prompt` [1,C] whose first cached [1] positions the prefix cache holds in
    pool `blocks` [n] (in order; n * BLOCK covers the slot's cache, entries past the hit
    unused): their rows are copied in and only the `rest` [1,R] (right-padded, rest_length
    [1] tokens) is prefilled: with the head (`head`), whose rows come from `head_pool`'s
    same blocks, or by the target alone (in a speculative batch the row then decodes
    plainly, as after `fill_target`). `pool` (and `head_pool`) None: the blocks are the
    paged batch's own, target's and head's alike: the prefill reads the hit blocks already
    in the slot's table in place (shared with other rows, never written) and writes the rest
    into the slot's own blocks; the hit's last block, whose last row is prefilled again (the
    head's row there consumes this prompt's next token), is copied into the slot's own block
    at that entry first."""
    cache = state.target_cache
    if pool is not None:
        rows = load_rows(pool, blocks, cached, cache.capacity)
        heads = (load_rows(head_pool, blocks, cached, state.drafter.cache.capacity) if head
                 else None)
        return _fill_after_rows(loop, weights, state, slot, rows, heads, rest, rest_length,
                                prompt, row_key, sampling, max_new_tokens, stop, greedy)
    # Paged: the prefill reads the shared blocks in place and writes the slot's own ones.
    last = cached[0] // cache.k[0].shape[2]
    table = jax.lax.dynamic_slice_in_dim(cache.tables, slot, 1, axis=0)

    def with_last_block_copied(c: kv_cache.KVCache) -> kv_cache.KVCache:
        copy = lambda pool: pool.at[table[0, last]].set(pool[blocks[last]])  # noqa: E731
        return c._replace(k=tuple(map(copy, c.k)), v=tuple(map(copy, c.v)))

    state = map_caches(state, with_last_block_copied)
    view = lambda c: kv_cache.KVCache(c.k, c.v, cached.astype(jnp.int32), table)  # noqa: E731
    return _fill_after_rows(loop, weights, state, slot, view(state.target_cache),
                            view(state.drafter.cache) if head else None, rest, rest_length,
                            prompt, row_key, sampling, max_new_tokens, stop, greedy)


def _fill_after_rows(loop: Loop, weights: Weights, state: State, slot: jax.Array,
                     rows: kv_cache.KVCache, heads: kv_cache.KVCache | None, rest: jax.Array,
                     rest_length: jax.Array, prompt: jax.Array, row_key: jax.Array,
                     sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable,
                     greedy: bool) -> State:
    """`fill_cached` after the hit: the target's `rows` and the head's `heads` (one-row
    caches, or a paged slot's view of the pools; None: the target alone prefills)."""
    settings = (rest, rest_length, row_key, sampling, max_new_tokens, stop, greedy)
    if heads is not None:
        return _prefilled(loop, weights, state, slot, *settings,
                          cached=speculative.Cached(rows, heads, prompt))
    if isinstance(state, speculative.SpecState):
        done = _prefilled(loop.target_alone(), weights, _target_part(state), slot, *settings,
                          cached=rows)
        return _with_target_row(state, done, slot)
    return _prefilled(loop, weights, state, slot, *settings, cached=rows)


def _first_rows(state: State, rows: int) -> State:
    """The first `rows` slots of `state` (all of it, uncopied, when that is every slot; a
    paged cache's pools whole, `kv_cache.first_rows`). A contiguous target cache's K/V
    buffers stay whole where the native CPU attention reads the first
    rows of a larger cache in place (`models.attention`) and new rows are written into it
    (`kv_cache.write_block`): copying 8 of 32 slots' caches out and back cost ~120 ms per
    call on SmolLM2 (BENCHMARKS.md), more than three decode steps of those rows."""
    if rows == state.out.finish.shape[0]:
        return state

    def first(x: Any) -> Any:
        if _is_cache(x) and x.tables is not None:
            return kv_cache.first_rows(x, rows)
        return jax.tree.map(lambda a: a[:rows], x)

    part = jax.tree.map(first, state._replace(forwards=None), is_leaf=_is_cache)._replace(
        forwards=state.forwards)
    whole = state.target_cache
    if whole.tables is not None or not _read_in_place(whole):
        return part
    return part._replace(target_cache=whole._replace(lengths=part.target_cache.lengths))


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


def _first_settings(rows: int, *settings):
    """The per-slot settings of the first `rows` slots."""
    return jax.tree.map(lambda x: x[:rows], settings)


@functools.partial(jax.jit, static_argnames=("loop", "greedy", "rows"),
                   donate_argnames=("state",))
def advance(loop: Loop, weights: Weights, state: State, sampling: SamplingParams,
            max_new_tokens: jax.Array, stop: StopTable, max_rounds: jax.Array, *,
            greedy: bool, rows: int) -> State:
    """Run `loop`'s steps (plain steps, or rounds of draft, verify and accept) over the first
    `rows` slots until a running row finishes or `max_rounds` steps ran; sampling,
    max_new_tokens and stop are per slot."""
    sampling, max_new_tokens, stop = _first_settings(rows, sampling, max_new_tokens, stop)
    step = loop.step(weights, sampling, max_new_tokens, greedy=greedy, stop=stop)
    return _until_a_row_ends(step, state, max_rounds, rows)


@functools.partial(jax.jit, static_argnames=("loop",), donate_argnames=("state",))
def want_logprobs(loop: Loop, weights: Weights, state: State, slot: jax.Array,
                  wanted: jax.Array) -> State:
    """Whether `slot`'s row computes log-probabilities (in a batch whose output keeps them;
    a fill leaves its row computing them)."""
    kept = state.out.logprobs
    return state._replace(out=state.out._replace(
        logprobs=kept._replace(wanted=kept.wanted.at[slot].set(wanted))))


@functools.partial(jax.jit, static_argnames=("loop",), donate_argnames=("state",))
def resume_row(loop: Loop, weights: Weights, state: State, slot: jax.Array, tokens: jax.Array,
               count: jax.Array) -> State:
    """`slot`'s row, just filled with a preempted request's prompt and its generated tokens
    but the last, going on as if never stopped: its output holds the `count` tokens of
    tokens [1,N] again, the newest as the row's last token (not in the cache), running. Its
    next token is drawn with the key of its `count`-th (`output.row_step_keys`)."""
    out = state.out
    out = out._replace(tokens=out.tokens.at[slot].set(tokens[0].astype(out.tokens.dtype)),
                       counts=out.counts.at[slot].set(count),
                       finish=out.finish.at[slot].set(FINISH_NONE))
    return state._replace(out=out, last_token=state.last_token.at[slot].set(tokens[0, count - 1]))


@functools.partial(jax.jit, static_argnames=("loop",), donate_argnames=("state",))
def set_tables(loop: Loop, weights: Weights, state: State, tables: jax.Array) -> State:
    """A paged batch with the block tables [S,W] the host allocated (`serving.kv_blocks`):
    its target's and EAGLE head's caches share them."""
    return map_caches(state, lambda cache: cache._replace(tables=tables))


@functools.partial(jax.jit, static_argnames=("loop",), donate_argnames=("state",))
def release(loop: Loop, weights: Weights, state: State, slot: jax.Array) -> State:
    """Mark `slot`'s row finished, so the loop stops spending work on it."""
    out = state.out
    return state._replace(out=out._replace(finish=out.finish.at[slot].set(FINISH_LENGTH)))


@functools.partial(jax.jit, static_argnames=("loop", "width", "greedy", "rows"),
                   donate_argnames=("state",))
def advance_plain_segment(loop: SpecLoop, weights: Weights, state: speculative.SpecState,
                          sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable,
                          max_rounds: jax.Array, *, width: int, greedy: bool, rows: int
                          ) -> speculative.SpecState:
    """Plain steps in a speculative batch (`decoding.plain_segment`: at most `width`, then
    the head catches up), until a running row finishes or `max_rounds` steps ran."""
    sampling, max_new_tokens, stop = _first_settings(rows, sampling, max_new_tokens, stop)
    part = _first_rows(state, rows)
    part = plain_steps(loop, weights, part, sampling, max_new_tokens,
                       _while_none_ended(part.out.running, max_rounds), width=width,
                       greedy=greedy, stop=stop)
    return _put_back(state, part, rows)


@functools.partial(jax.jit, static_argnames=("loop", "sizes", "greedy", "rows", "long_copy"),
                   donate_argnames=("state",))
def advance_probe(loop: SpecLoop, weights: Weights, state: speculative.SpecState,
                  sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable,
                  max_rounds: jax.Array, *, sizes: tuple[int, ...], greedy: bool, rows: int,
                  long_copy: SpecConfig | None = None
                  ) -> tuple[speculative.SpecState, jax.Array]:
    """`advance` with the largest tree `loop.spec`, also counting per slot what each smaller
    tree (and `long_copy`, if any) would have accepted (`decoding.calibration.round_counts`,
    summed: [S,C], zero for the slots past `rows`)."""
    check_long_copy(loop.spec, sizes, long_copy)
    sampling, max_new_tokens, stop = _first_settings(rows, sampling, max_new_tokens, stop)
    play = loop.verified_step(weights, sampling, max_new_tokens, greedy=greedy, stop=stop)

    def step(s, counts):
        s, done = play(s)
        return s, counts + round_counts(done, loop.spec, sizes, long_copy)

    counts = jnp.zeros((rows, count_columns(loop.spec, sizes, long_copy)), jnp.int32)
    state, counts = _counting_until_a_row_ends(step, state, counts, max_rounds, rows)
    return state, jnp.pad(counts, ((0, state.out.finish.shape[0] - rows), (0, 0)))


@functools.partial(jax.jit, static_argnames=("loop", "greedy", "rows"),
                   donate_argnames=("state",))
def advance_target(loop: SpecLoop, weights: Weights, state: speculative.SpecState,
                   sampling: SamplingParams, max_new_tokens: jax.Array, stop: StopTable,
                   max_rounds: jax.Array, *, greedy: bool, rows: int) -> speculative.SpecState:
    """`advance` of the target alone in a speculative batch, the head left behind (its rows
    may not speculate again; `serving.engine` lets them decode plainly to the end)."""
    done = advance(loop.target_alone(), weights, _target_part(state), sampling,
                   max_new_tokens, stop, max_rounds, greedy=greedy, rows=rows)
    return state._replace(**done._asdict())
