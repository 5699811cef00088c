"""The generated-token buffer every decode loop carries, and how tokens enter it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.decoding.stopping import FINISH_NONE, StopCriteria, StopTable, update_finish


class Output(NamedTuple):
    """tokens [B,N] hold the generated ids, counts [B] how many; finish [B] finish codes
    (FINISH_NONE while a row runs)."""

    tokens: jax.Array
    counts: jax.Array
    finish: jax.Array

    @property
    def running(self) -> jax.Array:
        return self.finish == FINISH_NONE


def empty_output(batch: int, max_tokens: int) -> Output:
    return Output(jnp.zeros((batch, max_tokens), jnp.int32), jnp.zeros((batch,), jnp.int32),
                  jnp.full((batch,), FINISH_NONE, jnp.int32))


def record(out: Output, new_token: jax.Array, active: jax.Array,
           stop: StopCriteria | StopTable, max_new_tokens: jax.Array) -> Output:
    """Append new_token [B] to the rows that are running and `active`; update finish codes
    (EOS, stop sequences and the length limit apply token by token)."""
    take = out.running & active
    rows = jnp.arange(new_token.shape[0])
    tokens = out.tokens.at[rows, out.counts].set(
        jnp.where(take, new_token, out.tokens[rows, out.counts]), mode="drop")
    counts = out.counts + take.astype(jnp.int32)
    finish = update_finish(out.finish, tokens, counts, new_token, take, stop, max_new_tokens)
    return Output(tokens, counts, finish)


def row_step_keys(row_keys: jax.Array, counts: jax.Array) -> jax.Array:
    """A row's key for its n-th token depends only on its own seed and n."""
    return jax.vmap(jax.random.fold_in)(row_keys, counts)
