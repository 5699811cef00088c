"""The Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3) as pure functions.

Parameters are a plain dict pytree with the layers stacked on a leading axis (scanned);
`logical_axes(config)` gives the same tree of logical axis names for sharding.
One `forward` serves prefill, single-token decode and tree verification: it takes any
number of new tokens per row with explicit positions and an optional mask among them,
attends over the cache's valid prefix, and returns the new K/V rows without writing
them (the caller commits what it accepts).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eaglejax.config import ModelConfig
from eaglejax.models.attention import AttentionImpl, attention
from eaglejax.models.kv_cache import KVCache
from eaglejax.models.rope import apply_rope, inverse_frequencies

Params = dict[str, Any]


class ForwardOutput(NamedTuple):
    """hidden: final-normed [B,T,H]; k_new/v_new: [L,B,T,kv,D]; taps: [B,T,n*H] or None."""

    hidden: jax.Array
    k_new: jax.Array
    v_new: jax.Array
    taps: jax.Array | None


def logical_axes(config: ModelConfig) -> Params:
    """Logical axis names of every parameter, in the same tree structure as the params."""
    layers = {
        "attn_norm": ("layers", "norm"),
        "mlp_norm": ("layers", "norm"),
        "wq": ("layers", "embed", "heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "wv": ("layers", "embed", "kv_heads", "head_dim"),
        "wo": ("layers", "heads", "head_dim", "embed"),
        "w_gate": ("layers", "embed", "mlp"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
    }
    if config.attention_bias:
        layers.update(bq=("layers", "heads", "head_dim"), bk=("layers", "kv_heads", "head_dim"),
                      bv=("layers", "kv_heads", "head_dim"))
    if config.qk_norm:
        layers.update(q_norm=("layers", "head_dim"), k_norm=("layers", "head_dim"))
    axes: Params = {"embed": ("vocab", "embed"), "layers": layers, "final_norm": ("norm",)}
    if not config.tie_word_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def param_shapes(config: ModelConfig) -> Params:
    """The shape of every parameter (the contract loaders and converters check against)."""
    c = config
    sizes = {"layers": c.num_layers, "embed": c.hidden_size, "norm": c.hidden_size,
             "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
             "mlp": c.intermediate_size, "vocab": c.vocab_size}
    return jax.tree.map(lambda axes: tuple(sizes[a] for a in axes), logical_axes(config),
                        is_leaf=lambda x: isinstance(x, tuple))


def init_params(config: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32,
                scale: float = 0.02) -> Params:
    """Random parameters (normal * scale; norms at 1) for tests and experiments."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    arrays = [
        jnp.ones(shape, dtype) if "norm" in path
        else (scale * jax.random.normal(k, shape)).astype(dtype)
        for k, shape, path in zip(keys, leaves, paths)
    ]
    return jax.tree.unflatten(treedef, arrays)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def causal_mask(batch: int, t_new: int) -> jax.Array:
    """[B,T,T] lower-triangular mask among new tokens."""
    tri = jnp.tril(jnp.ones((t_new, t_new), dtype=bool))
    return jnp.broadcast_to(tri, (batch, t_new, t_new))


def _decoder_layer(config: ModelConfig, inv_freq: np.ndarray, h: jax.Array, layer: Params,
                   k_cache: jax.Array, v_cache: jax.Array, cache_lengths: jax.Array,
                   positions: jax.Array, mask: jax.Array, impl: AttentionImpl):
    eps = config.rms_norm_eps
    x = rms_norm(h, layer["attn_norm"], eps)
    q = jnp.einsum("bth,hnd->btnd", x, layer["wq"])
    k = jnp.einsum("bth,hnd->btnd", x, layer["wk"])
    v = jnp.einsum("bth,hnd->btnd", x, layer["wv"])
    if config.attention_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    if config.qk_norm:
        q, k = rms_norm(q, layer["q_norm"], eps), rms_norm(k, layer["k_norm"], eps)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    attn = attention(q, k_cache, v_cache, cache_lengths, k, v, mask, impl=impl)
    h = h + jnp.einsum("btnd,ndh->bth", attn, layer["wo"])
    x = rms_norm(h, layer["mlp_norm"], eps)
    gated = jax.nn.silu(x @ layer["w_gate"]) * (x @ layer["w_up"])
    return h + gated @ layer["w_down"], k, v


def forward(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache | None = None, *, mask: jax.Array | None = None,
            tap_layers: tuple[int, ...] = (), attn_impl: AttentionImpl = "auto") -> ForwardOutput:
    """Run new tokens [B,T] at positions [B,T] over the cache's valid prefix.

    mask [B,T,T] says which new tokens each new token sees (default causal). With
    `tap_layers`, also returns the residual streams entering those layers, concatenated
    in the given order ([B,T,len*H]); layer id L means the final un-normed output.
    With none asked, no tap is computed.
    """
    batch, t_new = tokens.shape
    if mask is None:
        mask = causal_mask(batch, t_new)
    if cache is None:
        empty = jnp.zeros((config.num_layers, batch, 0, config.num_kv_heads, config.head_dim),
                          params["embed"].dtype)
        cache = KVCache(empty, empty, jnp.zeros((batch,), jnp.int32))
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    h = params["embed"][tokens]

    def step(h, xs):
        layer, k_cache, v_cache = xs
        h_out, k, v = _decoder_layer(config, inv_freq, h, layer, k_cache, v_cache,
                                     cache.lengths, positions, mask, attn_impl)
        return h_out, (k, v, h if tap_layers else None)

    h, (k_new, v_new, entering) = jax.lax.scan(step, h, (params["layers"], cache.k, cache.v))
    taps = None
    if tap_layers:
        streams = [h if i == config.num_layers else entering[i] for i in tap_layers]
        taps = jnp.concatenate(streams, axis=-1)
    return ForwardOutput(rms_norm(h, params["final_norm"], config.rms_norm_eps), k_new, v_new, taps)


def lm_head(params: Params, hidden: jax.Array) -> jax.Array:
    """Float32 logits over the vocabulary for final-normed hidden states [..., H]."""
    if "lm_head" in params:
        logits = hidden @ params["lm_head"]
    else:
        logits = jnp.einsum("...h,vh->...v", hidden, params["embed"])
    return logits.astype(jnp.float32)
