"""Verification rules for a drafted chain: greedy matching and lossless rejection sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eaglejax.decoding.sampling import SamplingParams, target_log_probs


def _leading_true(flags: jax.Array) -> jax.Array:
    """[B,K] booleans -> [B] length of the all-True prefix."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=1), axis=1)


def greedy_accept(drafted: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """drafted [B,K], target logits [B,K+1,V] at the K+1 verified positions.

    Returns (accepted count a [B], next token [B]): the longest prefix where each draft
    token is the target's argmax, then the target's argmax after it (the bonus token)."""
    target_next = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    n_accepted = _leading_true(drafted == target_next[:, :-1])
    return n_accepted, target_next[jnp.arange(drafted.shape[0]), n_accepted]


def sample_accept(drafted: jax.Array, draft_probs: jax.Array, target_logits: jax.Array,
                  sampling: SamplingParams, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling: the output follows the target's warped distribution exactly.

    drafted [B,K] were sampled from draft_probs [B,K,V] (already mapped to the target
    vocabulary); target_logits [B,K+1,V]; keys [B,2] one per row. Draft token i is kept
    with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is
    drawn from norm(max(0, p - q)) there; when all K pass, from p at position K.
    """
    batch, k = drafted.shape
    rows = jnp.arange(batch)
    p = jnp.exp(target_log_probs(target_logits, sampling))  # [B,K+1,V]
    uniform_keys, final_keys = jnp.split(jax.vmap(lambda key: jax.random.split(key, 2))(keys),
                                         2, axis=1)
    uniforms = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(uniform_keys[:, 0])
    p_draft = jnp.take_along_axis(p[:, :k], drafted[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, drafted[..., None], axis=-1)[..., 0]
    n_accepted = _leading_true(uniforms * q_draft < p_draft)
    p_at = p[rows, n_accepted]
    q_at = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)[
        rows, n_accepted]  # zeros after a full acceptance: sample from p itself
    residual = jnp.maximum(p_at - q_at, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_at)
    next_token = jax.vmap(jax.random.categorical)(final_keys[:, 0], jnp.log(residual))
    return n_accepted, next_token.astype(jnp.int32)


def draft_sample(draft_logits: jax.Array, sampling: SamplingParams, keys: jax.Array,
                 target_ids: jax.Array, target_vocab: int) -> tuple[jax.Array, jax.Array]:
    """Sample one draft token per row from warped draft logits [B,DV] (keys [B,2]).

    Returns (target token ids [B], the draft distribution over the target vocabulary
    [B,V]); target_ids [DV] maps draft indices to target ids."""
    log_q = target_log_probs(draft_logits, sampling)
    index = jax.vmap(jax.random.categorical)(keys, log_q)
    probs = jnp.zeros((draft_logits.shape[0], target_vocab), jnp.float32)
    probs = probs.at[:, target_ids].set(jnp.exp(log_q))
    return target_ids[index].astype(jnp.int32), probs
