"""Stop conditions checked inside the compiled loop: EOS ids, stop token sequences, length
(the same rules for every row, static; or per row, as data)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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


class StopTable(NamedTuple):
    """Stop rules as data, one set per row (a continuous batch: new rules never recompile).

    eos_ids [B,E] (-1 pads); sequences [B,S,L] stop token sequences right-aligned in L
    columns (-1 pads on the left); lengths [B,S] (0: unused)."""

    eos_ids: jax.Array
    sequences: jax.Array
    lengths: jax.Array

    @staticmethod
    def rows(rules: "Sequence[StopCriteria]", max_eos: int, max_sequences: int,
             max_length: int) -> "StopTable":
        """Pack one StopCriteria per row into host tables of the given widths (InputError
        when a row's rules do not fit)."""
        eos = np.full((len(rules), max_eos), -1, np.int32)
        sequences = np.full((len(rules), max_sequences, max_length), -1, np.int32)
        lengths = np.zeros((len(rules), max_sequences), np.int32)
        for i, rule in enumerate(rules):
            if len(rule.eos_ids) > max_eos or len(rule.stop_sequences) > max_sequences or any(
                    len(seq) > max_length for seq in rule.stop_sequences):
                raise InputError(f"stop rules of row {i} exceed the table's {max_eos} EOS ids, "
                                 f"{max_sequences} sequences of at most {max_length} tokens")
            eos[i, :len(rule.eos_ids)] = rule.eos_ids
            for j, seq in enumerate(rule.stop_sequences):
                sequences[i, j, max_length - len(seq):] = seq
                lengths[i, j] = len(seq)
        return StopTable(eos, sequences, lengths)


def _table_stops(tokens: jax.Array, counts: jax.Array, new_token: jax.Array,
                 table: StopTable) -> tuple[jax.Array, jax.Array]:
    """[B] (is EOS, ends with one of its stop sequences) per row, by table."""
    is_eos = jnp.any((new_token[:, None] == table.eos_ids) & (table.eos_ids >= 0), axis=1)
    width = table.sequences.shape[2]
    idx = counts[:, None] - width + jnp.arange(width)[None, :]
    tail = jnp.take_along_axis(tokens, jnp.clip(idx, 0, tokens.shape[1] - 1), axis=1)  # [B,L]
    inside = jnp.arange(width)[None, None, :] >= width - table.lengths[:, :, None]  # [B,S,L]
    match = jnp.all(~inside | (tail[:, None, :] == table.sequences), axis=2)
    is_stop = jnp.any(match & (table.lengths > 0) & (counts[:, None] >= table.lengths), axis=1)
    return is_eos, is_stop


def _ends_with(tokens: jax.Array, counts: jax.Array, seq: tuple[int, ...]) -> jax.Array:
    """[B] whether each row's first counts[b] tokens end with seq."""
    n = len(seq)
    idx = counts[:, None] - n + jnp.arange(n)[None, :]
    tail = jnp.take_along_axis(tokens, jnp.clip(idx, 0, tokens.shape[1] - 1), axis=1)
    return (counts >= n) & jnp.all(tail == jnp.asarray(seq, jnp.int32)[None, :], axis=1)


def update_finish(finish: jax.Array, tokens: jax.Array, counts: jax.Array, new_token: jax.Array,
                  running: jax.Array, stop: StopCriteria | StopTable,
                  max_new_tokens: jax.Array) -> jax.Array:
    """Finish codes after a token was appended to the running rows (EOS beats stop beats
    length); `stop`: rules for every row (static) or per row (`StopTable`)."""
    if isinstance(stop, StopTable):
        is_eos, is_stop = _table_stops(tokens, counts, new_token, stop)
    else:
        is_eos = jnp.isin(new_token, jnp.asarray(stop.eos_ids, jnp.int32)) if stop.eos_ids \
            else jnp.zeros_like(running)
        is_stop = jnp.zeros_like(running)
        for seq in stop.stop_sequences:
            is_stop = is_stop | _ends_with(tokens, counts, seq)
    code = jnp.where(is_eos, FINISH_EOS,
                     jnp.where(is_stop, FINISH_STOP,
                               jnp.where(counts >= max_new_tokens, FINISH_LENGTH, FINISH_NONE)))
    return jnp.where(running, code, finish).astype(jnp.int32)
