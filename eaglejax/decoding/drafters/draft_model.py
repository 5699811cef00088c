"""Draft-model speculation: a smaller model of the same tokenizer drafts for the target
with its own KV cache (vLLM's `draft_model`, SGLang's STANDALONE, llama.cpp's `-md`), as a
chain (method "draft_model") or as EAGLE-2's dynamic tree over its top-k (method
"draft_model_tree").

The draft model's state (`ModelDraftState`) is one token ahead of the target's: its cache
holds x_0..x_n (the target's holds x_0..x_{n-1}; x_n, the last accepted token, is recorded
but not yet verified), and its logits and final hidden state at x_n propose x_{n+1}. A
round drafts from them as the EAGLE head's methods do (`chain.draft_chain`,
`dynamic_tree.draft_dynamic_tree`), through `ModelHead`, whose steps run the draft model
over a scratch copy of the cache: only the catch-up commits, and it commits only accepted
rows, so the draft cache rolls back with the target's. The catch-up runs the draft model
once over the round's emitted block x_{n+1}..x_{n+a+1} (the accepted tokens and the bonus)
and keeps its a+1 rows: the next round's first proposal comes out of the same forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.config import ModelConfig
from eaglejax.decoding.drafters.base import HeadDrafter, register
from eaglejax.decoding.drafters.chain import chain
from eaglejax.decoding.drafters.dynamic_tree import dynamic_tree
from eaglejax.decoding.prefill import prefill_target
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import ForwardOutput, Params, forward, lm_head

if TYPE_CHECKING:
    from eaglejax.decoding.spec_config import SpecConfig


class ModelHead(NamedTuple):
    """A draft model bound inside the compiled loop, answering the calls an EAGLE head's
    tree proposals make (`base.Head`): `step` runs the model (it reads tokens only),
    `logits` its output head over the ids it shares with the target (`draft_ids` [DV], the
    identity on 0..DV-1)."""

    params: Params
    config: ModelConfig
    draft_ids: jax.Array
    attn_impl: AttentionImpl

    def step(self, tokens: jax.Array, inputs: jax.Array | None, positions: jax.Array,
             cache: kv_cache.KVCache, mask: jax.Array | None = None, *,
             stage: bool = True) -> ForwardOutput:
        """The model over tokens [B,T] at positions [B,T] after the cache's valid prefix
        (`mask` [B,T,T] among the new tokens; causal by default); `inputs` are ignored;
        `stage` as `Head.step`'s."""
        return forward(self.params, self.config, tokens, positions, cache, mask=mask,
                       attn_impl=self.attn_impl, stage=stage)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Logits [...,DV] over the shared ids of final-normed hidden states [...,H]."""
        return lm_head(self.params, hidden)[..., :self.draft_ids.shape[0]]

    def log_probs(self, hidden: jax.Array) -> jax.Array:
        return jax.nn.log_softmax(self.logits(hidden), axis=-1)


class ModelDraftState(NamedTuple):
    """Per row: the draft model's committed cache (x_0..x_n), and its logits [B,DV] and final
    hidden state [B,H] at x_n, proposing x_{n+1}."""

    cache: kv_cache.KVCache
    logits: jax.Array
    hidden: jax.Array


class ModelDrafter(HeadDrafter):
    """A drafter over a draft model's state; `propose` drafts the tree from it as from an
    EAGLE head's (`HeadDrafter.draft`: the state has the same fields)."""

    drafts_with = "model"

    def prefill(self, head: ModelHead, spec: "SpecConfig", tokens: jax.Array,
                features: jax.Array, prompt_lengths: jax.Array, capacity: int, chunk: int
                ) -> ModelDraftState:
        # One row more than the target's cache: x_n is in the draft model's.
        prefilled = prefill_target(head.params, head.config, tokens, prompt_lengths + 1,
                                   capacity + 1, attn_impl=head.attn_impl, chunk=chunk,
                                   heads_axis=None)
        hidden = prefilled.hidden[jnp.arange(tokens.shape[0]), prompt_lengths]
        return ModelDraftState(prefilled.cache, head.logits(hidden), hidden)

    def catch_up(self, head: ModelHead, spec: "SpecConfig", state: ModelDraftState,
                 tokens: jax.Array, features: jax.Array, n_accepted: jax.Array,
                 running: jax.Array) -> ModelDraftState:
        """The model over tokens [B,T] x_{n+1}.., the first `n_accepted` [B] of each row
        committed; rows not `running` keep their state."""
        batch, block = tokens.shape
        lengths = state.cache.lengths
        out = head.step(tokens, None, lengths[:, None] + jnp.arange(block)[None, :],
                        state.cache)
        kept = jnp.maximum(n_accepted, 1)
        hidden = out.hidden[jnp.arange(batch), kept - 1]
        keep = lambda new, old: jnp.where(  # noqa: E731
            running.reshape(-1, *(1,) * (new.ndim - 1)), new, old)
        # Rows not running had rows staged past their length: never read.
        cache = out.cache._replace(lengths=jnp.where(running, lengths + kept, lengths))
        return ModelDraftState(cache, keep(head.logits(hidden), state.logits),
                               keep(hidden, state.hidden))


register("draft_model")(ModelDrafter(chain))
register("draft_model_tree", shape="tree")(ModelDrafter(dynamic_tree))
