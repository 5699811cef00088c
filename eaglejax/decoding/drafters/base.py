"""What every drafter gets and gives, and the registry of drafting methods.

A drafter is one function registered under the `SpecConfig.method` it serves:
`draft(head, root, spec, greedy, sampling, keys, vocab) -> (tree, probs)`, traced inside the
compiled round. It proposes the tree the target verifies (`decoding.tree.Tree`, rooted at
the last accepted token) and, for a chain sampled from the draft, the draft distributions
[B,K,V] the min(1, p/q) rule needs (None otherwise). Verification, commit, the head's
catch-up and the lookup branch are the round's (`decoding.speculative`,
`decoding.drafting`), the same for every drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import jax

from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.tree import Tree
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.head import draft_forward, head_logits
from eaglejax.errors import InputError
from eaglejax.models import kv_cache
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import Params

if TYPE_CHECKING:
    from eaglejax.decoding.spec_config import SpecConfig


class Head(NamedTuple):
    """A draft head bound to its target inside the compiled loop."""

    params: Params
    config: DraftConfig
    target_params: Params
    draft_ids: jax.Array  # [DV] target id of each draft-vocabulary index
    attn_impl: AttentionImpl

    def step(self, tokens: jax.Array, inputs: jax.Array, positions: jax.Array,
             cache: kv_cache.KVCache, mask: jax.Array | None = None):
        """Head outputs for tokens [B,T] fed with the head's own hidden states [B,T,H]."""
        return draft_forward(self.params, self.config, self.target_params, tokens, inputs,
                             positions, cache, from_features=False, mask=mask,
                             attn_impl=self.attn_impl)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Draft-vocabulary logits [...,DV] of the head's un-normed hidden states [...,H]."""
        return head_logits(self.params, self.config, self.target_params, hidden)

    def log_probs(self, hidden: jax.Array) -> jax.Array:
        return jax.nn.log_softmax(self.logits(hidden), axis=-1)


class Root(NamedTuple):
    """Where a round starts, per row: the last accepted token, the head's logits [B,DV]
    (a P-EAGLE head's: [B,K,DV], one per draft position) and hidden state [B,H] proposing
    the next one, and the committed draft cache."""

    token: jax.Array
    logits: jax.Array
    hidden: jax.Array
    cache: kv_cache.KVCache


class Drafter(Protocol):
    """Drafts one round's tree (and a sampled chain's draft distributions, else None)."""

    def __call__(self, head: Head, root: Root, spec: "SpecConfig", greedy: bool,
                 sampling: SamplingParams, keys: jax.Array, vocab: int
                 ) -> tuple[Tree, jax.Array | None]: ...


_DRAFTERS: dict[str, Drafter] = {}


def register(method: str) -> Callable[[Drafter], Drafter]:
    """Decorator: the drafter of `method` (one per method; a second registration is refused)."""
    def add(draft: Drafter) -> Drafter:
        if method in _DRAFTERS:
            raise ValueError(f"drafting method {method!r} is registered twice")
        _DRAFTERS[method] = draft
        return draft
    return add


def methods() -> tuple[str, ...]:
    """The registered drafting methods, in registration order."""
    return tuple(_DRAFTERS)


def drafter(method: str) -> Drafter:
    """The drafter registered for `method`; InputError naming the registered ones."""
    if method not in _DRAFTERS:
        raise InputError(f"unknown drafting method {method!r}; registered: "
                         + ", ".join(repr(m) for m in _DRAFTERS))
    return _DRAFTERS[method]


def top_k_last(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis of x [..., N], computed on x as a 2-D [M,N] array:
    XLA:CPU can turn a 3-D top-k into a full sort of all N entries (about 8 ms for
    [1,3,8192] on a 2-core CPU), where the 2-D call keeps its top-k kernel (<0.1 ms)."""
    values, index = jax.lax.top_k(x.reshape(-1, x.shape[-1]), k)
    return values.reshape(*x.shape[:-1], k), index.reshape(*x.shape[:-1], k)
