"""The single attention interface: every attention call in eaglejax goes through here.

On the XLA path, many queries over a long cache (the blocks of a chunked prefill) read the
cache in key blocks with an online softmax (running max and sum), and only the blocks up to
the longest row's valid length: their scores never span the whole cache. Few queries
(decoding, verification) take the one-pass reference, which is as fast there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels
from eaglejax.models import kv_cache
from eaglejax.native import cache_attention
from eaglejax.sharding.rules import logical_spec, over_mesh

AttentionImpl = Literal["auto", "pallas", "xla"]
IMPLS = ("auto", "pallas", "xla")

KEY_BLOCK = 512  # cache keys per online-softmax step on the XLA path
BLOCKED_MIN_SCORES = 1 << 22  # blocked XLA attention when Hq * T * S reaches this (per row)
PREFILL_SLOTS = 16  # masked cache slots the kernels get at prefill (Mosaic refuses 1 slot)


def resolve_impl(impl: str) -> str:
    """`auto` means Pallas on GPU/TPU and the XLA reference on CPU."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
    return impl


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, cache_lengths: jax.Array,
              k_new: jax.Array, v_new: jax.Array, mask: jax.Array, *,
              impl: AttentionImpl = "auto", tables: jax.Array | None = None,
              staged: bool = False, cache_mask: jax.Array | None = None) -> jax.Array:
    """Queries q [B,T,Hq,D] over the cached prefix (k/v_cache [B,Hkv,S,D], lengths [B]) plus
    the new K/V [B,T,Hkv,D] under mask [B,T,T]. A cache of more rows than q (a serving
    batch's slots, of which the first B run) is read in place by the native kernel and
    sliced to B rows for the other paths. With block `tables` [B',W] (B' >= B), k/v_cache
    are a paged cache's pools [N,Hkv,BS,D] (`kv_cache.KVCache`); see `paged_attention`.
    `cache_mask` [B,T,S] hides cache keys from some queries besides the lengths (a DFlash
    layer's sliding window): only the XLA reference takes one, so it runs whatever `impl`
    says, over a contiguous cache."""
    if cache_mask is not None:
        if tables is not None:
            raise ValueError("a cache mask needs a contiguous cache, not a paged one")
        rows = q.shape[0]
        return pallas_kernels.tree_attention_reference(
            q, k_cache[:rows], v_cache[:rows], cache_lengths, k_new, v_new, mask,
            kv_layout="bhsd", cache_mask=cache_mask)
    if tables is not None:
        return paged_attention(q, k_cache, v_cache, cache_lengths, tables, k_new, v_new, mask,
                               impl=impl, staged=staged)
    pallas = resolve_impl(impl) == "pallas"
    if not pallas and cache_attention.applies(q, k_cache):
        reference = functools.partial(_rows_of_cache, functools.partial(
            pallas_kernels.tree_attention_reference, kv_layout="bhsd"))
        return cache_attention.attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, mask,
                                         reference)
    if k_cache.shape[0] != q.shape[0]:
        k_cache, v_cache = k_cache[:q.shape[0]], v_cache[:q.shape[0]]
    if pallas:
        if k_cache.shape[2] == 0:  # prefill has no prefix; the kernels want a (masked) block
            k_cache = v_cache = jnp.zeros((*k_cache.shape[:2], PREFILL_SLOTS, k_cache.shape[3]),
                                          k_cache.dtype)
        return _pallas_over_local_heads(q, k_cache, v_cache, cache_lengths, k_new, v_new, mask)
    _, t_new, n_q_heads, _ = q.shape
    s_cache = k_cache.shape[2]
    if s_cache > KEY_BLOCK and n_q_heads * t_new * s_cache >= BLOCKED_MIN_SCORES:
        return blocked_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, mask,
                                 block=KEY_BLOCK)
    return pallas_kernels.tree_attention_reference(
        q, k_cache, v_cache, cache_lengths, k_new, v_new, mask, kv_layout="bhsd")


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                    cache_lengths: jax.Array, tables: jax.Array, k_new: jax.Array,
                    v_new: jax.Array, mask: jax.Array, *, impl: AttentionImpl = "auto",
                    staged: bool = False) -> jax.Array:
    """`attention` over pools [N,Hkv,BS,D] read through block tables [B',W] (B' >= B: the
    first B rows run). `staged`: the new K/V are already in the pools at positions
    cache_lengths[b] .. cache_lengths[b]+T-1 (`kv_cache.stage`, within the tables' W * BS).

    Impl "pallas" with staged pools reads them in place with the paged Pallas kernel (off a
    mesh; BS a power of two >= 16); a row whose entries name no block (outside [0, N), a
    free slot) reads some block: garbage in that row alone. On CPU the native kernel
    reads them through the tables; otherwise the rows are gathered into a contiguous cache
    for `attention`."""
    def gathered(q, k_pool, v_pool, lengths, tables, k_new, v_new, mask):
        return attention(q, kv_cache.gather_rows(k_pool, tables),
                         kv_cache.gather_rows(v_pool, tables), lengths, k_new, v_new, mask,
                         impl=impl)

    tables = tables[:q.shape[0]]
    args = (q, k_pool, v_pool, cache_lengths, tables, k_new, v_new, mask)
    if resolve_impl(impl) == "pallas":
        if staged and _pages_fit_kernel(k_pool) and not over_mesh():
            return _per_platform(functools.partial(pallas_kernels.paged_attention,
                                                   pool_layout="head_major"),
                                 q, k_pool, v_pool, tables, cache_lengths, mask)
        return gathered(*args)
    if cache_attention.applies(q, k_pool):
        return cache_attention.paged_attention(*args, reference=gathered)
    return gathered(*args)


