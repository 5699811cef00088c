"""`attention(..., tables=..., impl="pallas")` over the engine's head-major pools: the paged
Pallas kernel (interpret mode here) equals the gather path on ragged rows, free slots and
extra table rows; nothing outside the rows' blocks is read; exported for cuda / tpu it
carries the compiled kernel and no gather of the pools; a tiny model's paged decode and
verify steps give the XLA path's greedy tokens."""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention import tree_mask
from tolerances import FORWARD_UNITS, assert_close_scaled

from eaglejax.config import ModelConfig
from eaglejax.models import kv_cache, llama
from eaglejax.models.attention import attention
from eaglejax.programs.export import KERNEL_CALLS

BLOCK = 32  # the engine's block size
WIDTH = 3  # table entries per row
LIVE = 3  # rows 0..2 hold blocks; row 3 is a free slot; row 4 a table row past q's batch


class Case(NamedTuple):
    q: jax.Array        # [B,T,Hq,D]
    k_pool: jax.Array   # [N,Hkv,BLOCK,D], the new K/V staged
    v_pool: jax.Array
    lengths: jax.Array  # [B]
    k_new: jax.Array    # [B,T,Hkv,D]
    v_new: jax.Array
    mask: jax.Array     # [B,T,T]
    tables: jax.Array   # [B+1,WIDTH], N where a row has no block


