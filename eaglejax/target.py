"""`Target`: a loaded target model (config, parameters, tokenizer) and its inspection API."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eaglejax import validation
from eaglejax.config import ModelConfig
from eaglejax.errors import InputError
from eaglejax.models import gguf_blocks
from eaglejax.models.attention import AttentionImpl
from eaglejax.models.llama import (
    Params, compute_dtype, forward, lm_head, param_info, store_matrices)
from eaglejax.models.placement import TargetPlacement
from eaglejax.models.quantized import any_int8
from eaglejax.tokenizer import Tokenizer

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# How a target may store its matrices: a float dtype, int8 (`models.quantized`), or 4-bit
# blocks with a minimum (int4) or without (int4-sym: `models.gguf_blocks.quantize`).
WEIGHT_DTYPES = (*FLOAT_DTYPES, "int8", "int4", "int4-sym")
WeightStorage = jnp.dtype | str  # a dtype, or "int4-sym" (no dtype of its own)


def weight_storage(name: str, value: jnp.dtype | str) -> WeightStorage:
    """`value` among `WEIGHT_DTYPES` as a JAX dtype, or "int4-sym" as it is; InputError
    naming argument `name` otherwise."""
    if isinstance(value, str) and value in gguf_blocks.INT4_KINDS and value != "int4":
        return value
    return validation.dtype(name, value, WEIGHT_DTYPES)


def default_tap_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default feature taps: residual streams entering layers 2, L//2 and L-3."""
    return (2, num_layers // 2, num_layers - 3)


@functools.partial(jax.jit, static_argnames=("config", "tap_layers", "attn_impl", "want"))
def _score(params: Params, config: ModelConfig, tokens: jax.Array, *, tap_layers: tuple[int, ...],
           attn_impl: AttentionImpl, want: str):
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length)[None], (batch, length))
    out = forward(params, config, tokens, positions, None, tap_layers=tap_layers,
                  attn_impl=attn_impl)
    return {"logits": lambda: lm_head(params, out.hidden), "taps": lambda: out.taps,
            "hidden": lambda: out.hidden}[want]()


@dataclasses.dataclass
class Target:
    """A target model ready for decoding. Build it with `eaglejax.load_target`."""

    config: ModelConfig
    params: Params
    tokenizer: "Tokenizer | None"
    source: str
    eos_token_ids: tuple[int, ...] = ()
    attn_impl: AttentionImpl = "auto"
    mesh: Mesh | None = None  # the device mesh the parameters are sharded over

    def on_mesh(self, mesh: Mesh) -> "Target":
        """This target with its parameters sharded over `mesh` (`eaglejax.make_mesh`;
        rule table: `eaglejax.sharding.rules`; quantized matrices split with their scales:
        `TargetPlacement.place_quantized`); parameters already placed there stay."""
        if self.mesh is not None:
            raise InputError(f"{self.source}: this target is already on a mesh; load it "
                             f"again with load_target(..., mesh=) for another")
        placement = TargetPlacement.plan(self.config, mesh)
        params = placement.place_tree(self.params)
        return dataclasses.replace(self, config=placement.config, params=params, mesh=mesh)

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype (activations, KV cache); see `weight_dtype` for storage."""
        return compute_dtype(self.params)

    @property
    def weight_dtype(self) -> jnp.dtype:
        """The dtype the weight matrices are stored in (int8 where any is quantized: those
        whose shape does not tile keep the compute dtype)."""
        if any_int8(self.params):
            return jnp.dtype(jnp.int8)
        return self.params["embed"].dtype

    @property
    def storage(self) -> str:
        """How the matrices are stored, in words: a dtype's name, or the GGUF block kinds
        kept as stored ("Q4_1 + Q8_0 blocks")."""
        kinds = gguf_blocks.kinds(self.params)
        return f"{' + '.join(kinds)} blocks" if kinds else jnp.dtype(self.weight_dtype).name

    def with_weight_dtype(self, dtype: jnp.dtype | str) -> "Target":
        """This target with its matrices (embedding, projections, output head) stored in
        `dtype` and everything else unchanged: activations, norms and the KV cache keep the
        compute dtype. bfloat16 halves the bytes a decode step reads; "int8" quarters them
        (`models.quantized`: per-row scales, products on int8 activations); "int4" stores
        4-bit blocks of 32 with a scale and a minimum (`models.gguf_blocks.quantize`, 5 bits
        a weight, the same products), "int4-sym" with a scale alone (Q4_0's layout, 4.5 bits
        a weight). Matrices whose shape does not tile stay as they are. On a mesh each
        matrix is quantized on the host and split as before, one at a time
        (`TargetPlacement.place_quantized`)."""
        dtype = weight_storage("weight_dtype", dtype)
        if self.weight_dtype == jnp.int8:
            raise InputError(f"this target's matrices are already quantized ({self.storage}); "
                             f"load the model again to store them another way")
        place = TargetPlacement.plan(self.config, self.mesh).place if self.mesh else None
        params = store_matrices(param_info(self.config), self.params, dtype, place)
        return dataclasses.replace(self, params=params)

    def save(self, path: str) -> None:
        """Write an eaglejax checkpoint (loads much faster than re-converting GGUF/HF files),
        its matrices as stored (int8, int4 and a GGUF file's blocks reload as they are)."""
        from eaglejax.loading.checkpoint import save_target  # loading is the layer above

        save_target(self, path)

    def _token_array(self, token_ids: Sequence[Sequence[int]] | np.ndarray) -> jax.Array:
        """[B, T] int32 ids from one row or equal-length rows of integer ids in the
        vocabulary (InputError for floats, booleans, ragged rows or ids out of range)."""
        array = validation.token_batch("token_ids", token_ids, self.config.vocab_size)
        return jnp.asarray(array, jnp.int32)

    def logits(self, token_ids: Sequence[Sequence[int]] | np.ndarray) -> jax.Array:
        """Float32 logits [B,T,V] of a full sequence scored causally from position 0."""
        return _score(self.params, self.config, self._token_array(token_ids), tap_layers=(),
                      attn_impl=self.attn_impl, want="logits")

    def final_hidden(self, token_ids: Sequence[Sequence[int]] | np.ndarray) -> jax.Array:
        """The final normed hidden states [B,T,H] (the EAGLE-1/2 feature)."""
        return _score(self.params, self.config, self._token_array(token_ids), tap_layers=(),
                      attn_impl=self.attn_impl, want="hidden")

    def features(self, token_ids: Sequence[Sequence[int]] | np.ndarray,
                 layer_ids: Sequence[int] | None = None) -> jax.Array:
        """Residual streams entering `layer_ids` (default `(2, L//2, L-3)`), concatenated:
        [B,T,len(layer_ids)*H]."""
        num_layers = self.config.num_layers
        if layer_ids is None:
            layers = default_tap_layers(num_layers)
        elif isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Sequence):
            raise InputError(f"layer_ids must be a sequence of layer indices, got {layer_ids!r}")
        else:
            layers = tuple(layer_ids)
        bad = [i for i in layers if not validation.is_int(i) or not 0 <= i <= num_layers]
        if not layers or bad:
            raise InputError(f"layer_ids must be non-empty and within [0, {num_layers}], "
                             f"got {layers}")
        return _score(self.params, self.config, self._token_array(token_ids), tap_layers=layers,
                      attn_impl=self.attn_impl, want="taps")