def _pages_fit_kernel(pool: jax.Array) -> bool:
    """Whether the paged Pallas kernel takes the pool's blocks (a power of two >= 16)."""
    block_size = pool.shape[2]
    return block_size >= 16 and not block_size & (block_size - 1)


def _rows_of_cache(reference: Callable[..., jax.Array], q: jax.Array, k_cache: jax.Array,
                   v_cache: jax.Array, *rest: jax.Array) -> jax.Array:
    """`reference` over the cache's first B rows (q [B,...])."""
    return reference(q, k_cache[:q.shape[0]], v_cache[:q.shape[0]], *rest)


def _per_platform(kernel: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
    """`kernel` (a Pallas entry point) for the platform being lowered for: Triton on GPUs,
    Mosaic on TPUs, interpret mode elsewhere (so a program exported from a CPU host for
    "cuda" or "tpu" carries the compiled kernel)."""
    gpu = functools.partial(kernel, backend="gpu")
    return jax.lax.platform_dependent(*args, cuda=gpu, rocm=gpu,
                                      tpu=functools.partial(kernel, backend="tpu"),
                                      default=functools.partial(kernel, interpret=True))


def _tree_kernel(*args: jax.Array) -> jax.Array:
    """The tree-attention kernel (head-major cache) of the platform being lowered for."""
    return _per_platform(functools.partial(pallas_kernels.tree_attention, kv_layout="bhsd"),
                         *args)


def _pallas_over_local_heads(q, k_cache, v_cache, cache_lengths, k_new, v_new, mask):
    """The Pallas kernel, run by each device on its own rows and heads when traced over a
    mesh (`shard_map`: a bare `pallas_call` has no partitioning rule). The heads split
    over `tp` only where the cache's KV heads do (`eaglejax.sharding.rules`)."""
    if not over_mesh():
        return _tree_kernel(q, k_cache, v_cache, cache_lengths, k_new, v_new, mask)
    mesh = jax.sharding.get_abstract_mesh()
    cache = logical_spec(("batch", "kv_heads", "cache_seq", "head_dim"), k_cache.shape, mesh)
    rows, heads = cache[0], cache[1]
    per_token = P(rows, None, heads, None)  # q, k_new, v_new: [B,T,heads,D]
    return jax.shard_map(_tree_kernel, mesh=mesh, check_vma=False,
                         in_specs=(per_token, cache, cache, P(rows), per_token, per_token,
                                   P(rows, None, None)),
                         out_specs=per_token)(q, k_cache, v_cache, cache_lengths, k_new, v_new,
                                              mask)


def _online_update(state: tuple[jax.Array, jax.Array, jax.Array], scores: jax.Array,
                   values: jax.Array, values_dims: str):
    """Fold one key block into the running (max, sum, weighted values) of every query.

    state: max and sum [B,Hkv,Q], accumulator [B,Hkv,Q,D]; scores [B,Hkv,keys,Q] (-inf where
    hidden); values in `values_dims` layout ("bksd" or "bskd")."""
    row_max, row_sum, acc = state
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=2))
    # A query that has seen nothing yet keeps max -inf; shift by 0 there instead (no NaN).
    shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    rescale = jnp.exp(row_max - shift)
    weights = jnp.exp(scores - shift[:, :, None])
    row_sum = row_sum * rescale + jnp.sum(weights, axis=2)
    acc = acc * rescale[..., None] + jnp.einsum(f"bksq,{values_dims}->bkqd", weights, values)
    return new_max, row_sum, acc


