"""Turning logits into the target distribution (temperature, top-k, top-p) and sampling it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.errors import InputError


class SamplingParams(NamedTuple):
    """Per-call sampling settings as arrays (so changing them never recompiles)."""

    temperature: jax.Array  # float32 scalar; 0 means greedy
    top_k: jax.Array  # int32 scalar; 0 means off
    top_p: jax.Array  # float32 scalar in (0, 1]

    @staticmethod
    def make(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
        """Validate user values and pack them as arrays."""
        if not (isinstance(temperature, (int, float)) and temperature >= 0 and temperature == temperature):
            raise InputError(f"temperature must be a number >= 0, got {temperature!r}")
        if not (isinstance(top_k, int) and top_k >= 0):
            raise InputError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise InputError(f"top_p must be in (0, 1], got {top_p!r}")
        return SamplingParams(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))


def target_log_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Log-probabilities [..., V] after temperature, top-k and top-p (removed tokens: -inf).

    Ties at the top-k / top-p boundary are all kept, so the result does not depend on
    the sort's tie order. Assumes temperature > 0.
    """
    scaled = logits.astype(jnp.float32) / params.temperature
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    vocab = logits.shape[-1]
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)
    kth = jnp.take(sorted_desc, k - 1, axis=-1)[..., None]
    # top-p acts on the top-k renormalised distribution (the Hugging Face / vLLM order).
    in_top_k = jnp.arange(vocab) < k
    probs_sorted = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    # Smallest set whose mass reaches top_p: keep a token if the mass before it is < top_p.
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    n_keep = jnp.maximum(jnp.sum(mass_before < params.top_p, axis=-1, keepdims=True), 1)
    pth = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
    threshold = jnp.maximum(kth, pth)
    kept = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    return jax.nn.log_softmax(kept, axis=-1)


def sample_tokens(logits: jax.Array, params: SamplingParams, keys: jax.Array,
                  greedy: bool) -> jax.Array:
    """One token per row from logits [B,V]; keys [B] are per-row PRNG keys."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    log_probs = target_log_probs(logits, params)
    return jax.vmap(jax.random.categorical)(keys, log_probs).astype(jnp.int32)
