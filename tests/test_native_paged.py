"""The paged (block-table) native kernels of eaglejax.native.cache_attention and cache_rows:
bit for bit the contiguous kernels on the cache gathered through the tables, pools written
where a numpy loop writes and nowhere else, and the references (other platforms, gradients)
plumbed through; a table with two entries swapped fails the same checks."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from eaglejax.native import build, cache_attention, cache_rows
from tolerances import FORWARD_UNITS, assert_close_scaled, scaled_error

needs_compiler = pytest.mark.skipif(build.compiler() is None or not build.enabled(),
                                    reason="no C++ compiler here (or EAGLEJAX_NATIVE=0)")

WIDTH = 4  # table entries per row: a capacity of 4 blocks
SHAPES = [  # batch, new tokens, query heads, KV heads, head dim, block size
    (6, 1, 9, 3, 64, 32), (7, 6, 8, 2, 128, 16), (6, 16, 4, 4, 64, 16), (8, 3, 6, 1, 128, 32)]


class Case(NamedTuple):
    q: np.ndarray        # [B,T,Hq,D]
    k_pool: np.ndarray   # [N,Hkv,BS,D]
    v_pool: np.ndarray
    lengths: np.ndarray  # [B]
    tables: np.ndarray   # [B,WIDTH], N where a row has no block
    k_new: np.ndarray    # [B,T,Hkv,D]
    v_new: np.ndarray
    mask: np.ndarray     # [B,T,T]


def _case(batch, t_new, n_q, n_kv, d, bs, seed=0) -> Case:
    """Ragged lengths (empty, one short of, on and just past block boundaries, near and at
    the capacity, then random); each row holds the blocks its prefix needs and maybe one
    more, in a random order of the pool, which has two blocks no table points to."""
    rng = np.random.default_rng(seed)
    capacity = WIDTH * bs
    lengths = rng.permutation([0, bs - 1, bs, bs + 1, 2 * bs, capacity - 2, capacity])
    lengths = np.concatenate([lengths, rng.integers(0, capacity + 1, batch)])[:batch]
    held = np.minimum(-(-lengths // bs) + rng.integers(0, 2, batch), WIDTH)
    n = int(held.sum()) + 2
    order, tables = iter(rng.permutation(n)), np.full((batch, WIDTH), n)
    for b in range(batch):
        tables[b, :held[b]] = [next(order) for _ in range(held[b])]

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return Case(normal(batch, t_new, n_q, d), normal(n, n_kv, bs, d), normal(n, n_kv, bs, d),
                lengths.astype(np.int32), tables.astype(np.int32), normal(batch, t_new, n_kv, d),
                normal(batch, t_new, n_kv, d), rng.random((batch, t_new, t_new)) < 0.6)


def _swapped(case: Case) -> np.ndarray:
    """Negative control: case.tables with two rows' entries swapped, of the blocks that hold
    their last cached position and their first new one."""
    bs = case.k_pool.shape[2]
    rows = np.flatnonzero((case.lengths % bs != 0) & (case.lengths < WIDTH * bs))[:2]
    entries = (rows, (case.lengths[rows] - 1) // bs)
    out = case.tables.copy()
    out[entries] = case.tables[entries][::-1]
    return out


def _gather(pool, tables, fill=0.0) -> jax.Array:
    """The contiguous cache [B,H,W*BS,D] read through tables [B,W] from pool [N,H,BS,D],
    `fill` where an entry has no block."""
    blocks = jnp.asarray(pool).at[jnp.asarray(tables)].get(mode="fill", fill_value=fill)
    batch, width, heads, bs, d = blocks.shape
    return jnp.swapaxes(blocks, 1, 2).reshape(batch, heads, width * bs, d)


def _scatter(pool, tables, lengths, new, keep=None) -> jax.Array:
    """pool with new[b, t] ([B,T,H,D]) at position lengths[b] + t of row b through tables,
    where keep[b, t] (default all), within the capacity and through an existing block."""
    n, _, bs, _ = pool.shape
    positions = lengths[:, None] + jnp.arange(new.shape[1])
    inside = positions < tables.shape[1] * bs
    block = jnp.take_along_axis(tables, jnp.where(inside, positions // bs, 0), axis=1)
    kept = inside & (block >= 0) & (block < n) & (True if keep is None else keep)
    return jnp.asarray(pool).at[jnp.where(kept, block, n), :, positions % bs].set(new, mode="drop")


def _written(pool, tables, lengths, new, keep=None) -> np.ndarray:
    """The oracle of `_scatter`, position by position."""
    out = np.array(pool, copy=True)
    n, _, bs, _ = out.shape
    for b, t in np.ndindex(*new.shape[:2]):
        at = lengths[b] + t
        if ((keep is None or keep[b, t]) and at < tables.shape[1] * bs
                and 0 <= tables[b, at // bs] < n):
            out[tables[b, at // bs], :, at % bs] = new[b, t]
    return out


_attention_reference = functools.partial(pallas_kernels.tree_attention_reference,
                                         kv_layout="bhsd")


@jax.jit
def _paged_reference(q, k_pool, v_pool, lengths, tables, k_new, v_new, mask):
    return _attention_reference(q, _gather(k_pool, tables), _gather(v_pool, tables), lengths,
                                k_new, v_new, mask)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    turned = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None] + turned * sin[:, :, None]


@jax.jit
def _paged_rope_reference(qkv, cos, sin, k_pool, v_pool, lengths, tables, mask):
    batch, t_new, _, _, d = qkv.shape
    q = _rotate(qkv[:, :, :, :-2].reshape(batch, t_new, -1, d), cos, sin)
    k, v = _rotate(qkv[:, :, :, -2], cos, sin), qkv[:, :, :, -1]
    k_pool, v_pool = _scatter(k_pool, tables, lengths, k), _scatter(v_pool, tables, lengths, v)
    return _paged_reference(q, k_pool, v_pool, lengths, tables, k, v, mask), k_pool, v_pool, k, v


def _rope_reference(qkv, cos, sin, k_cache, v_cache, lengths, mask):
    """The contiguous cache as pools of one block per row, tables [[0], [1], ...]."""
    tables = jnp.arange(qkv.shape[0])[:, None]
    return _paged_rope_reference(qkv, cos, sin, k_cache, v_cache, lengths, tables, mask)


@jax.jit
def _rows_reference(picks, lengths, tables, buffers, rows):
    keep = (picks >= 0) & (picks < rows[0].shape[1])
    return tuple(_scatter(pool, tables, lengths,
                          jnp.take_along_axis(new, jnp.clip(picks, 0)[:, :, None, None], 1), keep)
                 for pool, new in zip(buffers, rows))


paged_attention = jax.jit(functools.partial(cache_attention.paged_attention,
                                            reference=_paged_reference))
contiguous_attention = jax.jit(functools.partial(cache_attention.attention,
                                                 reference=_attention_reference))
paged_rope = jax.jit(functools.partial(cache_attention.paged_rope_attention,
                                       reference=_paged_rope_reference))
contiguous_rope = jax.jit(functools.partial(cache_attention.rope_attention,
                                            reference=_rope_reference))
paged_rows = jax.jit(functools.partial(cache_rows.write_paged, reference=_rows_reference))


@needs_compiler
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_paged_attention_is_the_contiguous_kernel_on_the_gathered_cache(shape):
    """Bit for bit (the same keys in the same order; positions without a block are NaN in
    the gathered cache, so reading one would show), and within float32 noise of the
    reference; a swapped table is thousands of units off."""
    case = _case(*shape)
    assert cache_attention.applies(jnp.asarray(case.q), jnp.asarray(case.k_pool))
    got = np.asarray(paged_attention(*case))
    gathered = (_gather(case.k_pool, case.tables, np.nan), _gather(case.v_pool, case.tables, np.nan))
    want = contiguous_attention(case.q, *gathered, case.lengths, *case[5:])
    np.testing.assert_array_equal(got, np.asarray(want))
    reference = np.asarray(_paged_reference(*case))
    assert_close_scaled(got, reference, units=FORWARD_UNITS, what="paged attention")
    swapped = case._replace(tables=_swapped(case))
    assert scaled_error(paged_attention(*swapped), reference) > 100 * FORWARD_UNITS


@needs_compiler
def test_a_row_reads_up_to_its_first_missing_block():
    """A full row whose third entry has no block reads as the row of two blocks."""
    case = _case(*SHAPES[0], seed=1)
    row = int(np.argmax(case.lengths))  # the capacity: four blocks
    tables, lengths = case.tables.copy(), case.lengths.copy()
    tables[row, 2], lengths[row] = len(case.k_pool), 2 * case.k_pool.shape[2]
    cut = np.asarray(paged_attention(*case._replace(tables=tables)))
    np.testing.assert_array_equal(cut, paged_attention(*case._replace(lengths=lengths)))


def _rope_operands(case: Case):
    """qkv [B,T,Hkv,G+2,D] and cos/sin [B,T,D] of random angles, from a case's shapes."""
    rng = np.random.default_rng(len(case.q))
    batch, t_new, n_q, d = case.q.shape
    n_kv = case.k_pool.shape[1]
    qkv = rng.standard_normal((batch, t_new, n_kv, n_q // n_kv + 2, d)).astype(np.float32)
    angles = np.tile(rng.uniform(0, 2 * np.pi, (batch, t_new, d // 2)), 2)
    return qkv, np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@needs_compiler
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_paged_rope_attention_writes_through_the_tables(shape):
    """Outputs bit for bit the contiguous kernel's on the gathered cache; each pool gets the
    new rows at lengths[b] + t through the tables (dropped past the capacity and where a
    row has no block) and keeps every other value, the blocks of no table included."""
    case = _case(*shape)
    qkv, cos, sin = _rope_operands(case)
    assert cache_attention.rope_applies(jnp.asarray(qkv), jnp.asarray(case.k_pool))
    args = (qkv, cos, sin, case.k_pool, case.v_pool, case.lengths, case.tables, case.mask)
    out, k_pool, v_pool, k_new, v_new = map(np.asarray, paged_rope(*args))
    gathered = (_gather(case.k_pool, case.tables, np.nan), _gather(case.v_pool, case.tables, np.nan))
    want = contiguous_rope(qkv, cos, sin, *gathered, case.lengths, case.mask)
    for got, expected in zip((out, k_new, v_new), (want[0], want[3], want[4])):
        np.testing.assert_array_equal(got, np.asarray(expected))
    np.testing.assert_array_equal(k_pool, _written(case.k_pool, case.tables, case.lengths, k_new))
    np.testing.assert_array_equal(v_pool, _written(case.v_pool, case.tables, case.lengths, v_new))
    assert not np.array_equal(k_pool, case.k_pool)
    reference = _paged_rope_reference(*map(jnp.asarray, args))
    for got, expected, what in zip((out, k_pool, v_pool, k_new), reference, ("out", "k pool",
                                                                          "v pool", "k new")):
        assert_close_scaled(got, expected, units=FORWARD_UNITS, what=what)
    swapped = paged_rope(*args[:6], _swapped(case), case.mask)
    assert scaled_error(swapped[0], reference[0]) > 100 * FORWARD_UNITS
    assert not np.array_equal(swapped[1], k_pool)


@needs_compiler
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_cache_rows_land_through_the_tables(dtype):
    """Every buffer gets rows picks[b, p] at lengths[b] + p through the tables; picks outside
    [0, N), positions past the capacity or without a block write nothing."""
    batch, count = 6, 6  # rows, new rows of each
    case = _case(batch, count, 4, 2, 64, 16, seed=2)
    rng = np.random.default_rng(3)
    picks = rng.integers(-1, count + 1, (batch, 4)).astype(np.int32)  # -1 and count: none
    _, n_kv, _, d = case.k_pool.shape
    buffers = tuple(jnp.asarray(rng.standard_normal(case.k_pool.shape), dtype) for _ in range(4))
    rows = tuple(jnp.asarray(rng.standard_normal((batch, count, n_kv, d)), dtype)
                 for _ in range(4))
    assert cache_rows.applies(buffers, rows)
    got = paged_rows(buffers, rows, picks, case.lengths, case.tables)
    keep = (picks >= 0) & (picks < count)
    reference = _rows_reference(picks, case.lengths, case.tables, buffers, rows)
    for out, pool, new, ref in zip(got, buffers, rows, reference):
        chosen = np.asarray(new)[np.arange(batch)[:, None], np.clip(picks, 0, count - 1)]
        want = _written(np.asarray(pool), case.tables, case.lengths, chosen, keep)
        np.testing.assert_array_equal(np.asarray(out), want)
        np.testing.assert_array_equal(np.asarray(ref), want)
    swapped = paged_rows(buffers, rows, picks, case.lengths, _swapped(case))
    assert not np.array_equal(np.asarray(swapped[0]), np.asarray(got[0]))


@needs_compiler
def test_the_references_serve_other_platforms_and_gradients():
    """Exports for GPUs trace the references given (no kernel in them), and gradients are
    the references' (run here, on CPU)."""
    case = _case(*SHAPES[1], seed=4)
    qkv, cos, sin = _rope_operands(case)
    rope_args = (qkv, cos, sin, case.k_pool, case.v_pool, case.lengths, case.tables, case.mask)
    rows_args = ((case.k_pool,), (case.k_new,), case.lengths[:, None] % 3, case.lengths,
                 case.tables)
    for run, args, target in [(paged_attention, case, cache_attention.PAGED_TARGET),
                              (paged_rope, rope_args, cache_attention.PAGED_ROPE_TARGET),
                              (paged_rows, rows_args, cache_rows.PAGED_TARGET)]:
        assert target in run.lower(*args).as_text()
        text = jax.export.export(run, platforms=["cuda"])(*args).mlir_module()
        assert target not in text and "gather" in text

    def loss(attend, q):
        return jnp.sum(attend(q, *case[1:]) ** 2)

    got = jax.jit(jax.grad(functools.partial(loss, paged_attention)))(case.q)
    want = jax.jit(jax.grad(functools.partial(loss, _paged_reference)))(case.q)
    assert_close_scaled(got, want, units=FORWARD_UNITS, what="paged attention gradient")

    def rope_loss(attend, qkv):
        out, k_pool, _, _, v_new = attend(qkv, *rope_args[1:])
        return jnp.sum(out ** 2) + jnp.sum(k_pool ** 2) + jnp.sum(v_new)

    got = jax.jit(jax.grad(functools.partial(rope_loss, paged_rope)))(qkv)
    want = jax.jit(jax.grad(functools.partial(rope_loss, _paged_rope_reference)))(qkv)
    assert_close_scaled(got, want, units=FORWARD_UNITS, what="paged rope gradient")
