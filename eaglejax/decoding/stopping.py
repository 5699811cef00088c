"""Stop conditions checked inside the compiled loop: EOS ids, stop token sequences, length."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eaglejax.errors import InputError

FINISH_NONE, FINISH_EOS, FINISH_STOP, FINISH_LENGTH = 0, 1, 2, 3
FINISH_REASONS = {FINISH_EOS: "eos", FINISH_STOP: "stop", FINISH_LENGTH: "length"}


@dataclasses.dataclass(frozen=True)
class StopCriteria:
    """Static stop rules: any id in eos_ids, or the generated ids ending with a stop sequence.

    Stop strings are matched exactly on the host afterwards; the token sequences here let
    the loop stop early when a stop string is generated in its usual tokenization.
    """

    eos_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        # An empty sequence would match every row at once.
        if any(len(seq) == 0 for seq in self.stop_sequences):
            raise InputError("stop_sequences: a stop sequence must have at least one token")


def _ends_with(tokens: jax.Array, counts: jax.Array, seq: tuple[int, ...]) -> jax.Array:
    """[B] whether each row's first counts[b] tokens end with seq."""
    n = len(seq)
    idx = counts[:, None] - n + jnp.arange(n)[None, :]
    tail = jnp.take_along_axis(tokens, jnp.clip(idx, 0, tokens.shape[1] - 1), axis=1)
    return (counts >= n) & jnp.all(tail == jnp.asarray(seq, jnp.int32)[None, :], axis=1)


def update_finish(finish: jax.Array, tokens: jax.Array, counts: jax.Array, new_token: jax.Array,
                  running: jax.Array, stop: StopCriteria, max_new_tokens: jax.Array) -> jax.Array:
    """Finish codes after a token was appended to the running rows (EOS beats stop beats length)."""
    is_eos = jnp.isin(new_token, jnp.asarray(stop.eos_ids, jnp.int32)) if stop.eos_ids else \
        jnp.zeros_like(running)
    is_stop = jnp.zeros_like(running)
    for seq in stop.stop_sequences:
        is_stop = is_stop | _ends_with(tokens, counts, seq)
    code = jnp.where(is_eos, FINISH_EOS,
                     jnp.where(is_stop, FINISH_STOP,
                               jnp.where(counts >= max_new_tokens, FINISH_LENGTH, FINISH_NONE)))
    return jnp.where(running, code, finish).astype(jnp.int32)
