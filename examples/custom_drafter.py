"""Adding a drafting method: a drafter with a state of its own, registered by name.

    python examples/custom_drafter.py ["prompt"] [--model DIR] [-k K] [--max-new-tokens N]

`LastSuccessor` drafts without a model: each row keeps a table of the token that last
followed each token in its context (prefilled from the prompt, caught up over the tokens
every round accepts) and drafts a chain by following the table from the last accepted
token. It needs no draft weights (`drafts_with = None`). Registered as method
"last_successor", it runs like a built-in method: through `generate` and the serving
engine, greedy output identical to plain decoding, sampled output the target's exact
distribution (tests/test_drafters.py checks all of it). docs/architecture.md, "Adding a
drafter", has the contract.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import eaglejax
from eaglejax import SpecConfig
from eaglejax.decoding.drafters import register, unregister
from eaglejax.decoding.tree import chain_tree

METHOD = "last_successor"
DEFAULT_PROMPT = ("List the planets of the solar system, then list them again in the same "
                  "order, then once more.")


class LastSuccessor:
    """A model-free drafter. State per row: a table [B,V] of the token that last followed
    each token in the row's context, and the last accepted token [B]. A token never seen
    is followed by token 0. Deterministic, so a sampled chain's draft distributions are
    one-hot (min(1, p/q) then accepts a drafted token with the target's probability)."""

    drafts_with = None  # `head` is None in every call

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def prefill(self, head, spec, tokens, features, prompt_lengths, capacity, chunk):
        """`tokens` [B,P+1]: each prompt, then the first new token (right-padded)."""
        rows = jnp.arange(tokens.shape[0])

        def put(t, table):
            old = table[rows, tokens[:, t]]
            return table.at[rows, tokens[:, t]].set(
                jnp.where(t + 1 <= prompt_lengths, tokens[:, t + 1], old))

        table = jax.lax.fori_loop(0, tokens.shape[1] - 1, put,
                                  jnp.zeros((tokens.shape[0], self.vocab_size), jnp.int32))
        return table, tokens[rows, prompt_lengths]

    def draft(self, head, state, token, spec, greedy, sampling, keys, vocab):
        table, _ = state
        rows, current, drafted = jnp.arange(token.shape[0]), token, []
        for _ in range(spec.num_draft_tokens):
            current = table[rows, current]
            drafted.append(current)
        drafted = jnp.stack(drafted, axis=1)
        probs = None if greedy else jax.nn.one_hot(drafted, vocab, dtype=jnp.float32)
        return chain_tree(token, drafted), probs

    def catch_up(self, head, spec, state, tokens, features, n_accepted, running):
        """`tokens` [B,T]: the tokens after the last accepted one, the first `n_accepted`
        of each running row kept."""
        table, previous = state
        rows = jnp.arange(tokens.shape[0])
        for j in range(tokens.shape[1]):
            kept = running & (j < n_accepted)
            old = table[rows, previous]
            table = table.at[rows, previous].set(jnp.where(kept, tokens[:, j], old))
            previous = jnp.where(kept, tokens[:, j], previous)
        return table, previous


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("-k", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    target = eaglejax.load_target(args.model)
    register(METHOD)(LastSuccessor(target.config.vocab_size))
    try:
        spec = SpecConfig(method=METHOD, num_draft_tokens=args.k)
        prompt: str | list[list[int]] = args.prompt
        if target.tokenizer is None:  # a model without one: the characters as token ids
            prompt = [[ord(c) % target.config.vocab_size for c in args.prompt]]
        chat = target.tokenizer is not None and target.tokenizer.chat_template is not None
        common = dict(target=target, max_new_tokens=args.max_new_tokens, chat=chat)
        for _ in range(2):  # the first call of each compiles
            plain = eaglejax.generate(prompt, **common)[0]
            drafted = eaglejax.generate(prompt, speculative=spec, **common)[0]
        shape = spec.describe()
    finally:
        unregister(METHOD)
    result = {"identical": drafted.token_ids == plain.token_ids,
              "acceptance_length": drafted.metrics.acceptance_length,
              "plain_tokens_per_s": plain.metrics.decode_tokens_per_s,
              "drafted_tokens_per_s": drafted.metrics.decode_tokens_per_s}
    if plain.text is not None:
        print(plain.text)
    print(f"{shape}: tokens identical to plain decoding: {result['identical']}, "
          f"AL {result['acceptance_length']:.2f}, {result['drafted_tokens_per_s']:.1f} tok/s "
          f"(plain {result['plain_tokens_per_s']:.1f})")
    return result


if __name__ == "__main__":
    main()