def blocked_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                      cache_lengths: jax.Array, k_new: jax.Array, v_new: jax.Array,
                      mask: jax.Array, *, block: int) -> jax.Array:
    """`tree_attention_reference` (bhsd layout) computed flash-style: the cache is read in
    blocks of `block` keys, only up to the longest row's length, then the new tokens are
    folded in; scores never exceed [B,Hkv,block,T*G]. Needs S >= block. Float32 inside."""
    batch, t_new, n_q_heads, head_dim = q.shape
    n_kv_heads, s_cache = k_new.shape[2], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    f32 = jnp.float32
    queries = jnp.swapaxes(q.astype(f32).reshape(batch, t_new, n_kv_heads, group, head_dim), 1, 2)
    queries = queries.reshape(batch, n_kv_heads, t_new * group, head_dim) * head_dim**-0.5

    def cache_block(j, state):
        start = jnp.minimum(j * block, s_cache - block)  # the last block may overlap the one before
        keys = jax.lax.dynamic_slice_in_dim(k_cache, start, block, axis=2).astype(f32)
        values = jax.lax.dynamic_slice_in_dim(v_cache, start, block, axis=2).astype(f32)
        slots = start + jnp.arange(block)
        visible = (slots[None, :] >= j * block) & (slots[None, :] < cache_lengths[:, None])
        scores = jnp.einsum("bksd,bkqd->bksq", keys, queries)
        scores = jnp.where(visible[:, None, :, None], scores, -jnp.inf)
        return _online_update(state, scores, values, "bksd")

    n_queries = t_new * group
    state = (jnp.full((batch, n_kv_heads, n_queries), -jnp.inf, f32),
             jnp.zeros((batch, n_kv_heads, n_queries), f32),
             jnp.zeros((batch, n_kv_heads, n_queries, head_dim), f32))
    n_blocks = jnp.minimum((jnp.max(cache_lengths) + block - 1) // block, -(-s_cache // block))
    state = jax.lax.fori_loop(0, n_blocks, cache_block, state)
    scores_new = jnp.einsum("bskd,bkqd->bksq", k_new.astype(f32), queries)
    new_visible = jnp.repeat(jnp.swapaxes(mask.astype(bool), 1, 2), group, axis=2)  # [B,key,T*G]
    scores_new = jnp.where(new_visible[:, None], scores_new, -jnp.inf)
    _, row_sum, acc = _online_update(state, scores_new, v_new.astype(f32), "bskd")
    out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
    out = jnp.swapaxes(out.reshape(batch, n_kv_heads, t_new, group, head_dim), 1, 2)
    return out.reshape(batch, t_new, n_q_heads, head_dim).astype(q.dtype)
