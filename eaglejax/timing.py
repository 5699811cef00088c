"""Timing primitives: the median wall time of a jitted call, and of one target forward."""

from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.decoding.sampling import argmax_last
from eaglejax.models import kv_cache
from eaglejax.models.llama import forward, lm_head
from eaglejax.target import Target


def median_seconds(fn: Callable, args: tuple, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of `fn(*args)` after `warmup` calls (compilation included there)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def single_forward_ms(target: Target, context: int, capacity: int, batch: int = 1,
                      repeats: int = 20, tokens: int = 1) -> float:
    """Median time of one jitted forward of `tokens` new tokens per row (with the output
    head and argmax at every one of them, as verification needs) over a `context`-long
    cache: with one token, the floor one decode step cannot beat; with more, the cost of
    verifying that many draft nodes."""
    config = target.config
    offsets = jnp.arange(tokens)[None, :]

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, token):
        block = jnp.broadcast_to(token[:, None], (token.shape[0], tokens))
        out = forward(params, config, block, cache.lengths[:, None] + offsets, cache,
                      attn_impl=target.attn_impl)
        cache = out.cache  # rows staged, lengths unchanged: every step sees the same context
        return argmax_last(lm_head(params, out.hidden))[:, -1], cache

    cache = kv_cache.init_cache(config.num_layers, batch, capacity, config.num_kv_heads,
                                config.head_dim, target.dtype)
    cache = cache._replace(lengths=jnp.full((batch,), context, jnp.int32))
    token = jnp.ones((batch,), jnp.int32)
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        token, cache = step(target.params, cache, token)
        token.block_until_ready()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)
