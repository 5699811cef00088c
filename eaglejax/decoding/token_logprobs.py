"""Tokens' log-probabilities on the host: what `generate()` and the serving engine hand out
from an output that keeps them (`decoding.output.Logprobs`), and a prompt's own (each token
after those before it: what evaluation harnesses score)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax import validation
from eaglejax.decoding.buckets import bucket
from eaglejax.decoding.output import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from eaglejax.target import Target


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability under the target model (log-softmax of the logits it
    was drawn from: before temperature, top-k and top-p) and the `top` most likely tokens
    there as (id, log-probability), most likely first. A prompt's first token, which
    nothing predicts, has None for both."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None


def check_count(name: str, value: object) -> int | None:
    """`value` as a count of most likely tokens (0 to MAX_TOP_LOGPROBS), or None."""
    return None if value is None else validation.integer(name, value, 0, MAX_TOP_LOGPROBS)


def row_logprobs(tokens: np.ndarray, chosen: np.ndarray, top_ids: np.ndarray, top: np.ndarray,
                 start: int, end: int, count: int) -> list[TokenLogprob]:
    """Entries `start`..`end` of one row (host copies of `Output.tokens` [N] and
    `Logprobs.chosen` [N], `top_ids` / `top` [N,K]), with `count` <= K alternatives each."""
    return [TokenLogprob(int(tokens[i]), float(chosen[i]),
                         [(int(t), float(v)) for t, v in zip(top_ids[i, :count], top[i, :count])])
            for i in range(start, end)]


def prompt_logprobs(target: "Target", prompt: list[int], count: int) -> list[TokenLogprob]:
    """Each prompt token's log-probability after the tokens before it and the `count` most
    likely tokens there (the first token's: None), from one forward over the prompt (padded
    to a power of two positions, at least 16, so prompts of nearby lengths share a program)."""
    padded = np.zeros((1, bucket(len(prompt), 16)), np.int32)
    padded[0, :len(prompt)] = prompt
    chosen, top, top_ids = jax.device_get(_scored(target.logits(padded)[0], padded[0],
                                                  MAX_TOP_LOGPROBS))
    return [TokenLogprob(prompt[0], None, None)] + [
        TokenLogprob(int(prompt[i]), float(chosen[i - 1]),
                     [(int(t), float(v)) for t, v in zip(top_ids[i - 1, :count],
                                                         top[i - 1, :count])])
        for i in range(1, len(prompt))]


@functools.partial(jax.jit, static_argnames=("k",))
def _scored(logits: jax.Array, tokens: jax.Array, k: int
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """At positions 0..T-2 of logits [T,V]: the log-probability of the next token of
    `tokens` [T] and the k most likely (values, ids)."""
    log_p = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(log_p, tokens[1:, None], axis=1)[:, 0]
    top, top_ids = jax.lax.top_k(log_p, k)
    return chosen, top, top_ids
