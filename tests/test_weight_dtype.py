"""Weight-only 16-bit storage under float32 compute (`Target.with_weight_dtype`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eaglejax
from eaglejax import InputError
from eaglejax.models.llama import split_precision_linear
from hf_oracle import hf_logits
from tolerances import FORWARD_UNITS, SPLIT_PRODUCT, assert_close_scaled, scaled_error


def test_split_precision_product_is_float32_accurate():
    """Against a float64 product of the same 16-bit weight: splitting x into two bf16
    halves leaves a relative error in x of at most 2^-17 per element (the remainder's own
    bf16 rounding), so the error is bounded by 2^-16 * sum|w||x| (the float32 accumulation
    adds ~in * 2^-24, far less; measured: at most 0.05x the bound). Rounding x to 16 bits
    instead (what a plain 16-bit product does) breaks the bound (measured up to 41x for
    bf16, 4.5x for fp16): the check tells the two apart."""
    rng = np.random.default_rng(0)
    for dtype in (jnp.bfloat16, jnp.float16):
        w = jnp.asarray(rng.normal(size=(300, 257)) * 0.05, dtype)
        x = jnp.asarray(rng.normal(size=(2, 3, 257)), jnp.float32)
        got = np.asarray(split_precision_linear(x, w), np.float64)
        w64, x64 = np.asarray(w, np.float64), np.asarray(x, np.float64)
        want = np.einsum("oi,bti->bto", w64, x64)
        bound = 2.0**-16 * np.einsum("oi,bti->bto", np.abs(w64), np.abs(x64))
        assert got.shape == (2, 3, 300)
        assert np.all(np.abs(got - want) <= bound)
        x_rounded = np.asarray(x.astype(dtype), np.float64)
        rounded_error = np.abs(np.einsum("oi,bti->bto", w64, x_rounded) - want)
        assert np.any(rounded_error > bound)


@pytest.mark.parametrize("family", ["llama", "tied", "qwen3"])
def test_bf16_storage_matches_transformers_with_rounded_weights(family, hf_family, target_of):
    """The oracle: transformers in float32 with every matrix rounded to bfloat16 (norms and
    biases kept), i.e. exactly the stored model computed in float32. The split product is
    float32-accurate to 2^-16, the precision of its noise unit (tolerances.SPLIT_PRODUCT):
    logits of this random model are O(1) (max ~2.5), measured <= 3e-5 off the oracle, about
    0.6 units through its layers; FORWARD_UNITS of them stay below the rounding itself: the
    unrounded model differs by 1.3e-2 to 2.6e-2, hundreds of units (checked below)."""
    _, model = hf_family(family)
    target = target_of(family)
    stored = target.with_weight_dtype("bfloat16")
    assert stored.dtype == jnp.float32 and stored.weight_dtype == jnp.bfloat16
    assert stored.params["final_norm"].dtype == jnp.float32
    rounded = type(model)(model.config).float().eval()
    rounded.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.ndim >= 2:
                p.copy_(p.to(torch.bfloat16).float())
    ids = np.random.RandomState(3).randint(0, 97, size=(2, 24))
    want = hf_logits(rounded, ids)
    got = np.asarray(stored.logits(ids))
    depth = target.config.num_layers
    assert_close_scaled(got, want, units=FORWARD_UNITS, depth=depth, dtype=SPLIT_PRODUCT)
    # Negative control: the unrounded weights (what a float32 model computes) fail the check.
    assert scaled_error(hf_logits(model, ids), want, depth=depth,
                        dtype=SPLIT_PRODUCT) > 2 * FORWARD_UNITS


def test_bf16_storage_decodes_greedily_and_speculatively(target_of):
    """Plain and speculative greedy decoding with 16-bit matrices give the same tokens."""
    from eaglejax.draft.draft import new_eagle3_draft

    stored = target_of("llama").with_weight_dtype("bfloat16")
    draft = new_eagle3_draft(stored, seed=1)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    kwargs = dict(target=stored, max_new_tokens=8, ignore_eos=True)
    plain = eaglejax.generate(prompts, **kwargs)
    spec = eaglejax.generate(prompts, draft=draft, speculative=eaglejax.SpecConfig.chain(3),
                             **kwargs)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert all(len(r.token_ids) == 8 for r in plain)


def test_unknown_weight_dtype_is_refused(target_of):
    with pytest.raises(InputError, match="weight_dtype"):
        target_of("llama").with_weight_dtype("uint8")


def test_weights_are_never_widened_in_the_compiled_step(target_of):
    """The point of the option: the compiled forward multiplies the stored 16-bit matrices
    directly; a float32 copy of a weight would cost more bandwidth than it saves. XLA's
    scratch memory for one decode step stays below one float32 copy of the smallest
    matrix (measured: 2.5 KB, against 467 KB when the weights are widened first)."""
    from eaglejax.models.llama import forward, lm_head

    stored = target_of("llama").with_weight_dtype("bfloat16")
    config = stored.config

    def step(params, tokens):
        out = forward(params, config, tokens, jnp.zeros_like(tokens))
        return lm_head(params, out.hidden)

    matrices = [leaf for leaf in jax.tree.leaves(stored.params) if leaf.dtype == jnp.bfloat16]
    assert len(matrices) == 1 + 4 * config.num_layers + 1  # embed, 4 per layer, lm_head
    compiled = jax.jit(step).lower(stored.params, jnp.ones((1, 1), jnp.int32)).compile()
    smallest_widened = 4 * min(leaf.size for leaf in matrices)
    assert compiled.memory_analysis().temp_size_in_bytes < smallest_widened


def test_saved_16_bit_storage_reloads_as_saved(target_of, tmp_path):
    stored = target_of("tied").with_weight_dtype("bfloat16")
    stored.save(str(tmp_path / "ckpt"))
    loaded = eaglejax.load_target(tmp_path / "ckpt")
    assert loaded.dtype == jnp.float32 and loaded.weight_dtype == jnp.bfloat16
    for a, b in zip(jax.tree.leaves(stored.params), jax.tree.leaves(loaded.params)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32),
                                                     np.asarray(b, np.float32))
    ids = [[3, 4, 5, 6]]
    assert np.array_equal(np.asarray(stored.logits(ids)), np.asarray(loaded.logits(ids)))


def test_embedding_rows_of_a_16_bit_table_are_its_gathered_rows():
    """The native gather (`native.embedding_rows`, CPU) against XLA's: the same rows widened
    exactly, out-of-range ids clamped as XLA's gather clamps them, the same gradient."""
    from eaglejax.models.llama import embedding_rows
    from eaglejax.native import embedding_rows as kernel

    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(300, 72)), jnp.bfloat16)
    tokens = jnp.asarray([[0, 299, 7], [7, 150, 3]], jnp.int32)
    assert kernel.applies(table, jnp.float32)
    got = jax.jit(embedding_rows, static_argnums=2)(table, tokens, jnp.float32)
    want = np.asarray(table, np.float32)[np.asarray(tokens)]
    assert got.dtype == jnp.float32 and got.shape == (2, 3, 72)
    np.testing.assert_array_equal(np.asarray(got), want)
    outside = jnp.asarray([-4, 300, 10_000], jnp.int32)
    clamped = np.asarray(table, np.float32)[[0, 299, 299]]
    np.testing.assert_array_equal(np.asarray(kernel.rows(table, outside)), clamped)
    # the path other platforms take reads the same rows
    np.testing.assert_array_equal(np.asarray(kernel._gather(table, outside)), clamped)

    def loss(t):
        return (embedding_rows(t, tokens, jnp.float32) * jnp.arange(72.0)).sum()

    with eaglejax.native.xla_only():
        want_grad = jax.grad(loss)(table)
    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(table), np.float32),
                                  np.asarray(want_grad, np.float32))


