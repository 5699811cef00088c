"""Paged attention: the XLA reference against a dense float64 oracle over the gathered
contiguous caches, the Pallas kernels (interpret mode on CPU) against the reference on
ragged block tables, token-major and head-major pools, garbage in unused blocks, the pool
write, and lowering for cuda / tpu."""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import BF16_UNITS, FORWARD_UNITS, assert_close_scaled

from pallas_kernels import (
    paged_attention,
    paged_attention_reference,
    tree_attention_reference,
    write_paged_kv,
)

ON_GPU = jax.default_backend() == "gpu"
reference = jax.jit(paged_attention_reference, static_argnames=("scale", "pool_layout"))


class Paged(NamedTuple):
    q: jax.Array
    k_pool: jax.Array
    v_pool: jax.Array
    tables: jax.Array
    lengths: jax.Array
    mask: jax.Array


def tree_mask(rng: np.random.Generator, t_new: int) -> np.ndarray:
    """Ancestor-or-self mask of a random tree whose nodes are in topological order."""
    parent = [-1] + [int(rng.integers(0, j)) for j in range(1, t_new)]
    mask = np.zeros((t_new, t_new), bool)
    for t in range(t_new):
        j = t
        while j >= 0:
            mask[t, j], j = True, parent[j]
    return mask


def make_paged(seed: int, batch: int, t_new: int, n_q: int, n_kv: int, head_dim: int,
               block_size: int, max_blocks: int, dtype=jnp.float32,
               garbage: bool = False) -> Paged:
    """A scrambled pool with spare blocks and ragged rows: row 0 has no context, the last
    row fills its table. ``garbage``: every block no row uses, every slot at or past a
    row's ctx + T holds NaN or inf; unused table entries name random blocks, the first of
    each row an out-of-range one."""
    rng = np.random.default_rng(seed)
    span = max_blocks * block_size
    lengths = rng.integers(0, span - t_new + 1, size=batch)
    lengths[0] = 0
    if batch > 1:
        lengths[-1] = span - t_new
    num_blocks = batch * max_blocks + 3
    tables = rng.permutation(num_blocks)[:batch * max_blocks].reshape(batch, max_blocks)
    k_pool = rng.normal(size=(num_blocks, block_size, n_kv, head_dim))
    v_pool = rng.normal(size=(num_blocks, block_size, n_kv, head_dim))
    q = rng.normal(size=(batch, t_new, n_q, head_dim))
    mask = np.stack([tree_mask(rng, t_new) for _ in range(batch)])
    if garbage:  # its own draws: the same seed gives the same clean inputs either way
        rng = np.random.default_rng(seed + 1)
        used = set()
        for b in range(batch):
            end = lengths[b] + t_new
            n_used = -(-end // block_size)
            used.update(tables[b, :n_used].tolist())
            last = tables[b, n_used - 1]
            k_pool[last, end - (n_used - 1) * block_size:] = np.nan
            v_pool[last, end - (n_used - 1) * block_size:] = np.inf
            tables[b, n_used:] = rng.integers(0, num_blocks, size=max_blocks - n_used)
            tables[b, n_used:n_used + 1] = num_blocks + 5
        unused = [i for i in range(num_blocks) if i not in used]
        k_pool[unused], v_pool[unused] = np.inf, np.nan
    return Paged(jnp.asarray(q, dtype),
                 jnp.asarray(k_pool, dtype), jnp.asarray(v_pool, dtype),
                 jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32),
                 jnp.asarray(mask))


