"""The generated-token buffer every decode loop carries, and how tokens enter it (with the
target's log-probabilities of each, when the buffer keeps them)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.decoding.stopping import FINISH_NONE, StopCriteria, StopTable, update_finish

MAX_TOP_LOGPROBS = 20  # most likely tokens an output may keep per generated token (OpenAI's)


class Logprobs(NamedTuple):
    """The target's log-probabilities (log-softmax of its logits: the model's own
    distribution, before temperature, top-k or top-p) at each generated token: `chosen`
    [B,N] the token's, `top_ids` / `top` [B,N,K] the K most likely (largest first; K may be
    0). Rows not `wanted` [B] skip the work (their entries stay 0)."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array
    wanted: jax.Array

    @property
    def width(self) -> int:
        """K: the most likely tokens kept per generated token."""
        return self.top_ids.shape[2]


class Output(NamedTuple):
    """tokens [B,N] hold the generated ids, counts [B] how many; finish [B] finish codes
    (FINISH_NONE while a row runs); `logprobs` (None: not kept) beside the tokens."""

    tokens: jax.Array
    counts: jax.Array
    finish: jax.Array
    logprobs: Logprobs | None = None

    @property
    def running(self) -> jax.Array:
        return self.finish == FINISH_NONE


def empty_output(batch: int, max_tokens: int, top_logprobs: int | None = None) -> Output:
    """An output of `batch` rows for up to `max_tokens` tokens each; with `top_logprobs` (0 to
    MAX_TOP_LOGPROBS) it keeps each token's log-probability and that many most likely tokens'
    (every row wanting them; `decoding.slots` sets a row's wish)."""
    logprobs = None
    if top_logprobs is not None:
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs={top_logprobs}: expected 0 to {MAX_TOP_LOGPROBS}")
        logprobs = Logprobs(jnp.zeros((batch, max_tokens), jnp.float32),
                            jnp.zeros((batch, max_tokens, top_logprobs), jnp.int32),
                            jnp.zeros((batch, max_tokens, top_logprobs), jnp.float32),
                            jnp.ones((batch,), bool))
    return Output(jnp.zeros((batch, max_tokens), jnp.int32), jnp.zeros((batch,), jnp.int32),
                  jnp.full((batch,), FINISH_NONE, jnp.int32), logprobs)


def record(out: Output, new_token: jax.Array, active: jax.Array,
           stop: StopCriteria | StopTable, max_new_tokens: jax.Array,
           logits: jax.Array | None = None) -> Output:
    """Append new_token [B] to the rows that are running and `active`; update finish codes
    (EOS, stop sequences and the length limit apply token by token). An output that keeps
    log-probabilities needs the target's `logits` [B,V] the token was drawn from."""
    take = out.running & active
    rows = jnp.arange(new_token.shape[0])
    tokens = out.tokens.at[rows, out.counts].set(
        jnp.where(take, new_token, out.tokens[rows, out.counts]), mode="drop")
    logprobs = out.logprobs
    if logprobs is not None:
        if logits is None:
            raise ValueError("this output keeps log-probabilities: pass the target's logits")
        logprobs = _with_logprobs(logprobs, out.counts, new_token, logits, take)
    counts = out.counts + take.astype(jnp.int32)
    finish = update_finish(out.finish, tokens, counts, new_token, take, stop, max_new_tokens)
    return Output(tokens, counts, finish, logprobs)


def _with_logprobs(logprobs: Logprobs, at: jax.Array, token: jax.Array, logits: jax.Array,
                   take: jax.Array) -> Logprobs:
    """`logprobs` with the entries at positions `at` [B] of the rows in `take` that want
    them written from `logits` [B,V] (skipped, as one branch, when no row does)."""
    take = take & logprobs.wanted

    def write(lp: Logprobs) -> Logprobs:
        log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(log_p, token[:, None], axis=1)[:, 0]
        top, top_ids = jax.lax.top_k(log_p, lp.width) if lp.width else (
            lp.top[:, 0], lp.top_ids[:, 0])
        rows = jnp.arange(token.shape[0])
        where = jnp.where(take, at, lp.chosen.shape[1])  # out of range: dropped
        return lp._replace(chosen=lp.chosen.at[rows, where].set(chosen, mode="drop"),
                           top_ids=lp.top_ids.at[rows, where].set(top_ids.astype(jnp.int32),
                                                                  mode="drop"),
                           top=lp.top.at[rows, where].set(top, mode="drop"))

    return jax.lax.cond(jnp.any(take), write, lambda lp: lp, logprobs)


def row_step_keys(row_keys: jax.Array, counts: jax.Array) -> jax.Array:
    """A row's key for its n-th token depends only on its own seed and n."""
    return jax.vmap(jax.random.fold_in)(row_keys, counts)
