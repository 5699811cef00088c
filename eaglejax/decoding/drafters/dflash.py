"""DFlash drafting (methods "dflash", a chain, and "dflash_tree", a tree over the block's
per-slot top-k): one drafter forward fills a block of `block_size` tokens (`draft.dflash`).

State (`DFlashState`): the drafter's cache of context keys and values for x_0..x_{n-1}
(the target's committed positions, from their taps) and the block's proposals [B,S,DV] for
x_{n+1}..x_{n+S} (S = block_size - 1), computed when x_n became the last accepted token:
draft-vocabulary logits, DV = V unless the drafter's vocabulary is reduced; drafted ids
map to target ids through `Head.draft_ids` as an EAGLE-3 head's do.
A round drafts from the proposals with no forward at all: their argmax (or samples) as a
chain of K <= S, as P-EAGLE's mask slots are drafted (`parallel.parallel`), or EAGLE-2's
expansion over the lattice of each slot's top tokens (`parallel.draft_parallel_tree`). The
catch-up commits the accepted positions' context keys and values from the target's taps
there, then runs the next block (the bonus, then mask tokens) over the context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.decoding.drafters.base import Head, Root, register
from eaglejax.decoding.drafters.parallel import draft_parallel_tree, parallel
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.tree import Tree
from eaglejax.draft.dflash import block_logits, context_kv
from eaglejax.models import kv_cache
from eaglejax.models.llama import compute_dtype

if TYPE_CHECKING:
    from eaglejax.decoding.spec_config import SpecConfig


class DFlashState(NamedTuple):
    """Per row: the context cache (x_0..x_{n-1}) and the block's proposals [B,S,DV]."""

    cache: kv_cache.KVCache
    logits: jax.Array


def _next_block(head: Head, cache: kv_cache.KVCache, token: jax.Array) -> DFlashState:
    """The state whose proposals [B,S,DV] are the block's rooted at token [B] after the
    context cache (the block's rows staged past the context: never read)."""
    c = head.config
    batch = token.shape[0]
    tokens = jnp.concatenate(
        [token[:, None], jnp.full((batch, c.block_size - 1), c.mask_token_id, jnp.int32)],
        axis=1)
    positions = cache.lengths[:, None] + jnp.arange(c.block_size)[None, :]
    logits, staged = block_logits(head.params, c, head.target_params, tokens, positions,
                                  cache, head.attn_impl)
    return DFlashState(staged, logits)


class DFlashDrafter:
    """The drafter of a DFlash head (`DraftConfig.kind == "dflash"`); `tree` picks the
    lattice tree over the chain."""

    drafts_with = "head"

    def __init__(self, tree: bool):
        self.tree = tree

    def prefill(self, head: Head, spec: "SpecConfig", tokens: jax.Array, features: jax.Array,
                prompt_lengths: jax.Array, capacity: int, chunk: int) -> DFlashState:
        batch, width = features.shape[:2]
        d = head.config.decoder
        # room for a block staged after the longest context
        cache = kv_cache.init_cache(d.num_layers, batch, capacity + head.config.block_size,
                                    d.num_kv_heads, d.head_dim,
                                    compute_dtype(head.target_params), heads_axis=None)
        positions = jnp.broadcast_to(jnp.arange(width)[None], (batch, width))
        keys, values = context_kv(head.params, head.config, features, positions)
        cache = kv_cache.append(cache, keys, values, prompt_lengths)
        first = tokens[jnp.arange(batch), prompt_lengths]  # x_n, after the prompt
        return _next_block(head, cache, first)

    def draft(self, head: Head, state: DFlashState, token: jax.Array, spec: "SpecConfig",
              greedy: bool, sampling: SamplingParams, keys: jax.Array, vocab: int
              ) -> tuple[Tree, jax.Array | None]:
        root = Root(token, state.logits[:, :spec.draft_depth], None, state.cache)
        if self.tree:
            return draft_parallel_tree(root, head.draft_ids, spec.top_k, spec.depth,
                                       spec.total_tokens), None
        return parallel(head, root, spec, greedy, sampling, keys, vocab)

    def catch_up(self, head: Head, spec: "SpecConfig", state: DFlashState, tokens: jax.Array,
                 features: jax.Array, n_accepted: jax.Array, running: jax.Array
                 ) -> DFlashState:
        """Context rows for x_n.. (the target's features of the accepted path), the first
        `n_accepted` [B] committed, then the block rooted at the newest token
        tokens[n_accepted - 1]; rows not `running` keep their state."""
        batch, block = tokens.shape
        lengths = state.cache.lengths
        kept = jnp.maximum(n_accepted, 1)
        positions = lengths[:, None] + jnp.arange(block)[None, :]
        keys, values = context_kv(head.params, head.config, features, positions)
        grown = kv_cache.append(state.cache, keys, values, kept)
        cache = grown._replace(lengths=jnp.where(running, grown.lengths, lengths))
        newest = tokens[jnp.arange(batch), kept - 1]
        following = _next_block(head, cache, newest)
        return following._replace(logits=jnp.where(running[:, None, None], following.logits,
                                                   state.logits))


register("dflash")(DFlashDrafter(tree=False))
register("dflash_tree", shape="tree")(DFlashDrafter(tree=True))
