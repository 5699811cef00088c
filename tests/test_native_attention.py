"""The native cache attention (eaglejax.native.cache_attention) against a float64 oracle,
its independence of the number of queries (a verify block reproduces the decode step bit
for bit), its gradient and its dispatch (CPU only; exports for GPU/TPU keep the reference)."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from eaglejax import native
from eaglejax.models import kv_cache
from eaglejax.models.attention import attention
from eaglejax.native import build, cache_attention
from tolerances import FORWARD_UNITS, assert_close_scaled, scaled_error

needs_compiler = pytest.mark.skipif(build.compiler() is None or not build.enabled(),
                                    reason="no C++ compiler here (or EAGLEJAX_NATIVE=0): "
                                           "the XLA reference is used, which the other tests cover")
reference = functools.partial(pallas_kernels.tree_attention_reference, kv_layout="bhsd")

# Outputs are softmax-weighted means of values of size ~1: one attention call, float32 noise
# of tolerances.FORWARD_UNITS. Float32 dot products over D <= 128 terms and sums over <= 300
# keys, plus the kernel's exp polynomial (relative error 2e-7), measured 1.7e-6 at most
# against float64 (XLA's reference: 1.6e-6, both at D=128), about 4 units of outputs up to
# ~3.5. Dropping one key moves outputs by ~1e-2, thousands of units (checked below); a wrong
# head mapping by ~1.


def _oracle(q, k_cache, v_cache, lengths, k_new, v_new, mask) -> np.ndarray:
    """Float64 attention written out key by key."""
    q, k_cache, v_cache, k_new, v_new = (np.asarray(a, np.float64)
                                         for a in (q, k_cache, v_cache, k_new, v_new))
    batch, t_new, n_q, d = q.shape
    group = n_q // k_cache.shape[1]
    out = np.zeros_like(q)
    for b in range(batch):
        for t in range(t_new):
            for head in range(n_q):
                kv = head // group
                keys = [k_cache[b, kv, s] for s in range(lengths[b])]
                values = [v_cache[b, kv, s] for s in range(lengths[b])]
                keys += [k_new[b, j, kv] for j in range(t_new) if mask[b, t, j]]
                values += [v_new[b, j, kv] for j in range(t_new) if mask[b, t, j]]
                if not keys:
                    continue
                scores = np.array(keys) @ q[b, t, head] / np.sqrt(d)
                weights = np.exp(scores - scores.max())
                out[b, t, head] = weights @ np.array(values) / weights.sum()
    return out


def _operands(batch, t_new, n_q, n_kv, capacity, d, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    lengths = rng.integers(1, capacity + 1, batch)
    lengths[0] = capacity  # a full cache
    mask = rng.random((batch, t_new, t_new)) < 0.6
    if batch > 1:  # the last row's first query sees nothing at all: zeros
        lengths[-1] = 0
        mask[-1, 0] = False
    return (normal(batch, t_new, n_q, d), normal(batch, n_kv, capacity, d),
            normal(batch, n_kv, capacity, d), jnp.asarray(lengths, jnp.int32),
            normal(batch, t_new, n_kv, d), normal(batch, t_new, n_kv, d), jnp.asarray(mask))


@needs_compiler
@pytest.mark.parametrize("batch,t_new,n_q,n_kv,capacity,d", [
    (1, 1, 9, 3, 40, 64), (3, 6, 9, 3, 200, 64), (2, 16, 8, 2, 70, 128),
    (4, 1, 4, 4, 300, 32), (2, 5, 6, 1, 33, 16)])
def test_attention_matches_float64(batch, t_new, n_q, n_kv, capacity, d):
    args = _operands(batch, t_new, n_q, n_kv, capacity, d)
    assert cache_attention.applies(args[0], args[1])
    got = np.asarray(jax.jit(attention)(*args))
    want = _oracle(*args)
    assert_close_scaled(got, want, units=FORWARD_UNITS, what="native attention")
    assert batch == 1 or not got[-1, 0].any()  # a query that sees nothing gets zeros
    # The same bound catches a dropped key (negative control).
    fewer = (*args[:3], args[3] - (args[3] > 0), *args[4:])
    assert scaled_error(jax.jit(attention)(*fewer), want) > 100 * FORWARD_UNITS


@needs_compiler
def test_a_verify_block_reproduces_the_decode_steps():
    """Six causal queries at once give bit for bit what six single-token steps give, each
    step first writing the previous token into the cache."""
    q, k_cache, v_cache, _, k_new, v_new, _ = _operands(2, 6, 9, 3, 128, 64, seed=1)
    lengths = jnp.asarray([50, 70], jnp.int32)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((6, 6), bool)), (2, 6, 6))
    run = jax.jit(attention)
    block = np.asarray(run(q, k_cache, v_cache, lengths, k_new, v_new, causal))
    for t in range(6):
        step = run(q[:, t:t + 1], k_cache, v_cache, lengths + t, k_new[:, t:t + 1],
                   v_new[:, t:t + 1], jnp.ones((2, 1, 1), bool))
        np.testing.assert_array_equal(np.asarray(step)[:, 0], block[:, t])
        slots = lengths + t
        k_cache = k_cache.at[jnp.arange(2), :, slots].set(k_new[:, t])
        v_cache = v_cache.at[jnp.arange(2), :, slots].set(v_new[:, t])


@needs_compiler
@pytest.mark.parametrize("kernels", [True, False], ids=["native", "xla"])
def test_a_cache_of_more_rows_is_read_for_the_first_rows(kernels):
    """A serving batch runs its first B slots over the whole slot cache (no copy of those
    rows): the same result as the B rows' own cache, bit for bit, on the native path and on
    the XLA path (which slices); rows past B may hold anything."""
    q, k_cache, v_cache, lengths, k_new, v_new, mask = _operands(5, 4, 9, 3, 90, 64, seed=2)
    own = (q[:3], k_cache[:3], v_cache[:3], lengths[:3], k_new[:3], v_new[:3], mask[:3])
    garbage = k_cache.at[3:].set(jnp.nan), v_cache.at[3:].set(jnp.inf)
    with contextlib.nullcontext() if kernels else native.xla_only():
        assert cache_attention.applies(q, k_cache) == kernels
        want = np.asarray(jax.jit(lambda *a: attention(*a))(*own))  # fresh: traced here
        got = np.asarray(jax.jit(lambda *a: attention(*a))(own[0], *garbage, *own[3:]))
    np.testing.assert_array_equal(got, want)
    assert_close_scaled(got, _oracle(*own), units=FORWARD_UNITS, what="first rows")


def test_new_rows_go_to_the_first_rows_of_a_larger_cache():
    """`write_block` of B rows into a cache of more: those rows get them at their own
    positions (past the capacity dropped), the other rows keep what they held."""
    rng = np.random.default_rng(3)
    buffer = jnp.asarray(rng.standard_normal((5, 3, 20, 16)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((2, 4, 3, 16)), jnp.float32)
    start = jnp.asarray([7, 18], jnp.int32)
    got = np.asarray(jax.jit(kv_cache.write_block)(buffer, new, start))
    want = np.asarray(buffer).copy()
    want[0, :, 7:11] = np.swapaxes(np.asarray(new[0]), 0, 1)
    want[1, :, 18:20] = np.swapaxes(np.asarray(new[1, :2]), 0, 1)
    np.testing.assert_array_equal(got, want)


@needs_compiler
def test_gradient_is_the_references():
    args = _operands(2, 4, 6, 2, 30, 32, seed=2)

    def loss(fn, q, k_new):
        return jnp.sum(fn(q, *args[1:4], k_new, *args[5:]) ** 2)

    got = jax.grad(functools.partial(loss, attention), argnums=(0, 1))(args[0], args[4])
    want = jax.grad(functools.partial(loss, reference), argnums=(0, 1))(args[0], args[4])
    for g, w in zip(got, want):  # one attention call and its transpose: depth 1
        assert_close_scaled(g, w, units=FORWARD_UNITS, what="gradient")
    # Negative control: the gradient with one key dropped fails the same check.
    fewer = (*args[1:3], args[3] - (args[3] > 0))
    dropped = jax.grad(lambda q: jnp.sum(attention(q, *fewer, *args[4:]) ** 2))(args[0])
    assert scaled_error(dropped, want[0]) > 100 * FORWARD_UNITS


def test_dispatch_rules():
    q, cache = jnp.zeros((1, 6, 9, 64)), jnp.zeros((1, 3, 32, 64))
    assert cache_attention.applies(q, cache) == cache_attention.available()
    assert not cache_attention.applies(jnp.zeros((1, 17, 9, 64)), cache)  # a prefill block
    assert not cache_attention.applies(q.astype(jnp.bfloat16), cache)
    assert not cache_attention.applies(q, cache.astype(jnp.bfloat16))
    assert not cache_attention.applies(jnp.zeros((1, 6, 9, 40)), jnp.zeros((1, 3, 32, 40)))
    with native.xla_only():
        assert not cache_attention.applies(q, cache)


def test_exports_for_accelerators_keep_the_reference():
    args = _operands(1, 6, 9, 3, 32, 64)
    run = jax.jit(functools.partial(attention, impl="xla"))
    for platform in ("cuda", "tpu"):
        text = jax.export.export(run, platforms=[platform])(*args).mlir_module()
        assert cache_attention.TARGET not in text and "dot_general" in text
    assert (cache_attention.TARGET in run.lower(*args).as_text()) == cache_attention.available()