def paged_case(seed: int, t_new: int, n_q: int = 4, n_kv: int = 2, head_dim: int = 16,
               poison: bool = False) -> Case:
    """Live rows of ragged lengths (empty, ending one short of a block, the table full),
    each holding the blocks its prefix and new tokens need in a random order of the pool
    (entries past them: no block), a free slot and a table row past q's batch. The new K/V
    are staged as the engine stages them (`kv_cache.write_paged`). `poison`: NaN in every
    block no live row holds (the extra row's, the spare ones) and in every slot at or past
    a live row's length + T."""
    rng = np.random.default_rng(seed)
    lengths = np.array([0, BLOCK - 1, WIDTH * BLOCK - t_new, 0])
    held = [-(-(n + t_new) // BLOCK) for n in lengths[:LIVE]]
    n_blocks = sum(held) + WIDTH + 2  # the extra row's blocks and spare ones
    order = iter(rng.permutation(n_blocks))
    tables = np.full((LIVE + 2, WIDTH), n_blocks)
    for b, count in enumerate(held):
        tables[b, :count] = [next(order) for _ in range(count)]
    tables[LIVE + 1] = [next(order) for _ in range(WIDTH)]
    batch = LIVE + 1

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    q, k_new, v_new = (normal(batch, t_new, h, head_dim) for h in (n_q, n_kv, n_kv))
    mask = jnp.asarray(np.stack([tree_mask(rng, t_new) for _ in range(batch)]))
    tables, lengths = jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32)
    pools = []
    for new in (k_new, v_new):
        pool = np.array(normal(n_blocks, n_kv, BLOCK, head_dim))
        if poison:
            pool[sorted(set(range(n_blocks)) - set(np.asarray(tables[:LIVE]).ravel()))] = np.nan
        pool = np.array(kv_cache.write_paged(jnp.asarray(pool), new, lengths, tables[:batch]))
        if poison:
            for b in range(LIVE):
                end = int(lengths[b]) + t_new
                last = int(tables[b, (end - 1) // BLOCK])
                pool[last, :, (end - 1) % BLOCK + 1:] = np.nan
        pools.append(jnp.asarray(pool))
    return Case(q, *pools, lengths, k_new, v_new, mask, tables)


def run(case: Case, impl: str, staged: bool = True) -> np.ndarray:
    fn = jax.jit(functools.partial(attention, impl=impl, staged=staged))
    return np.asarray(fn(*case[:7], tables=case.tables))


SHAPES = [(1, 4, 2), (8, 4, 2), (5, 6, 3)]  # T (1: a decode step, else a tree), Hq, Hkv


@pytest.mark.parametrize("t_new,n_q,n_kv", SHAPES)
def test_pallas_equals_the_gather_path(t_new, n_q, n_kv):
    """Live rows within float32 noise of the XLA path over the gathered rows; the free
    slot's row is finite (it reads some block of the pool)."""
    case = paged_case(t_new + n_q, t_new, n_q, n_kv)
    got = run(case, "pallas")
    assert_close_scaled(got[:LIVE], run(case, "xla")[:LIVE], units=FORWARD_UNITS)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("t_new", [1, 8])
def test_blocks_no_live_row_holds_are_never_read(t_new):
    """NaN in unheld blocks (the extra table row's too) and in stale slots: the live rows'
    output is bit for bit the one over clean pools."""
    clean, poisoned = (paged_case(3, t_new, poison=p) for p in (False, True))
    np.testing.assert_array_equal(run(poisoned, "pallas")[:LIVE], run(clean, "pallas")[:LIVE])


def test_unstaged_pools_take_the_gather_path():
    """Without the new K/V in the pools (staged=False: tree drafting reads the head's
    cache), impl "pallas" still attends to the k_new/v_new given."""
    case = paged_case(4, 8)
    unstaged = case._replace(k_new=-case.k_new, v_new=2 * case.v_new)
    got = run(unstaged, "pallas", staged=False)
    assert_close_scaled(got[:LIVE], run(unstaged, "xla")[:LIVE], units=FORWARD_UNITS)


# ------------------------------------------------------------------------------ export

KERNELS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
MODULES = {"cuda": "jax._src.lib.triton", "tpu": "jax._src.tpu_custom_call"}


def exported_text(fn, args, platform: str) -> str:
    if importlib.util.find_spec(MODULES[platform]) is None:
        pytest.skip(f"{MODULES[platform]} is not available in this jaxlib")
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=KERNEL_CALLS)
    return exported(*args).mlir_module()


def pool_reads(text: str, pool: jax.ShapeDtypeStruct) -> list[str]:
    """Lines of `text` that gather, transpose, slice or copy a whole pool."""
    pool_type = "tensor<" + "x".join(map(str, pool.shape)) + "xbf16>"
    ops = ("gather", "transpose", "pad", "concatenate", "copy", "slice")
    return [line for line in text.splitlines()
            if pool_type in line and any(f"stablehlo.{op}" in line for op in ops)]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_attention_exports_with_the_compiled_paged_kernel(platform):
    """Llama-3.1-8B heads over a 1,000-block pool, 6 table rows for a batch of 4: the
    exported program calls the platform's kernel on the pools as they are (the gather path,
    unstaged, is the negative control)."""
    sds = jax.ShapeDtypeStruct
    pool = sds((1000, 8, BLOCK, 128), jnp.bfloat16)
    new = sds((4, 8, 8, 128), jnp.bfloat16)
    args = (sds((4, 8, 32, 128), jnp.bfloat16), pool, pool, sds((4,), jnp.int32), new, new,
            sds((4, 8, 8), jnp.bool_), sds((6, 64), jnp.int32))

    def fn(staged, *args):
        return attention(*args[:7], impl="pallas", tables=args[7], staged=staged)

    text = exported_text(functools.partial(fn, True), args, platform)
    assert KERNELS[platform] in text
    assert all(kernel not in text for kernel in set(KERNELS.values()) - {KERNELS[platform]})
    assert not pool_reads(text, pool)
    assert pool_reads(exported_text(functools.partial(fn, False), args, platform), pool)


# ------------------------------------------------------------------ a tiny model, paged

CONFIG = ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def empty_pages(batch: int, dtype=jnp.float32) -> kv_cache.KVCache:
    """A paged cache whose rows hold WIDTH blocks each, in a shuffled order of a pool with
    two spare blocks; the last row is a free slot."""
    cache = kv_cache.init_paged_cache(CONFIG.num_layers, batch, batch * WIDTH + 2, BLOCK,
                                      WIDTH, CONFIG.num_kv_heads, CONFIG.head_dim, dtype)
    order = np.random.default_rng(0).permutation(batch * WIDTH + 2)[:(batch - 1) * WIDTH]
    return cache._replace(tables=cache.tables.at[:batch - 1].set(order.reshape(-1, WIDTH)))


@functools.partial(jax.jit, static_argnames="impl")
def step(params, tokens, cache, mask, *, impl):
    """Logits of tokens [B,T] after each row's cache under mask; the cache with them staged."""
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
    out = llama.forward(params, CONFIG, tokens, positions, cache, mask=mask, attn_impl=impl)
    return llama.lm_head(params, out.hidden), out.cache


def greedy_paged(params, prompts: jax.Array, ragged: jax.Array, impl: str):
    """Prefill prompts [B,P], keep each row's first ragged[b] positions, decode 5 tokens
    greedily, then verify a 4-node tree after them: (tokens [B,5], tree logits [B,4,V])."""
    batch, n_prompt = prompts.shape
    causal = llama.causal_mask(batch, 1)
    logits, cache = step(params, prompts, empty_pages(batch), llama.causal_mask(batch, n_prompt),
                         impl=impl)
    token = jnp.take_along_axis(logits.argmax(-1), ragged[:, None] - 1, axis=1)
    cache = cache._replace(lengths=ragged)
    tokens = []
    for _ in range(5):
        tokens.append(token)
        logits, cache = step(params, token, cache, causal, impl=impl)
        cache = cache._replace(lengths=cache.lengths + 1)
        token = logits.argmax(-1)
    tree = jnp.asarray(np.stack([tree_mask(np.random.default_rng(b), 4) for b in range(batch)]))
    tree_logits, _ = step(params, jnp.concatenate([token, prompts[:, :3]], axis=1), cache, tree,
                          impl=impl)
    return np.asarray(jnp.concatenate(tokens, axis=1)), np.asarray(tree_logits)


def test_paged_model_decodes_the_same_tokens_with_the_kernel():
    """A 2-layer random model over a paged cache (3 rows of ragged lengths, one crossing a
    block boundary while decoding, and a free slot): the paged kernel's greedy tokens and
    tree-verify logits are the XLA path's."""
    params = llama.init_params(CONFIG, jax.random.PRNGKey(0), scale=0.2)
    prompts = jax.random.randint(jax.random.PRNGKey(1), (4, 40), 0, CONFIG.vocab_size)
    ragged = jnp.asarray([40, 29, 7, 1], jnp.int32)
    want_tokens, want_logits = greedy_paged(params, prompts, ragged, "xla")
    got_tokens, got_logits = greedy_paged(params, prompts, ragged, "pallas")
    np.testing.assert_array_equal(got_tokens[:LIVE], want_tokens[:LIVE])
    assert_close_scaled(got_logits[:LIVE], want_logits[:LIVE], units=FORWARD_UNITS,
                        depth=CONFIG.num_layers)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_paged_forward_exports_without_gathering_the_pools(platform):
    """The tiny model's verify forward over a paged bfloat16 cache (as the engine traces it):
    each layer stages the new rows (a scatter) and the kernel reads the pools in place."""
    sds = jax.ShapeDtypeStruct
    params = jax.eval_shape(lambda: llama.init_params(CONFIG, jax.random.PRNGKey(0),
                                                      jnp.bfloat16))
    pool = sds((1000, CONFIG.num_kv_heads, BLOCK, CONFIG.head_dim), jnp.bfloat16)
    cache = kv_cache.KVCache((pool,) * CONFIG.num_layers, (pool,) * CONFIG.num_layers,
                             sds((4,), jnp.int32), sds((4, WIDTH), jnp.int32))
    args = (params, sds((4, 8), jnp.int32), cache, sds((4, 8, 8), jnp.bool_))
    text = exported_text(functools.partial(step.__wrapped__, impl="pallas"), args, platform)
    assert KERNELS[platform] in text  # once: the layers call one traced layer
    assert not pool_reads(text, pool)

