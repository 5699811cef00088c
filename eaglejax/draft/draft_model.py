"""`DraftModel`: a smaller target-like model drafting for a target of the same tokenizer
(draft-model speculation, `SpecConfig.draft_model` / `draft_model_tree`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.errors import ConfigError
from eaglejax.models.llama import Params
from eaglejax.models.placement import replicate
from eaglejax.target import Target

if TYPE_CHECKING:
    from eaglejax.loading.hub import ResolvedSource


def check_shared_tokenizer(model: Target, target: Target) -> None:
    """ConfigError unless `model` can draft for `target`: the same token for every id of
    their tokenizers (added tokens included) and the same BOS and EOS ids; without
    tokenizers on both, the same vocabulary size."""
    where = f"{model.source} cannot draft for {target.source}"
    mine, theirs = model.tokenizer, target.tokenizer
    if mine is None or theirs is None:
        if mine is not theirs:  # one has a tokenizer, the other none
            missing = model.source if mine is None else target.source
            raise ConfigError(f"{where}: {missing} has no tokenizer, so the two vocabularies "
                              f"cannot be compared")
        if model.config.vocab_size != target.config.vocab_size:
            raise ConfigError(f"{where}: vocab_size {model.config.vocab_size} != "
                              f"{target.config.vocab_size} (and neither has a tokenizer)")
        return
    vocab = mine.backend.get_vocab(with_added_tokens=True)
    other = theirs.backend.get_vocab(with_added_tokens=True)
    differ = sorted(set(vocab.items()) ^ set(other.items()), key=lambda item: item[1])
    if differ:
        token, token_id = differ[0]
        raise ConfigError(f"{where}: their tokenizers differ in {len(differ)} (token, id) "
                          f"pairs, e.g. {token!r} -> {token_id} in one only")
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(mine, name) != getattr(theirs, name):
            raise ConfigError(f"{where}: {name} {getattr(mine, name)} != "
                              f"{getattr(theirs, name)}")


@dataclasses.dataclass
class DraftModel:
    """A model drafting for `target`: any model `eaglejax.load_target` reads, with the
    target's tokenizer. Build it with `eaglejax.load_draft_model`, or `DraftModel.of` for a
    loaded one. It drafts the ids both vocabularies hold (`d2t`: zeros over them, the
    draft-to-target map of a head whose ids are the target's)."""

    model: Target
    target: Target

    @classmethod
    def of(cls, model: Target, target: Target) -> "DraftModel":
        """`model` drafting for `target` (ConfigError when their tokenizers differ); on a
        target's mesh, the draft model is replicated on every device."""
        if not isinstance(model, Target) or not isinstance(target, Target):
            raise ConfigError(f"DraftModel.of wants two Targets (eaglejax.load_target), got "
                              f"{type(model).__name__} and {type(target).__name__}")
        check_shared_tokenizer(model, target)
        return cls(model, target).for_target(target)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def params(self) -> Params:
        return self.model.params

    @property
    def d2t(self) -> jax.Array:
        shared = min(self.model.config.vocab_size, self.target.config.vocab_size)
        return jnp.zeros((shared,), jnp.int32)

    @property
    def source(self) -> str:
        return self.model.source

    parallel = dflash = False  # drafts one token per forward

    def for_target(self, target: Target) -> "DraftModel":
        """This draft model for `target`, the same model placed elsewhere
        (`Target.on_mesh`): on a mesh, replicated on every device."""
        model = self.model
        if target.mesh is not None:
            model = dataclasses.replace(model, params=replicate(model.params, target.mesh))
        return dataclasses.replace(self, model=model, target=target)


def load_draft_model(path: str | Path | ResolvedSource, *, target: Target,
                     dtype: jnp.dtype | str | None = None,
                     weight_dtype: jnp.dtype | str | None = None) -> DraftModel:
    """Load a model (a built-in name, a GGUF file, an HF directory, an eaglejax checkpoint or
    a Hub id, as `eaglejax.load_target`) to draft for `target`, checking that they share a
    tokenizer (ConfigError otherwise). `dtype` defaults to the target's compute dtype,
    `weight_dtype` to how the target stores its matrices."""
    from eaglejax.loading.target_loader import load_target  # loading is the layer above

    dtype = target.dtype if dtype is None else dtype
    if weight_dtype is None and np.dtype(target.weight_dtype) != np.dtype(target.dtype):
        weight_dtype = target.weight_dtype
    return DraftModel.of(load_target(path, dtype=dtype, weight_dtype=weight_dtype), target)
