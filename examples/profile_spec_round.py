"""Time the pieces of one speculative round separately (jitted, median of repeats).

    python examples/profile_spec_round.py [--num-draft-tokens 5] [--context 200]
Pieces: the plain single-token target forward, the (K+1)-token verify forward, one chain
head step, and the (K+1)-position catch-up, for SmolLM2 with a freshly initialised
EAGLE-3 head (draft vocabulary = full vocabulary unless --draft-vocab is given).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import eaglejax
from eaglejax.timing import median_seconds
from eaglejax.draft.draft import new_eagle3_draft
from eaglejax.draft.head import draft_forward, head_logits
from eaglejax.models import kv_cache
from eaglejax.models.llama import forward, lm_head


def median_ms(fn, *args) -> float:
    return 1e3 * median_seconds(fn, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--draft-vocab", type=int, default=None)
    args = parser.parse_args()
    target = eaglejax.load_target("smollm2-135m-instruct")
    used = None if args.draft_vocab is None else np.arange(args.draft_vocab)
    draft = new_eagle3_draft(target, used_tokens=used)
    tc, dc = target.config, draft.config
    capacity = -(-(args.context + 64) // 128) * 128

    def cache_for(config):
        cache = kv_cache.init_cache(config.num_layers, 1, capacity, config.num_kv_heads,
                                    config.head_dim, target.dtype)
        return cache._replace(lengths=jnp.full((1,), args.context, jnp.int32))

    def target_step(params, cache, tokens):
        positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
        out = forward(params, tc, tokens, positions, cache, tap_layers=dc.tap_layers)
        return jnp.argmax(lm_head(params, out.hidden), -1), out.taps

    def head_step(dparams, params, cache, tokens, inputs):
        positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
        out = draft_forward(dparams, dc, params, tokens, inputs, positions, cache,
                            from_features=inputs.shape[-1] != dc.hidden_size)
        return jnp.argmax(head_logits(dparams, dc, params, out.hidden[:, -1]), -1)

    k = args.num_draft_tokens
    block = jnp.ones((1, k + 1), jnp.int32)
    report = {
        "target_forward_1_ms": median_ms(jax.jit(target_step), target.params,
                                         cache_for(tc), block[:, :1]),
        f"target_verify_{k + 1}_ms": median_ms(jax.jit(target_step), target.params,
                                               cache_for(tc), block),
        "head_chain_step_ms": median_ms(jax.jit(head_step), draft.params, target.params,
                                        cache_for(dc.decoder), block[:, :1],
                                        jnp.ones((1, 1, dc.hidden_size), target.dtype)),
        f"head_catch_up_{k + 1}_ms": median_ms(jax.jit(head_step), draft.params, target.params,
                                               cache_for(dc.decoder), block,
                                               jnp.ones((1, k + 1, dc.feature_size),
                                                        target.dtype)),
        "draft_vocab": dc.draft_vocab_size,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
