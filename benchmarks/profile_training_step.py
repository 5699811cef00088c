"""How much of one TTT training step is the frozen target: the most that training from cached
target features could save (each later epoch would skip that share).

    python benchmarks/profile_training_step.py [--ttt-lengths 3 7] [--batch-size 4] [--seq-len 512]

SmolLM2 with a fresh EAGLE-3 head (draft vocabulary 8,192), random tokens in one segment
per row; median of a few jitted steps after a warm-up. The target signal is the target's
forward with its taps and its next-token distribution over the draft vocabulary.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import eaglejax
from eaglejax.draft.draft import new_eagle3_draft
from eaglejax.training.ttt import Batch, target_signal
from eaglejax.training.trainer import TrainConfig, TrainState, _train_step, make_optimizer


def median_s(fn, repeats: int = 4) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ttt-lengths", type=int, nargs="+", default=[3, 7])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    args = parser.parse_args()
    target = eaglejax.load_target("smollm2-135m-instruct")
    vocab = target.config.vocab_size
    used = jnp.arange(args.draft_vocab, dtype=jnp.int32)
    t2d = jnp.full((vocab,), -1, jnp.int32).at[used].set(used)
    draft = new_eagle3_draft(target, used_tokens=np.asarray(used))
    b, s = args.batch_size, args.seq_len
    tokens = np.random.RandomState(0).randint(0, vocab, (b, s))
    batch = Batch(jnp.asarray(tokens, jnp.int32), jnp.ones((b, s), jnp.int32),
                  jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
                  jnp.ones((b, s), bool))
    signal = jax.jit(lambda params: target_signal(params, target.config, batch,
                                                  draft.config.tap_layers, used, t2d))
    target_s = median_s(lambda: signal(target.params))
    for ttt in args.ttt_lengths:
        config = TrainConfig(seq_len=s, batch_size=b, ttt_length=ttt, steps=1000)
        step = _train_step(draft.config, target.config, config, target.attn_impl)
        params = jax.tree.map(jnp.copy, draft.params)  # the step donates its state
        state = [TrainState(params, make_optimizer(config).init(params))]

        def run():
            state[0], metrics = step(state[0], target.params, batch, used, t2d)
            return metrics

        step_s = median_s(run)
        print(f"TTT {ttt}: step {step_s:.2f} s ({b * s / step_s:.0f} tokens/s); target signal "
              f"{target_s:.2f} s = {target_s / step_s:.0%} of the step; from cached features at "
              f"most {b * s / (step_s - target_s):.0f} tokens/s")


if __name__ == "__main__":
    main()