def test_the_decoding_loop_never_widens_the_16_bit_embedding_table(target_of):
    """XLA:CPU gathers 16-bit floats through a float32 copy of the whole table, and in a
    decoding loop it hoists that copy out as invariant: one per program call (22 ms for
    SmolLM2, 8-13% of `auto`'s 16-step plain segments). The compiled loop's scratch memory
    stays below one widened table; XLA's own gather (the negative control) does not."""
    from eaglejax.decoding import loops
    from eaglejax.decoding.loops import PlainLoop, Weights
    from eaglejax.decoding.sampling import SamplingParams
    from eaglejax.decoding.stopping import StopCriteria

    stored = target_of("llama").with_weight_dtype("bfloat16")
    greedy, stop = SamplingParams.make(), StopCriteria((), ())
    prompt = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
    plain = PlainLoop(stored.config, stored.attn_impl)
    state = loops.prefill(plain, Weights(stored.params), prompt, jnp.asarray([4]),
                          jax.random.split(jax.random.key(0), 1), greedy, jnp.asarray([8]),
                          capacity=16, max_tokens=8, greedy=True, stop=stop)
    widened_table = 4 * stored.params["embed"].size

    def scratch() -> int:  # traced afresh each time (jit caches traces per function)
        loop = jax.jit(lambda weights, state, sampling, limit: loops.decode_loop.__wrapped__(
            plain, weights, state, sampling, limit, greedy=True, stop=stop))
        compiled = loop.lower(Weights(stored.params), state, greedy, jnp.asarray([8])).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert scratch() < widened_table
    with eaglejax.native.xla_only():
        assert scratch() >= widened_table


