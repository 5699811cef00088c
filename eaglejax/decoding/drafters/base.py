"""What every drafter gets and gives, and the registry of drafting methods.

A drafter serves one `SpecConfig.method` and answers three calls, traced inside the
compiled loop (`Drafter`):
- `prefill(head, spec, tokens, features, prompt_lengths, capacity, chunk)`: its own state
  after the prompt (a pytree with the batch axis first in every leaf but scalars), from
  each row's tokens [B,P+1] x_0..x_n (the prompt, then the first new token; right-padded)
  and the target's features [B,P,F] at the prompt's positions;
- `draft(head, state, token, spec, greedy, sampling, keys, vocab) -> (tree, probs)`: the
  tree the target verifies (`decoding.tree.Tree`, rooted at the last accepted token) and,
  for a chain sampled from the draft, the draft distributions [B,K,V] the min(1, p/q) rule
  needs (None otherwise);
- `catch_up(head, spec, state, tokens, features, n_accepted, running)`: its state after a
  round (or a plain segment) accepted `tokens`, given the target's features there.
`head` is the draft weights bound in the loop, as the drafter's `drafts_with` declares:
"head" (the default) an EAGLE head (`Head`), "model" a draft model (`draft_model.ModelHead`),
None nothing (the method runs with no draft weights); `features` are the target's feature
taps (EAGLE-3) or final hidden states (EAGLE-1, or no head) at the same positions. Verification, the
commit and the lookup branch are the round's (`decoding.speculative`, `decoding.drafting`).
The EAGLE head's methods draft from its state (`HeadDrafter` over `head_state.HeadState`):
registering a tree-proposing function makes one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import jax

from eaglejax.decoding.drafters import head_state
from eaglejax.decoding.drafters.head_state import HeadState
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.tree import Tree
from eaglejax.draft.config import DraftConfig
from eaglejax.models.kv_cache import KVCache
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
             cache: kv_cache.KVCache, mask: jax.Array | None = None, *, stage: bool = True):
        """Head outputs for tokens [B,T] fed with the head's own hidden states [B,T,H];
        `stage=False` where the caller drops the staged cache (`draft_forward`)."""
        return draft_forward(self.params, self.config, self.target_params, tokens, inputs,
                             positions, cache, from_features=False, mask=mask,
                             attn_impl=self.attn_impl, stage=stage)

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


class TreeProposal(Protocol):
    """Drafts one round's tree from the EAGLE head's state (`Root`): what a method of
    `HeadDrafter` supplies."""

    def __call__(self, head: Head, root: Root, spec: "SpecConfig", greedy: bool,
                 sampling: SamplingParams, keys: jax.Array, vocab: int
                 ) -> tuple[Tree, jax.Array | None]: ...


class Drafter(Protocol):
    """A drafting method: its own state between rounds and the tree it proposes (see the
    module docstring). A drafter without an attribute `drafts_with` ("head", "model" or
    None) drafts with an EAGLE head."""

    def prefill(self, head: Head, spec: "SpecConfig", tokens: jax.Array, features: jax.Array,
                prompt_lengths: jax.Array, capacity: int, chunk: int) -> Any: ...

    def draft(self, head: Head, state: Any, token: jax.Array, spec: "SpecConfig",
              greedy: bool, sampling: SamplingParams, keys: jax.Array, vocab: int
              ) -> tuple[Tree, jax.Array | None]: ...

    def catch_up(self, head: Head, spec: "SpecConfig", state: Any, tokens: jax.Array,
                 features: jax.Array, n_accepted: jax.Array, running: jax.Array) -> Any: ...


@dataclasses.dataclass(frozen=True)
class HeadDrafter:
    """A drafter over the EAGLE head's state (`head_state`): `propose` drafts the tree from
    the root token and the head's committed cache and proposal."""

    propose: TreeProposal
    drafts_with = "head"

    def prefill(self, head: Head, spec: "SpecConfig", tokens: jax.Array, features: jax.Array,
                prompt_lengths: jax.Array, capacity: int, chunk: int,
                cached: KVCache | None = None) -> HeadState:
        # Draft position t consumes token t+1: the tokens from x_1.
        return head_state.prefill(head, spec, tokens[:, 1:], features, prompt_lengths,
                                  capacity, chunk, cached)

    def draft(self, head: Head, state: HeadState, token: jax.Array, spec: "SpecConfig",
              greedy: bool, sampling: SamplingParams, keys: jax.Array, vocab: int
              ) -> tuple[Tree, jax.Array | None]:
        root = Root(token, state.logits, state.hidden, state.cache)
        return self.propose(head, root, spec, greedy, sampling, keys, vocab)

    def catch_up(self, head: Head, spec: "SpecConfig", state: HeadState, tokens: jax.Array,
                 features: jax.Array, n_accepted: jax.Array, running: jax.Array
                 ) -> HeadState:
        return head_state.advance(head, spec, state, tokens, features, n_accepted, running)


# The shapes a method's trees take, and the SpecConfig fields that size them: "chain" (one
# path of `num_draft_tokens`), "tree" (`top_k`, `depth`, `total_tokens`), "paths" (`paths`).
SHAPES = ("chain", "tree", "paths")
_DRAFTERS: dict[str, Drafter] = {}
_SHAPE_OF: dict[str, str] = {}


def register(method: str, shape: str = "chain") -> Callable[[Any], Any]:
    """Decorator: the drafter of `method`, whose trees take `shape` (`SHAPES`; one drafter
    per method, a second registration is refused): a `Drafter`, or a `TreeProposal`
    function, which drafts from the EAGLE head's state (`HeadDrafter`). Returns what it
    decorates."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: expected one of {SHAPES}")

    def add(made: Any) -> Any:
        if method in _DRAFTERS:
            raise ValueError(f"drafting method {method!r} is registered twice")
        is_drafter = all(hasattr(made, name) for name in ("prefill", "draft", "catch_up"))
        _DRAFTERS[method] = made if is_drafter else HeadDrafter(made)
        _SHAPE_OF[method] = shape
        return made
    return add


def unregister(method: str) -> None:
    """Remove a registered method (e.g. to register a changed drafter while experimenting)."""
    drafter(method)  # InputError for an unknown method
    del _DRAFTERS[method], _SHAPE_OF[method]


def shape_of(method: str) -> str:
    """The shape (`SHAPES`) of a registered method's trees."""
    drafter(method)  # InputError for an unknown method
    return _SHAPE_OF[method]


DRAFT_WEIGHTS = ("head", "model", None)


def drafts_with(method: str) -> str | None:
    """What a registered method drafts with: "head" (an EAGLE head, `load_draft`), "model"
    (a draft model, `load_draft_model`) or None (no draft weights)."""
    kind = getattr(drafter(method), "drafts_with", "head")
    if kind not in DRAFT_WEIGHTS:
        raise ValueError(f"drafting method {method!r} drafts_with {kind!r}: expected one of "
                         f"{DRAFT_WEIGHTS}")
    return kind


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
