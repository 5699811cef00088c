"""Plain decoding inside the speculative state: `auto` (`decoding.adaptive`) decodes plainly
for a while without losing its draft head.

A segment runs up to `width` plain target steps (one token per running row each, exactly as
`decoding.plain`), keeping every step's token and target feature; then the head catches up
over the whole block in one forward, as after a speculative round that accepted `width`
tokens. The state that comes out is a speculative state like any round's, so the next
segment may speculate again with any tree: what plain decoding costs beyond its own steps is
one head forward per segment.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from eaglejax.decoding import lookup
from eaglejax.decoding.loops import SpecLoop, Weights
from eaglejax.decoding.output import Output, record, row_step_keys
from eaglejax.decoding.sampling import SamplingParams, sample_tokens
from eaglejax.decoding.drafters import drafter
from eaglejax.decoding.speculative import SpecState, bind_head, tap_layers, target_features
from eaglejax.decoding.stopping import StopCriteria, StopTable
from eaglejax.models.llama import compute_dtype, forward, lm_head


@functools.partial(jax.jit, static_argnames=("loop", "width", "greedy", "stop"),
                   donate_argnames=("state",))
def plain_segment(loop: SpecLoop, weights: Weights, state: SpecState, sampling: SamplingParams,
                  max_new_tokens: jax.Array, until: jax.Array, *, width: int, greedy: bool,
                  stop: StopCriteria) -> SpecState:
    """Up to `width` plain steps (fewer when every row finishes or the state has run `until`
    target forwards), then the head's catch-up over the new tokens; a state with a lookup
    context (`loop.spec.lookup`) has it written as a round would."""
    return plain_steps(loop, weights, state, sampling, max_new_tokens,
                       lambda i, out: state.forwards + i < until, width=width, greedy=greedy,
                       stop=stop)


def plain_steps(loop: SpecLoop, weights: Weights, state: SpecState, sampling: SamplingParams,
                max_new_tokens: jax.Array, more: Callable[[jax.Array, Output], jax.Array], *,
                width: int, greedy: bool, stop: StopCriteria | StopTable) -> SpecState:
    """`plain_segment` traced in a caller's program: up to `width` steps while a row runs and
    `more(steps so far, output)`, then the catch-up (rows that took no step keep their
    drafter state)."""
    params, config, draft_config = weights.target, loop.config, loop.draft_config
    draft_params, attn_impl = weights.draft, loop.attn_impl
    batch = state.last_token.shape[0]
    taps = tap_layers(draft_config)
    features = config.hidden_size * max(len(taps), 1)

    def step(carry):
        i, cache, last, out, tokens, feats, steps = carry
        running = out.running
        verified = forward(params, config, last[:, None], cache.lengths[:, None], cache,
                           tap_layers=taps, attn_impl=attn_impl)
        logits = lm_head(params, verified.hidden[:, 0])
        token = sample_tokens(logits, sampling, row_step_keys(state.row_keys, out.counts),
                              greedy)
        cache = verified.cache._replace(lengths=cache.lengths + running.astype(jnp.int32))
        feats = feats.at[:, i].set(target_features(verified, draft_config)[:, 0])
        return (i + 1, cache, jnp.where(running, token, last),
                record(out, token, running, stop, max_new_tokens, logits), tokens.at[:, i].set(token),
                feats, steps + running.astype(jnp.int32))

    carry = (jnp.int32(0), state.target_cache, state.last_token, state.out,
             jnp.zeros((batch, width), jnp.int32),
             jnp.zeros((batch, width, features), compute_dtype(params)),
             jnp.zeros((batch,), jnp.int32))
    i, cache, last, out, tokens, feats, steps = jax.lax.while_loop(
        lambda c: (c[0] < width) & jnp.any(c[3].running) & more(c[0], c[3]), step, carry)
    # Draft position t consumes token t+1 and the target feature of position t: the block's
    # tokens x_{n+1}.. beside the features of x_n.. (what a round that accepted them passes).
    head = bind_head(params, draft_params, draft_config, weights.d2t, attn_impl,
                     weights.history)
    caught_up = drafter(loop.spec.method).catch_up(head, loop.spec, state.drafter, tokens,
                                                   feats, steps, steps > 0)
    context = state.context
    if loop.spec.lookup:
        context = lookup.write_context(context, tokens, state.target_cache.lengths + 1)
    return state._replace(target_cache=cache, last_token=last, out=out,
                          forwards=state.forwards + i, context=context, drafter=caught_up)