def test_a_head_is_stored_as_its_target_is(target_of, tmp_path):
    """`load_draft` stores the head's matrices as the target stores its own (norms keep the
    compute dtype; `weight_dtype=` overrides), and speculative greedy output with the 16-bit
    head is still the plain output."""
    from eaglejax.draft.draft import new_eagle3_draft

    stored = target_of("llama").with_weight_dtype("bfloat16")
    new_eagle3_draft(stored, seed=2).save(str(tmp_path / "head"))
    head = eaglejax.load_draft(str(tmp_path / "head"), target=stored)
    assert head.params["fc"].dtype == jnp.bfloat16 and head.params["lm_head"].dtype == jnp.bfloat16
    assert head.params["final_norm"].dtype == jnp.float32
    wide = eaglejax.load_draft(str(tmp_path / "head"), target=stored, weight_dtype="float32")
    assert {leaf.dtype for leaf in jax.tree.leaves(wide.params)} == {jnp.dtype(jnp.float32)}
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    kwargs = dict(target=stored, max_new_tokens=8, ignore_eos=True)
    plain = eaglejax.generate(prompts, **kwargs)
    spec = eaglejax.generate(prompts, draft=head, speculative=eaglejax.SpecConfig.tree(2, 3, 6),
                             **kwargs)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


@pytest.mark.parametrize("flags,native,expected", [
    (["avx512f", "amx_bf16", "amx_tile"], True, jnp.bfloat16),  # the tile unit multiplies
    (["avx512f", "avx512_bf16"], True, jnp.bfloat16),  # the kernel widens in registers
    (["avx2", "fma"], True, None),  # not measured faster
    (["avx512f", "amx_bf16", "amx_tile"], False, None),  # no native kernels: XLA widens
])
def test_auto_storage_is_bfloat16_where_the_native_kernels_read_it_fast(monkeypatch, flags,
                                                                        native, expected):
    from eaglejax.loading import target_loader as loading

    monkeypatch.setattr(loading.hardware, "isa_features", lambda: flags)
    monkeypatch.setattr(loading.build, "enabled", lambda: native)
    got = loading.fastest_weight_dtype()
    assert got == (None if expected is None else jnp.dtype(expected))


def test_auto_storage_is_what_load_target_stores(hf_family):
    from eaglejax.loading.target_loader import fastest_weight_dtype

    directory, _ = hf_family("llama")
    target = eaglejax.load_target(directory, weight_dtype="auto")
    assert target.weight_dtype == (fastest_weight_dtype() or jnp.float32)
    assert target.dtype == jnp.float32
