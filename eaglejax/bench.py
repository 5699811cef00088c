"""Benchmarks behind `eaglejax bench`: decoding speed on MT-bench first turns."""

from __future__ import annotations

import functools
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.datasets import Question
from eaglejax.generate import _bucket, generate
from eaglejax.models import kv_cache
from eaglejax.models.llama import forward, lm_head
from eaglejax.target import Target


def single_forward_ms(target: Target, context: int, capacity: int, batch: int = 1,
                      repeats: int = 20) -> float:
    """Median time of one jitted single-token forward (with argmax) over a `context`-long cache:
    the floor one decode step cannot beat."""
    config = target.config

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, token):
        out = forward(params, config, token[:, None], cache.lengths[:, None], cache,
                      attn_impl=target.attn_impl)
        cache = out.cache  # rows staged, lengths unchanged: every step sees the same context
        return jnp.argmax(lm_head(params, out.hidden[:, 0]), -1).astype(jnp.int32), cache

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


def bench_plain(target: Target, questions: list[Question], *, batch_size: int = 1,
                max_new_tokens: int = 128, chat: bool = True,
                ignore_eos: bool = True) -> dict[str, Any]:
    """Greedy plain decoding over `questions` in batches; a warm-up pass compiles every shape."""
    batches = [questions[i:i + batch_size] for i in range(0, len(questions), batch_size)]
    run = functools.partial(generate, target=target, max_new_tokens=max_new_tokens, chat=chat,
                            ignore_eos=ignore_eos)
    warmed: set[int] = set()
    for batch in batches:  # one warm-up per prompt-length bucket
        lengths = [len(target.tokenizer.render_prompt(q.prompt, chat=chat)) for q in batch]
        if _bucket(max(lengths), 16) not in warmed:
            warmed.add(_bucket(max(lengths), 16))
            run([q.prompt for q in batch])
    new_tokens = decode_tokens = 0
    prefill_s = decode_s = 0.0
    prompt_tokens = []
    for batch in batches:
        results = run([q.prompt for q in batch])
        prefill_s += results[0].metrics.prefill_s
        decode_s += results[0].metrics.decode_s
        new_tokens += sum(r.metrics.new_tokens for r in results)
        decode_tokens += sum(r.metrics.new_tokens - 1 for r in results)
        prompt_tokens += [r.metrics.prompt_tokens for r in results]
    mean_context = int(np.mean(prompt_tokens)) + max_new_tokens // 2
    capacity = -(-(_bucket(max(prompt_tokens), 16) + _bucket(max_new_tokens, 16)) // 128) * 128
    forward_ms = single_forward_ms(target, mean_context, capacity, batch=batch_size)
    decode_ms_per_step = 1e3 * decode_s / (decode_tokens / batch_size)
    return {
        "mode": "plain", "model": target.source, "dtype": jnp.dtype(target.dtype).name,
        "backend": jax.default_backend(), "machine": platform.processor() or platform.machine(),
        "batch_size": batch_size, "prompts": len(questions), "max_new_tokens": max_new_tokens,
        "new_tokens": new_tokens,
        "decode_tokens_per_s": decode_tokens / decode_s,
        "end_to_end_tokens_per_s": new_tokens / (prefill_s + decode_s),
        "prefill_s_per_batch": prefill_s / len(batches),
        "decode_ms_per_step": decode_ms_per_step,
        "single_forward_ms": forward_ms,
        "step_over_forward": decode_ms_per_step / forward_ms,
    }
