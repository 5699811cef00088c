"""Parity of the Pallas tree-attention kernels (interpret mode on CPU) with the XLA reference."""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import tree_attention, tree_attention_reference
from tolerances import BF16_UNITS, FORWARD_UNITS, assert_close_scaled

# On a GPU the parity cases run the compiled Triton kernel; elsewhere Pallas interpret mode.
ON_GPU = jax.default_backend() == "gpu"
LAYOUTS = ("bshd", "bhsd")  # k/v cache [B,S,Hkv,D] (the default) or head-major [B,Hkv,S,D]

# One compiled program per shape: the eager reference compiles op by op (~1 s per shape).
reference = jax.jit(tree_attention_reference, static_argnames=("scale", "kv_layout"))


def f32_reference(args: tuple[jax.Array, ...], kv_layout: str) -> jax.Array:
    """The reference on the inputs upcast to float32, returned in q's dtype: the oracle for
    the low-precision kernels (and independent of XLA CPU's bf16 dot support)."""
    dtype = args[0].dtype
    up = tuple(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
               for x in args)
    with jax.default_matmul_precision("highest"):  # keep a GPU's f32 dots off TF32
        return reference(*up, kv_layout=kv_layout).astype(dtype)


# ----------------------------------------------------------------------------- inputs


def tree_mask(rng: np.random.Generator, t_new: int) -> np.ndarray:
    """Ancestor-or-self mask of a random tree whose nodes are in topological order."""
    parent = [-1] + [int(rng.integers(0, j)) for j in range(1, t_new)]
    mask = np.zeros((t_new, t_new), bool)
    for t in range(t_new):
        j = t
        while j >= 0:
            mask[t, j] = True
            j = parent[j]
    return mask


def make_mask(rng: np.random.Generator, kind: str, batch: int, t_new: int) -> np.ndarray:
    if kind == "causal":
        return np.broadcast_to(np.tril(np.ones((t_new, t_new), bool)), (batch, t_new, t_new))
    if kind == "tree":
        return np.stack([tree_mask(rng, t_new) for _ in range(batch)])
    if kind == "diagonal":
        return np.broadcast_to(np.eye(t_new, dtype=bool), (batch, t_new, t_new))
    assert kind == "random"
    return rng.random((batch, t_new, t_new)) < 0.5


def make_inputs(seed: int, batch: int, t_new: int, n_q: int, n_kv: int, head_dim: int,
                s_cache: int, dtype=jnp.float32, mask_kind: str = "random",
                lengths: np.ndarray | None = None) -> tuple[jax.Array, ...]:
    """Random inputs; by default row 0 has an empty prefix and the last row a full cache."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    q = normal(batch, t_new, n_q, head_dim)
    k_cache = normal(batch, s_cache, n_kv, head_dim)
    v_cache = normal(batch, s_cache, n_kv, head_dim)
    k_new, v_new = normal(batch, t_new, n_kv, head_dim), normal(batch, t_new, n_kv, head_dim)
    if lengths is None:
        lengths = rng.integers(0, s_cache + 1, size=batch)
        lengths[0] = 0
        if batch > 1:
            lengths[-1] = s_cache
    mask = make_mask(rng, mask_kind, batch, t_new)
    return (q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), k_new, v_new,
            jnp.asarray(mask))


def to_layout(args: tuple[jax.Array, ...], kv_layout: str) -> tuple[jax.Array, ...]:
    """make_inputs' [B,S,Hkv,D] caches moved to ``kv_layout`` (a real transposed copy)."""
    if kv_layout == "bshd":
        return args
    q, k_cache, v_cache, *rest = args
    return (q, jnp.transpose(k_cache, (0, 2, 1, 3)), jnp.transpose(v_cache, (0, 2, 1, 3)),
            *rest)


