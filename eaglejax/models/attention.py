"""The single attention interface: every attention call in eaglejax goes through here."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

import pallas_kernels

AttentionImpl = Literal["auto", "pallas", "xla"]
IMPLS = ("auto", "pallas", "xla")


def resolve_impl(impl: str) -> str:
    """`auto` means Pallas on GPU/TPU and the XLA reference on CPU."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
    return impl


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, cache_lengths: jax.Array,
              k_new: jax.Array, v_new: jax.Array, mask: jax.Array, *,
              impl: AttentionImpl = "auto") -> jax.Array:
    """Queries q [B,T,Hq,D] over the cached prefix (k/v_cache [B,Hkv,S,D], lengths [B]) plus
    the new K/V [B,T,Hkv,D] under mask [B,T,T]."""
    if resolve_impl(impl) == "pallas":
        if k_cache.shape[2] == 0:  # prefill has no prefix; the kernel wants one (masked) slot
            k_cache = v_cache = jnp.zeros((*k_cache.shape[:2], 1, k_cache.shape[3]), k_cache.dtype)
        return pallas_kernels.tree_attention(
            q, k_cache, v_cache, cache_lengths, k_new, v_new, mask, kv_layout="bhsd",
            interpret=jax.default_backend() == "cpu")
    return pallas_kernels.tree_attention_reference(
        q, k_cache, v_cache, cache_lengths, k_new, v_new, mask, kv_layout="bhsd")
