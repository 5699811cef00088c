"""Static description of an EAGLE draft head."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from eaglejax.config import ModelConfig

DraftKind = Literal["eagle3", "eagle1", "dflash"]


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """What a DFlash layer's block queries see (z-lab's rule, `eaglejax.draft.dflash`): with
    `causal`, no key after the query's position; with a `window` w, no key w or more
    positions before it (nor, when not causal, w or more after it). The default, the whole
    context and the whole block, is a "full_attention" layer's in every layout."""

    window: int | None = None
    causal: bool = False

    def __post_init__(self):
        if self.window is not None and (isinstance(self.window, bool)
                                        or not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"a layer's window must be a positive integer, got {self.window!r}")

    @property
    def plain(self) -> bool:
        """Whether the layer sees the whole context and the whole block."""
        return self.window is None and not self.causal


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A draft head's shape and wiring; hashable, so it can be a jit static argument.

    `decoder` describes the head's decoder layers (its `vocab_size` is the target's V).
    `tap_layers` are target layers whose ENTERING residual streams are the head's input
    features (EAGLE-3); EAGLE-1/2 heads read the target's final normed hidden state and
    have `tap_layers == ()`. A P-EAGLE head is an EAGLE-3 head with `mask_token_id`. A
    DFlash drafter (`kind` "dflash", `draft.dflash`) fills a block of `block_size` tokens
    (the last accepted one, then `mask_token_id`) in one forward over its context's
    projected taps; it shares the target's embedding, and its output head too unless its
    vocabulary is reduced (`reduced_vocab`: then it has its own `lm_head`); its layers may be
    typed (`layer_attention`: causal in the block, a sliding window over the context).
    """

    kind: DraftKind
    decoder: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    tap_layers: tuple[int, ...] = ()
    fc_bias: bool = False
    fc_norm: bool = False  # SpecForge: one RMSNorm per tap before fc
    input_norm: bool = False  # speculators `norm_before_fc`: one RMSNorm over all taps
    norm_before_residual: bool = False  # vLLM: the first layer's residual is hidden_norm(x)
    own_embedding: bool = False  # the head ships embed_tokens instead of sharing the target's
    mask_token_id: int | None = None  # P-EAGLE: set for a head that drafts K tokens at once
    block_size: int = 0  # DFlash: the block one forward fills (0 for other kinds)
    # DFlash: each layer's LayerAttention; () when every layer is plain (canonical: a tuple
    # of plain layers is stored as ())
    layer_attention: tuple[LayerAttention, ...] = ()

    def __post_init__(self):
        kinds = tuple(self.layer_attention)
        if all(k.plain for k in kinds):
            kinds = ()
        if kinds and (self.kind != "dflash" or len(kinds) != self.decoder.num_layers):
            raise ValueError(f"layer_attention holds {len(kinds)} layers' kinds; a {self.kind} "
                             f"head of {self.decoder.num_layers} layers takes "
                             f"{'one per layer' if self.kind == 'dflash' else 'none'}")
        object.__setattr__(self, "layer_attention", kinds)

    def layer(self, i: int) -> LayerAttention:
        """Layer i's attention kind (plain unless `layer_attention` says otherwise)."""
        return self.layer_attention[i] if self.layer_attention else LayerAttention()

    @property
    def parallel(self) -> bool:
        """A P-EAGLE head: besides the next token it proposes K-1 more from mask slots
        (`mask_token_id` embedded, the learned `mask_hidden` in place of target features),
        all in one forward."""
        return self.kind == "eagle3" and self.mask_token_id is not None

    @property
    def reduced_vocab(self) -> bool:
        """Whether the head predicts fewer tokens than the target's vocabulary (its d2t then
        maps its draft ids to target ids; an EAGLE-3 head has its own `lm_head` either way,
        a DFlash drafter only then)."""
        return self.draft_vocab_size < self.decoder.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.decoder.hidden_size

    @property
    def feature_size(self) -> int:
        """Width of the target features the head consumes."""
        return self.target_hidden_size * max(len(self.tap_layers), 1)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["decoder"] = self.decoder.to_hf_dict()
        out["tap_layers"] = list(self.tap_layers)
        if not self.layer_attention:  # as heads were saved before layers had kinds
            del out["layer_attention"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "draft config") -> "DraftConfig":
        fields = dict(data)
        fields["decoder"] = ModelConfig.from_hf_dict(fields["decoder"], source)
        fields["tap_layers"] = tuple(int(i) for i in fields.get("tap_layers", ()))
        fields["layer_attention"] = tuple(LayerAttention(**k)
                                          for k in fields.get("layer_attention", ()))
        return cls(**fields)