def assert_close(out: jax.Array, ref: jax.Array, dtype) -> None:
    """Equal within rounding noise of ``dtype`` for one attention call (tolerances.py):
    float32 noise at most 2.6 units (kernel vs reference), bfloat16 0.67 units (one
    bfloat16 rounding of outputs up to about 3)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out))
    if dtype == jnp.float32:
        assert_close_scaled(out, ref, units=FORWARD_UNITS)
    else:
        assert_close_scaled(out, ref, units=BF16_UNITS, dtype=dtype)


# ------------------------------------------------------------- the reference vs numpy


def numpy_tree_attention(q, k_cache, v_cache, lengths, k_new, v_new, mask, scale=None):
    """Independent float64 oracle: one explicit softmax per (row, token, query head)."""
    q, k_cache, v_cache, k_new, v_new = (np.asarray(x, np.float64)
                                         for x in (q, k_cache, v_cache, k_new, v_new))
    batch, t_new, n_q, head_dim = q.shape
    group = n_q // k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = np.zeros_like(q)
    for b in range(batch):
        for t in range(t_new):
            for h in range(n_q):
                keys = [k_cache[b, s, h // group] for s in range(int(lengths[b]))]
                vals = [v_cache[b, s, h // group] for s in range(int(lengths[b]))]
                keys += [k_new[b, j, h // group] for j in range(t_new) if mask[b, t, j]]
                vals += [v_new[b, j, h // group] for j in range(t_new) if mask[b, t, j]]
                if not keys:
                    continue
                logits = np.array([q[b, t, h] @ k for k in keys]) * scale
                weights = np.exp(logits - logits.max())
                out[b, t, h] = (weights / weights.sum()) @ np.array(vals)
    return out


@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("mask_kind", ["causal", "tree", "random"])
def test_reference_matches_numpy_loop(mask_kind, kv_layout):
    args = make_inputs(0, batch=3, t_new=4, n_q=4, n_kv=2, head_dim=8, s_cache=6,
                       mask_kind=mask_kind)
    args = (*args[:6], args[6].at[0, 1].set(False))  # row 0 token 1 also sees nothing
    ref = reference(*to_layout(args, kv_layout), scale=0.3, kv_layout=kv_layout)
    expected = numpy_tree_attention(*args, scale=0.3)
    assert_close_scaled(ref, expected, units=FORWARD_UNITS)  # noise at most 5.3 units
    assert np.all(np.asarray(ref)[0, 1] == 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_reference_layouts_agree(dtype):
    """The head-major reference equals the default one (same math, transposed cache), and
    the eager and jitted references agree."""
    args = make_inputs(4, batch=3, t_new=6, n_q=8, n_kv=2, head_dim=32, s_cache=19,
                       dtype=dtype, mask_kind="tree")
    by_layout = {lay: reference(*to_layout(args, lay), kv_layout=lay) for lay in LAYOUTS}
    assert by_layout["bhsd"].dtype == by_layout["bshd"].dtype == dtype
    assert_close(by_layout["bhsd"], by_layout["bshd"], dtype)
    eager = tree_attention_reference(*to_layout(args, "bhsd"), kv_layout="bhsd")
    assert_close(eager, by_layout["bhsd"], dtype)
    if dtype == jnp.float32:
        assert_close_scaled(by_layout["bhsd"], numpy_tree_attention(*args), units=FORWARD_UNITS)


def test_reference_rejects_unknown_layout():
    args = make_inputs(0, 1, 2, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="kv_layout"):
        tree_attention_reference(*args, kv_layout="sbhd")


# -------------------------------------------------------------------- kernel parity

# (B, T, Hq, Hkv, D, S, dtype, mask, block_k, num_splits); S is never a block multiple.
GPU_CASES = [
    (2, 1, 4, 4, 64, 37, jnp.float32, "causal", None, None),
    (3, 8, 8, 2, 128, 50, jnp.float32, "random", 16, 3),
    (2, 64, 4, 1, 64, 20, jnp.float32, "causal", 16, 1),
    (2, 5, 4, 2, 80, 21, jnp.float32, "tree", None, None),  # D padded to 128
    (2, 3, 4, 2, 64, 9, jnp.float32, "tree", None, None),  # S < 16: padded to one block
    (2, 5, 8, 2, 128, 33, jnp.bfloat16, "tree", None, None),
    (2, 8, 6, 2, 64, 40, jnp.bfloat16, "random", 16, 2),
    (2, 64, 3, 1, 64, 24, jnp.bfloat16, "tree", 16, None),
    (1, 200, 2, 1, 64, 40, jnp.bfloat16, "causal", None, None),  # a prefill chunk, 4 tiles
]
TPU_CASES = [
    (2, 5, 12, 4, 64, 37, jnp.float32, "tree", 16),  # 2 heads per program (D = 64)
    (3, 8, 8, 2, 128, 50, jnp.bfloat16, "causal", 16),
    (2, 64, 4, 1, 64, 20, jnp.float32, "random", None),
    (2, 1, 8, 8, 128, 70, jnp.float32, "causal", 32),
]


def _case_id(case) -> str:
    b, t, hq, hkv, d, s, dtype, mask = case[:8]
    return f"B{b}-T{t}-Hq{hq}-Hkv{hkv}-D{d}-S{s}-{jnp.dtype(dtype).name}-{mask}"


def _seed(case) -> int:
    b, t, hq, hkv, d, s = case[:6]  # stable across runs (hash() of a tuple is too)
    return (((b * 131 + t) * 131 + hq) * 131 + hkv + d * 7 + s * 13) % 1000


@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_kernel_matches_reference(case, kv_layout):
    b, t, hq, hkv, d, s, dtype, mask_kind, block_k, splits = case
    args = to_layout(make_inputs(_seed(case), b, t, hq, hkv, d, s, dtype, mask_kind), kv_layout)
    out = tree_attention(*args, interpret=not ON_GPU, backend="gpu", block_k=block_k,
                         num_splits=splits, kv_layout=kv_layout)
    assert_close(out, f32_reference(args, kv_layout), dtype)


@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("case", TPU_CASES, ids=_case_id)
def test_tpu_kernel_matches_reference(case, kv_layout):
    b, t, hq, hkv, d, s, dtype, mask_kind, block_k = case
    args = to_layout(make_inputs(_seed(case), b, t, hq, hkv, d, s, dtype, mask_kind), kv_layout)
    out = tree_attention(*args, interpret=True, backend="tpu", block_k=block_k,
                         kv_layout=kv_layout)
    assert_close(out, f32_reference(args, kv_layout), dtype)


@pytest.mark.parametrize("case,wrong", [
    (GPU_CASES[1], "scale"), (GPU_CASES[1], "one key dropped"),
    (GPU_CASES[6], "padded head dim scale"), (GPU_CASES[6], "one key dropped"),
], ids=lambda v: v if isinstance(v, str) else _case_id(v))
def test_parity_check_rejects_a_wrong_reference(case, wrong):
    """Negative control: the kernel's output fails `assert_close` against a reference with a
    real bug. float32: softmax scale 1% off (2.2e-2: 67,000 units), the last cached key of
    each row dropped (0.35: 1.1 million units); bfloat16: scale 1/sqrt(128) for head dim 64
    (0.48: 26 units), a key dropped (0.37: 20 units)."""
    b, t, hq, hkv, d, s, dtype, mask_kind, block_k, splits = case
    args = make_inputs(_seed(case), b, t, hq, hkv, d, s, dtype, mask_kind)
    out = tree_attention(*args, interpret=True, backend="gpu", block_k=block_k,
                         num_splits=splits)
    q, k_cache, v_cache, lengths, k_new, v_new, mask = (
        x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in args)
    if wrong == "one key dropped":
        lengths = jnp.maximum(lengths - 1, 0)
    scale = {"scale": 1.01 * d**-0.5, "padded head dim scale": 128**-0.5}.get(wrong)
    bad = reference(q, k_cache, v_cache, lengths, k_new, v_new, mask, scale=scale)
    with pytest.raises(AssertionError, match="noise units"):
        assert_close(out, bad.astype(dtype), dtype)


@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_edge_cases(backend, kv_layout):
    """Empty prefix + diagonal mask gives v_new; blind queries give zeros; full cache works;
    non-finite values in the unused cache slots never leak into the output."""
    b, t, hq, hkv, d, s = 3, 5, 6, 2, 64, 24
    q, kc, vc, _, kn, vn, _ = make_inputs(7, b, t, hq, hkv, d, s)
    lengths = jnp.array([0, s, 5], jnp.int32)
    kc = kc.at[0].set(jnp.nan).at[2, 5:].set(jnp.inf)  # stale slots past each row's length
    vc = vc.at[0].set(jnp.inf).at[2, 5:].set(jnp.nan)
    mask = jnp.asarray(make_mask(np.random.default_rng(0), "diagonal", b, t))
    mask = mask.at[1, 3].set(False)  # row 1 token 3: cache only
    args = to_layout((q, kc, vc, lengths, kn, vn, mask), kv_layout)
    out = tree_attention(*args, interpret=True, backend=backend, block_k=16,
                         kv_layout=kv_layout)
    clean = to_layout((q, jnp.nan_to_num(kc), jnp.nan_to_num(vc), lengths, kn, vn, mask),
                      kv_layout)
    assert_close(out, reference(*clean, kv_layout=kv_layout), jnp.float32)
    group = hq // hkv
    assert_close_scaled(out[0], np.repeat(np.asarray(vn[0]), group, axis=1), units=FORWARD_UNITS)
    blind = to_layout((q, kc, vc, jnp.zeros_like(lengths), kn, vn, jnp.zeros_like(mask)),
                      kv_layout)
    out = tree_attention(*blind, interpret=True, backend=backend, block_k=16,
                         kv_layout=kv_layout)
    assert np.all(np.asarray(out) == 0.0)


@pytest.mark.parametrize("kv_layout", ["bhsd"])  # the model's layout; parity covers both
def test_jit_and_while_loop(kv_layout):
    args = to_layout(make_inputs(3, 2, 5, 8, 2, 64, 30, mask_kind="tree"), kv_layout)
    kernel = functools.partial(tree_attention, interpret=True, block_k=16, kv_layout=kv_layout)
    ref_fn = functools.partial(tree_attention_reference, kv_layout=kv_layout)

    def loop(attn, q, *rest):
        def body(carry):
            i, x = carry
            return i + 1, attn(x, *rest)  # output feeds the next query: a decode-like loop
        return jax.lax.while_loop(lambda c: c[0] < 2, body, (0, q))[1]

    out = jax.jit(functools.partial(loop, kernel))(*args)
    ref = jax.jit(functools.partial(loop, ref_fn))(*args)
    assert_close(out, ref, jnp.float32)
    assert_close(jax.jit(kernel)(*args), reference(*args, kv_layout=kv_layout), jnp.float32)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    batch=st.integers(1, 2),
    t_new=st.sampled_from([1, 5, 8]),
    group=st.sampled_from([1, 3, 4]),
    n_kv=st.integers(1, 2),
    head_dim=st.sampled_from([64, 128]),
    s_cache=st.integers(1, 40),
    mask_kind=st.sampled_from(["causal", "tree", "random"]),
    backend=st.sampled_from(["gpu", "tpu"]),
    kv_layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(batch, t_new, group, n_kv, head_dim, s_cache, mask_kind, backend,
                       kv_layout, seed):
    args = to_layout(make_inputs(seed, batch, t_new, group * n_kv, n_kv, head_dim, s_cache,
                                 mask_kind=mask_kind), kv_layout)
    out = tree_attention(*args, interpret=True, backend=backend, block_k=16,
                         kv_layout=kv_layout)
    assert_close(out, reference(*args, kv_layout=kv_layout), jnp.float32)


# ------------------------------------------------------------------- API and lowering


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only error path")
def test_cpu_without_interpret_raises():
    args = make_inputs(0, 1, 1, 2, 1, 64, 8)
    with pytest.raises(ValueError, match="interpret=True"):
        tree_attention(*args)


def test_bad_shapes_raise():
    q, kc, vc, lengths, kn, vn, mask = make_inputs(0, 2, 3, 4, 2, 64, 8)
    with pytest.raises(ValueError, match="mask"):
        tree_attention(q, kc, vc, lengths, kn, vn, mask[:, :2], interpret=True)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(q[:, :, :3], kc, vc, lengths, kn, vn, mask, interpret=True)
    with pytest.raises(ValueError, match="kv_layout"):
        tree_attention(q, kc, vc, lengths, kn, vn, mask, interpret=True, kv_layout="sbhd")
    # A [B,S,Hkv,D] cache passed as head-major reads S=8 as Hkv: caught, not misread.
    with pytest.raises(ValueError, match="bhsd"):
        tree_attention(q, kc, vc, lengths, kn, vn, mask, interpret=True, kv_layout="bhsd")
    kh, vh = jnp.transpose(kc, (0, 2, 1, 3)), jnp.transpose(vc, (0, 2, 1, 3))
    with pytest.raises(ValueError, match="bshd"):
        tree_attention(q, kh, vh, lengths, kn, vn, mask, interpret=True)


def _abstract_inputs(kv_layout: str, batch=2, t_new=8, n_q=32, n_kv=8, head_dim=128,
                     s_cache=1000, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    cache = (batch, s_cache, n_kv, head_dim) if kv_layout == "bshd" else (
        batch, n_kv, s_cache, head_dim)
    kv = sds(cache, dtype)
    new = sds((batch, t_new, n_kv, head_dim), dtype)
    return (sds((batch, t_new, n_q, head_dim), dtype), kv, kv, sds((batch,), jnp.int32), new,
            new, sds((batch, t_new, t_new), jnp.bool_))


@pytest.mark.parametrize(
    "platform,backend,module",
    [("cuda", "gpu", "jax._src.lib.triton"), ("tpu", "tpu", "jax._src.tpu_custom_call")],
)
@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("variant", ["d128", "d64-split4"])
def test_kernel_lowers_for_accelerator(platform, backend, module, kv_layout, variant):
    """Cross-lower the compiled (non-interpret) kernels from this host: catches Pallas
    lowering errors of the Triton / Mosaic paths without the hardware. The cache reaches
    the kernel as is: no transpose, pad or concatenation of it in the wrapper."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not available in this jaxlib")
    head_dim = 128 if variant == "d128" else 64  # TPU: d64 packs 2 heads per program
    kwargs = {"num_splits": 4} if variant == "d64-split4" else {}
    inputs = _abstract_inputs(kv_layout, head_dim=head_dim)
    fn = functools.partial(tree_attention, backend=backend, kv_layout=kv_layout, **kwargs)
    text = jax.jit(fn).trace(*inputs).lower(lowering_platforms=(platform,)).as_text()
    assert ("triton" if backend == "gpu" else "tpu_custom_call") in text
    cache_type = "tensor<" + "x".join(map(str, inputs[1].shape)) + "xbf16>"
    for op in ("transpose", "pad", "concatenate", "copy", "dynamic_slice", "gather"):
        offending = [line for line in text.splitlines()
                     if f"stablehlo.{op}" in line and cache_type in line]
        assert not offending, offending


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"), reason="needs a GPU or TPU")
@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_kernel_on_accelerator(dtype, kv_layout):
    args = to_layout(make_inputs(5, 4, 8, 32, 8, 128, 1000, dtype, "tree"), kv_layout)
    with jax.default_matmul_precision("highest"):  # keep XLA's f32 reference off TF32
        ref = tree_attention_reference(*args, kv_layout=kv_layout)
    assert_close(tree_attention(*args, kv_layout=kv_layout), ref, dtype)