def gathered(paged: Paged) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each row's contiguous K/V [ctx + T, Hkv, D] (float64), read slot by slot through its
    table: the oracle's independent path to the cache."""
    block_size = paged.k_pool.shape[1]
    k_pool, v_pool = (np.asarray(x, np.float64) for x in (paged.k_pool, paged.v_pool))
    rows = []
    for b, ctx in enumerate(np.asarray(paged.lengths)):
        blocks = [int(paged.tables[b, p // block_size]) for p in range(ctx + paged.q.shape[1])]
        slots = [p % block_size for p in range(len(blocks))]
        rows.append((k_pool[blocks, slots], v_pool[blocks, slots]))
    return rows


def dense_oracle(paged: Paged) -> np.ndarray:
    """float64 attention over the gathered caches: query t of row b sees positions < ctx
    and the new token j at ctx + j iff mask[b, t, j]."""
    q = np.asarray(paged.q, np.float64)
    _, t_new, n_q, head_dim = q.shape
    out = np.zeros_like(q)
    for b, (keys, values) in enumerate(gathered(paged)):
        ctx = len(keys) - t_new
        group = n_q // keys.shape[1]
        for t in range(t_new):
            seen = np.concatenate([np.ones(ctx, bool), np.asarray(paged.mask[b, t])])
            for h in range(n_q):
                logits = keys[seen, h // group] @ q[b, t, h] * head_dim**-0.5
                weights = np.exp(logits - logits.max())
                out[b, t, h] = weights / weights.sum() @ values[seen, h // group]
    return out


def head_major(paged: Paged) -> Paged:
    """The same pools laid out head-major, [num_blocks, Hkv, block_size, D] (the engine's)."""
    return paged._replace(k_pool=jnp.swapaxes(paged.k_pool, 1, 2),
                          v_pool=jnp.swapaxes(paged.v_pool, 1, 2))


def in_layout(paged: Paged, pool_layout: str) -> Paged:
    return head_major(paged) if pool_layout == "head_major" else paged


def f32_reference(paged: Paged) -> jax.Array:
    """The reference on float32 inputs, in q's dtype: the oracle of the bfloat16 kernels."""
    up = Paged(*(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
                 for x in paged))
    with jax.default_matmul_precision("highest"):
        return reference(*up).astype(paged.q.dtype)


def assert_close(out: jax.Array, ref: jax.Array) -> None:
    """Kernel vs reference within one attention call's rounding noise of ``out``'s dtype."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref, dtype = np.asarray(out, np.float32), np.asarray(ref, np.float32), out.dtype
    if dtype == jnp.float32:
        assert_close_scaled(out, ref, units=FORWARD_UNITS)
    else:
        assert_close_scaled(out, ref, units=BF16_UNITS, dtype=dtype)


# ------------------------------------------------------------------ reference vs oracle


@pytest.mark.parametrize("pool_layout", ["token_major", "head_major"])
@pytest.mark.parametrize("t_new", [1, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reference_matches_dense_oracle(t_new, block_size, pool_layout):
    """GQA, ragged rows, and garbage where no row may look (the reference never sees it)."""
    paged = make_paged(block_size + t_new, batch=3, t_new=t_new, n_q=6, n_kv=2, head_dim=16,
                       block_size=block_size, max_blocks=3, garbage=True)
    got = reference(*in_layout(paged, pool_layout), pool_layout=pool_layout)
    assert_close_scaled(got, dense_oracle(paged), units=FORWARD_UNITS)


def test_write_attend_commit_roundtrip():
    """A verify round as documented in paged_kv: write the tree block at ctx, attend (equal
    to tree attention over the gathered contiguous context plus the block), commit the
    accepted path at ctx with n_valid, and the next step sees exactly context + path."""
    paged = make_paged(11, batch=3, t_new=8, n_q=4, n_kv=2, head_dim=16, block_size=16,
                       max_blocks=4)
    rng = np.random.default_rng(0)
    k_new, v_new = (jnp.asarray(rng.normal(size=(3, 8, 2, 16)), jnp.float32) for _ in "kv")
    k_pool, v_pool = write_paged_kv(paged.k_pool, paged.v_pool, paged.tables, paged.lengths,
                                    k_new, v_new)
    out = reference(paged.q, k_pool, v_pool, paged.tables, paged.lengths, paged.mask)
    ctx_k = [k[:len(k) - 8] for k, _ in gathered(paged)]
    ctx_v = [v[:len(v) - 8] for _, v in gathered(paged)]
    span = max(map(len, ctx_k)) + 1
    dense = [np.stack([np.pad(c, ((0, span - len(c)), (0, 0), (0, 0))) for c in cs])
             for cs in (ctx_k, ctx_v)]
    expected = jax.jit(tree_attention_reference)(paged.q, *dense, paged.lengths, k_new, v_new,
                                                 paged.mask)
    assert_close_scaled(out, expected, units=FORWARD_UNITS)

    picks = jnp.asarray([[0, 2, 5, 7, 0, 0, 0, 0]] * 3, jnp.int32)
    accepted = jnp.asarray([1, 3, 4], jnp.int32)
    take = functools.partial(jnp.take_along_axis, indices=picks[:, :, None, None], axis=1)
    k_pool, v_pool = write_paged_kv(k_pool, v_pool, paged.tables, paged.lengths, take(k_new),
                                    take(v_new), n_valid=accepted)
    step = Paged(paged.q[:, :1], k_pool, v_pool, paged.tables, paged.lengths + accepted,
                 paged.mask[:, :1, :1])
    for b, (keys, _) in enumerate(gathered(step)):
        n_ctx = int(paged.lengths[b])
        np.testing.assert_array_equal(keys[:n_ctx], ctx_k[b])
        np.testing.assert_array_equal(keys[n_ctx:-1], np.asarray(take(k_new))[b, :accepted[b]])
    assert_close_scaled(reference(*step), dense_oracle(step), units=FORWARD_UNITS)


def test_write_drops_past_the_table_and_n_valid():
    """Tokens past n_valid or past the table touch no block; the rest land where the table
    says."""
    paged = make_paged(2, batch=2, t_new=4, n_q=2, n_kv=1, head_dim=16, block_size=16,
                       max_blocks=2)
    new = jnp.full((2, 4, 1, 16), 7.0, jnp.float32)
    start = jnp.asarray([30, 5], jnp.int32)  # row 0: positions 30, 31 fit, 32, 33 do not
    k_pool, _ = write_paged_kv(paged.k_pool, paged.v_pool, paged.tables, start, new, new,
                               n_valid=jnp.asarray([4, 3], jnp.int32))
    expected = np.asarray(paged.k_pool).copy()
    tables = np.asarray(paged.tables)
    for b, pos in [(0, 30), (0, 31), (1, 5), (1, 6), (1, 7)]:
        expected[tables[b, pos // 16], pos % 16] = 7.0
    np.testing.assert_array_equal(np.asarray(k_pool), expected)


# ---------------------------------------------------------------------- kernel parity

# (B, T, Hq, Hkv, D, block_size, max_blocks, dtype, num_splits / pages_per_step)
CASES = [
    (3, 1, 8, 2, 64, 16, 5, jnp.float32, None),
    (3, 8, 4, 1, 128, 32, 3, jnp.float32, 2),
    (2, 8, 12, 4, 64, 16, 4, jnp.bfloat16, None),  # TPU: 2 heads per program
    (2, 1, 4, 2, 128, 32, 3, jnp.bfloat16, 2),
]


def _case_id(case) -> str:
    b, t, hq, hkv, d, bs, mb, dtype, _ = case
    return f"B{b}-T{t}-Hq{hq}-Hkv{hkv}-D{d}-bs{bs}-mb{mb}-{jnp.dtype(dtype).name}"


def _run(paged: Paged, backend: str, tuning: int | None,
         pool_layout: str = "token_major") -> jax.Array:
    knob = {"num_splits": tuning} if backend == "gpu" else {"pages_per_step": tuning}
    return paged_attention(*paged, backend=backend, interpret=not (ON_GPU and backend == "gpu"),
                           pool_layout=pool_layout, **knob)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_reference(case, backend):
    b, t, hq, hkv, d, bs, mb, dtype, tuning = case
    paged = make_paged(bs * t + hq, b, t, hq, hkv, d, bs, mb, dtype)
    assert_close(_run(paged, backend, tuning), f32_reference(paged))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_head_major_pool_matches_token_major(case, backend):
    """The engine's head-major pools, read in place: the token-major kernel's output and
    the reference's, which is the same for both layouts."""
    b, t, hq, hkv, d, bs, mb, dtype, tuning = case
    paged = make_paged(bs * t + hq, b, t, hq, hkv, d, bs, mb, dtype, garbage=True)
    out = _run(head_major(paged), backend, tuning, "head_major")
    assert_close(out, _run(paged, backend, tuning))
    assert_close(out, f32_reference(paged))


@pytest.mark.parametrize("pool_layout", ["token_major", "head_major"])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_garbage_in_unused_blocks_changes_nothing(backend, pool_layout):
    """NaN/inf in unused blocks and stale slots, out-of-range ids in unused table entries:
    the output is bit for bit the one over a clean pool (the TPU interpreter also raises on
    any out-of-bounds read, and fills fresh VMEM with NaN)."""
    clean = make_paged(5, 3, 8, 8, 2, 64, 16, 4)
    dirty = make_paged(5, 3, 8, 8, 2, 64, 16, 4, garbage=True)
    used = jnp.arange(4)[None] * 16 < (clean.lengths + 8)[:, None]
    assert np.all(np.asarray(jnp.where(used, clean.tables == dirty.tables, True)))
    out = _run(in_layout(dirty, pool_layout), backend, 2, pool_layout)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_array_equal(
        np.asarray(out), np.asarray(_run(in_layout(clean, pool_layout), backend, 2, pool_layout)))


@settings(max_examples=3, deadline=None, derandomize=True)
@given(
    batch=st.integers(1, 3),
    t_new=st.sampled_from([1, 3, 8]),
    group=st.sampled_from([1, 2, 4]),
    n_kv=st.integers(1, 2),
    block_size=st.sampled_from([16, 32]),
    max_blocks=st.integers(1, 4),
    backend=st.sampled_from(["gpu", "tpu"]),
    pool_layout=st.sampled_from(["token_major", "head_major"]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(batch, t_new, group, n_kv, block_size, max_blocks, backend, pool_layout,
                       seed):
    paged = make_paged(seed, batch, t_new, group * n_kv, n_kv, 64, block_size, max_blocks,
                       garbage=True)
    assert_close(_run(in_layout(paged, pool_layout), backend, None, pool_layout),
                 reference(*paged))


# --------------------------------------------------------------------- API and lowering


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only error path")
def test_cpu_without_interpret_raises():
    with pytest.raises(ValueError, match="interpret=True"):
        paged_attention(*make_paged(0, 1, 1, 2, 1, 16, 16, 1))


def test_bad_shapes_raise():
    q, kp, vp, tables, lengths, mask = make_paged(0, 2, 3, 4, 2, 16, 16, 2)
    run = functools.partial(paged_attention, interpret=True)
    with pytest.raises(ValueError, match="mask"):
        run(q, kp, vp, tables, lengths, mask[:, :2])
    with pytest.raises(ValueError, match="multiple"):
        run(q[:, :, :3], kp, vp, tables, lengths, mask)
    with pytest.raises(ValueError, match="block_size"):
        run(q, kp[:, :12], vp[:, :12], tables, lengths, mask)
    with pytest.raises(ValueError, match="block_tables"):
        run(q, kp, vp, tables[0], lengths, mask)
    # A head-major pool [num_blocks, Hkv, block_size, D] reads Hkv=2 as the block size.
    kh, vh = jnp.swapaxes(kp, 1, 2), jnp.swapaxes(vp, 1, 2)
    with pytest.raises(ValueError, match="block_size"):
        run(q, kh, vh, tables, lengths, mask)
    with pytest.raises(ValueError, match="block_size"):  # and a token-major one as head-major
        run(q, kp, vp, tables, lengths, mask, pool_layout="head_major")
    with pytest.raises(ValueError, match="pool_layout"):
        run(q, kh, vh, tables, lengths, mask, pool_layout="bhsd")


@pytest.mark.parametrize(
    "platform,backend,module",
    [("cuda", "gpu", "jax._src.lib.triton"), ("tpu", "tpu", "jax._src.tpu_custom_call")],
)
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (64, 32)])
@pytest.mark.parametrize("pool_layout", ["token_major", "head_major"])
def test_kernel_lowers_for_accelerator(platform, backend, module, head_dim, block_size,
                                       pool_layout):
    """Cross-lower the compiled kernels from this host (Llama-3.1-8B heads, ragged rows of a
    1,000-block pool): Pallas lowering errors of the Triton / Mosaic paths show without the
    hardware, and the pool reaches the kernel as is (no gather, copy or pad of it)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not available in this jaxlib")
    sds = jax.ShapeDtypeStruct
    page = (block_size, 8) if pool_layout == "token_major" else (8, block_size)
    batch, t_new, pool = 4, 8, sds((1000, *page, head_dim), jnp.bfloat16)
    inputs = (sds((batch, t_new, 32, head_dim), jnp.bfloat16), pool, pool,
              sds((batch, 63), jnp.int32), sds((batch,), jnp.int32),
              sds((batch, t_new, t_new), jnp.bool_))
    fn = functools.partial(paged_attention, backend=backend, pool_layout=pool_layout)
    text = jax.jit(fn).trace(*inputs).lower(lowering_platforms=(platform,)).as_text()
    assert ("triton" if backend == "gpu" else "tpu_custom_call") in text
    pool_type = "tensor<" + "x".join(map(str, pool.shape)) + "xbf16>"
    for op in ("transpose", "pad", "concatenate", "copy", "dynamic_slice", "gather"):
        offending = [line for line in text.splitlines()
                     if f"stablehlo.{op}" in line and pool_type in line]
        assert not offending, offending


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_kernel_on_accelerator(dtype):
    paged = make_paged(5, 4, 8, 32, 8, 128, 16, 40, dtype, garbage=True)
    assert_close(paged_attention(*paged), f32_reference(paged))
