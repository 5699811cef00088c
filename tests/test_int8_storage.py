"""Int8 weight storage (`models.quantized`, `native.int8_matmul`): the kernel against the
format's formula in float64, the model against transformers computing the same quantized
model, and decoding on it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eaglejax
from eaglejax import InputError, native
from eaglejax.models import llama, quantized
from eaglejax.native import int8_matmul
from hf_oracle import hf_logits
from tolerances import FORWARD_UNITS, assert_close_scaled, scaled_error


def quantized_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """p and t of x [M,K] as the format defines them (float32 division, ties to even)."""
    blocks = x.reshape(x.shape[0], -1, quantized.BLOCK)
    t = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    return np.rint(blocks / np.where(t == 0, np.float32(1), t)), t[..., 0]


def formula(x: np.ndarray, matrix: quantized.Int8Matrix) -> np.ndarray:
    """y = s[n] sum_b t[m,b] sum_k p q, in float64 (the module docstring's formula)."""
    p, t = quantized_x(x)
    q = np.asarray(matrix.values(), np.float64).reshape(matrix.scales.shape[0], -1,
                                                      quantized.BLOCK)
    return np.einsum("mbk,nbk,mb->mn", p, q, t.astype(np.float64)) * np.asarray(
        matrix.scales, np.float64)


def test_quantize_rounds_each_row_to_its_scale():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2, 24, 64)).astype(np.float32)
    w[1, 3] = 0.0  # an all-zero row keeps scale 0 and values 0
    matrix = quantized.quantize(w)
    assert matrix.shape == (2, 24, 64) and matrix.dtype == jnp.int8
    assert matrix.packed.shape == (3, 16, 16, 4) and matrix.packed.dtype == jnp.uint8
    rows = w.reshape(48, 64)
    scales = np.abs(rows).max(axis=1) / np.float32(127)
    np.testing.assert_array_equal(np.asarray(matrix.scales), scales)
    want = np.rint(rows / np.where(scales == 0, 1, scales)[:, None])
    np.testing.assert_array_equal(np.asarray(matrix.values()), want)
    error = np.abs(np.asarray(matrix.dequantized()).reshape(48, 64) - rows)
    assert np.all(error <= scales[:, None] * (0.5 + 1e-6))
    assert matrix.reshape(-1, 64).shape == (48, 64)
    ids = jnp.asarray([[0, 47], [19, 100]])  # out of range: clamped
    np.testing.assert_array_equal(
        np.asarray(matrix.rows(ids)),
        np.asarray(matrix.dequantized()).reshape(48, 64)[[[0, 47], [19, 47]]])
    with pytest.raises(ValueError, match="multiples of 16"):
        quantized.quantize(np.ones((24, 64), np.float32))
    with pytest.raises(ValueError, match="keeps its last dim"):
        matrix.reshape(64, 48)


def test_split_storage_is_the_same_matrix():
    """`split` keeps the bytes with the rows in the logical leading dims (what a mesh
    shards); indexing its leading dim (`w_gate_up[0]` on a mesh) and reshaping give the
    same values, int8 and 4-bit blocks alike; rows that do not split are refused, and
    placing such a matrix on a mesh names the parameter."""
    from eaglejax import ConfigError
    from eaglejax.models import gguf_blocks
    from eaglejax.models.placement import TargetPlacement
    from eaglejax.programs.reference import llama31_8b

    rng = np.random.default_rng(2)
    w = rng.normal(size=(2, 48, 64)).astype(np.float32)
    for matrix in (quantized.quantize(w), gguf_blocks.quantize(w)):
        split = matrix.split()
        assert split.packed.shape[:2] == (2, 3) and matrix.packed.shape[0] == 6
        wide = np.asarray(matrix.dequantized())
        for i in range(2):
            np.testing.assert_array_equal(split[i].dequantized(), wide[i])
            np.testing.assert_array_equal(matrix[i].dequantized(), wide[i])
        np.testing.assert_array_equal(split.reshape(-1, 64).dequantized(), wide.reshape(96, 64))
        assert split.flat().packed.shape == matrix.packed.shape
    with pytest.raises(TypeError, match="indexed by one int"):
        quantized.quantize(w)[0:1]
    odd = quantized.quantize(rng.normal(size=(2, 24, 64)).astype(np.float32))
    with pytest.raises(ValueError, match="multiple of 16"):
        odd.split()
    placement = TargetPlacement.plan(llama31_8b(1), eaglejax.make_mesh(tp=1))
    with pytest.raises(ConfigError, match=r"\['layers'\]\[0\]\['wqkv'\].*mesh"):
        placement.place(("layers", 0, "wqkv"), odd)


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 12, 16])
def test_kernel_equals_the_formula_and_each_row_alone(rows):
    """The native product against the formula in float64: integer block sums are exact, so
    only float32 rounding of the block scaling remains (noise units of one layer); every row
    of a block equals that row multiplied alone, bit for bit (a verify block reproduces the
    single-token step). XLA's path (prefill, other platforms) is the same formula."""
    assert int8_matmul.available()
    rng = np.random.default_rng(rows)
    for n, k in [(960, 576), (48, 1536)]:
        matrix = quantized.quantize(rng.normal(size=(n, k)).astype(np.float32) * 0.05)
        x = rng.normal(size=(rows, k)).astype(np.float32)
        x[:, 5] *= 60.0  # an outlier: only its block's scale grows
        want = formula(x, matrix)
        product = jax.jit(lambda x, m: llama.linear(x, m))
        got = np.asarray(product(x, matrix))
        assert_close_scaled(got, want, units=FORWARD_UNITS, what="int8 kernel")
        alone = np.concatenate([np.asarray(product(x[i:i + 1], matrix)) for i in range(rows)])
        np.testing.assert_array_equal(got, alone)
        with native.xla_only():
            xla = np.asarray(jax.jit(lambda x, m: llama.linear(x, m))(x, matrix))
        assert_close_scaled(xla, want, units=FORWARD_UNITS, what="XLA int8 product")
        # Negative control: the float32 product of the dequantized weights (x unquantized)
        # is far outside the check.
        wide = x.astype(np.float64) @ np.asarray(matrix.dequantized(), np.float64).T
        assert scaled_error(wide, want) > 100 * FORWARD_UNITS


def test_kernel_prologues_and_residual():
    """RMS norm first, silu(gate) * up first, a residual after: as XLA computes them."""
    rng = np.random.default_rng(5)
    matrix = quantized.quantize(rng.normal(size=(64, 128)).astype(np.float32) * 0.05)
    x = jnp.asarray(rng.normal(size=(6, 128)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(6, 256)), jnp.float32)
    norm = jnp.asarray(1.0 + 0.1 * rng.normal(size=(128,)), jnp.float32)
    residual = jnp.asarray(rng.normal(size=(6, 64)), jnp.float32)
    calls = {"norm": lambda m: llama.linear(x, m, norm=norm, eps=1e-5, residual=residual),
             "gated": lambda m: llama.linear(gate_up, m, gated=True, residual=residual)}
    for name, call in calls.items():
        got = np.asarray(jax.jit(call)(matrix))
        with native.xla_only():
            want = np.asarray(jax.jit(call)(matrix))
        assert_close_scaled(got, want, units=FORWARD_UNITS, what=name)


def quantized_oracle(model):
    """A copy of a transformers model computing the int8 format: every linear layer whose
    shape tiles gets its weight rounded to per-row int8 and its input rounded to int8 in
    blocks of 32 (a forward pre-hook); norms, biases, embeddings and an output head that
    does not tile as they are."""
    oracle = type(model)(model.config).float().eval()
    oracle.load_state_dict(model.state_dict())

    def round_input(module, inputs):
        x = inputs[0].detach().numpy().astype(np.float32)
        flat = x.reshape(-1, x.shape[-1])
        p, t = quantized_x(flat)
        return (torch.as_tensor((p * t[..., None]).reshape(x.shape).astype(np.float32)),)

    with torch.no_grad():
        for module in oracle.modules():
            if isinstance(module, torch.nn.Linear) and quantized.tiles(tuple(module.weight.shape)):
                w = module.weight.numpy()
                module.weight.copy_(torch.as_tensor(np.asarray(
                    quantized.quantize(w).dequantized())))
                module.register_forward_pre_hook(round_input)
    return oracle


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_int8_target_matches_transformers_computing_the_format(family, hf_family, target_of):
    """The oracle: transformers with int8-rounded weights and int8-rounded inputs to every
    product. A rounding of x / t that lands on the other side of .5 in one implementation
    moves that product by a quantization step, and every later position of its row a
    little (measured: 47 of 48 positions within 3 noise units, one at 0.11 of the float32
    model's distance from the oracle; Qwen3: 43 of 48), so 75% of the positions of both checks
    together must be within FORWARD_UNITS, and each check's far closer than the float32 model
    is. The share is over both: the single steps' 4 positions are too few for one (a rounding
    that flipped early in a row moves both of its positions: 2 of 4 on an Intel Xeon 6/167)."""
    _, model = hf_family(family)
    target = target_of(family).with_weight_dtype("int8")
    assert target.weight_dtype == jnp.int8 and target.dtype == jnp.float32
    assert isinstance(target.params["layers"][0]["wqkv"], quantized.Int8Matrix)
    oracle = quantized_oracle(model)
    ids = np.random.RandomState(3).randint(0, 97, size=(2, 24))
    want = hf_logits(oracle, ids)
    depth = target.config.num_layers
    unit = np.finfo(np.float32).eps * depth ** 0.5 * np.abs(want).max()
    float_error = scaled_error(hf_logits(model, ids), want, depth=depth)
    within = []
    for got in (np.asarray(target.logits(ids)),  # XLA's products (24 rows)
                np.stack([np.asarray(target.logits(ids[:, :t]))[:, -1] for t in (5, 13)], 1)):
        want_rows = want if got.shape == want.shape else want[:, [4, 12]]
        within.append((np.abs(got - want_rows).max(axis=-1) <= FORWARD_UNITS * unit).ravel())
        assert scaled_error(got, want_rows, depth=depth) < float_error / 3
    assert np.mean(np.concatenate(within)) >= 0.75, [w.mean() for w in within]


def test_int8_decoding_greedy_is_plain_and_errors_are_clear(target_of, tmp_path):
    """Speculative greedy decoding on int8 storage gives plain decoding's tokens (verify
    blocks run the same per-row products as single steps); storing twice and saving are
    refused with a clear error; a mesh takes it."""
    from eaglejax.draft.draft import new_eagle3_draft

    stored = target_of("llama").with_weight_dtype("int8")
    draft = new_eagle3_draft(stored, seed=1)
    draft.save(str(tmp_path / "float-head"))  # a head loaded for an int8 target is int8
    int8_head = eaglejax.load_draft(str(tmp_path / "float-head"), target=stored)
    assert isinstance(int8_head.params["fc"], quantized.Int8Matrix)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    kwargs = dict(target=stored, max_new_tokens=10, ignore_eos=True)
    plain = eaglejax.generate(prompts, **kwargs)
    for head in (draft, int8_head):
        for spec in (eaglejax.SpecConfig.chain(3),
                     eaglejax.SpecConfig(method="tree", top_k=2, depth=3, total_tokens=6)):
            got = eaglejax.generate(prompts, draft=head, speculative=spec, **kwargs)
            assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    with pytest.raises(InputError, match="already quantized"):
        int8_head.with_weight_dtype("int8")
    with pytest.raises(InputError, match="saving int8"):
        int8_head.save(str(tmp_path / "head"))
    assert not (tmp_path / "head").exists()
    with pytest.raises(InputError, match="already quantized"):
        stored.with_weight_dtype("bfloat16")
    placed = stored.on_mesh(eaglejax.make_mesh(tp=1, dp=1))  # more devices: test_quantized_mesh
    assert placed.mesh is not None and placed.weight_dtype == jnp.int8
    np.testing.assert_array_equal(placed.params["layers"][0]["wqkv"].dequantized(),
                                  stored.params["layers"][0]["wqkv"].dequantized())
    with pytest.raises(InputError, match="weight_dtype must be one of"):
        target_of("llama").with_weight_dtype("uint8")


def test_int8_checkpoint_reloads_as_stored(hf_family, target_of, tmp_path):
    """`eaglejax convert SRC DST --quantize int8` (and `Target.save` of int8 storage) writes a
    checkpoint that reloads bit for bit without quantizing again, stays int8 under "auto",
    loads onto a mesh, and refuses another storage with one line."""
    from eaglejax.cli import main

    want = target_of("llama").with_weight_dtype("int8")
    assert main(["convert", str(hf_family("llama")[0]), str(tmp_path / "ck"),
                 "--quantize", "int8"]) == 0
    want.save(str(tmp_path / "saved"))
    ids = [[5, 6, 7, 8, 9, 10]]
    for directory in ("ck", "saved"):
        for weight_dtype in (None, "auto", "int8"):
            got = eaglejax.load_target(str(tmp_path / directory), weight_dtype=weight_dtype)
            assert got.weight_dtype == jnp.int8
            pairs = zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params))
            assert all(np.array_equal(a, b) for a, b in pairs)
        np.testing.assert_array_equal(got.logits(ids), want.logits(ids))
    with pytest.raises(InputError, match="already quantized"):
        eaglejax.load_target(str(tmp_path / "ck"), weight_dtype="bfloat16")
    on_mesh = eaglejax.load_target(str(tmp_path / "ck"), mesh=eaglejax.make_mesh(tp=1, dp=1))
    assert on_mesh.mesh is not None and on_mesh.weight_dtype == jnp.int8
    assert main(["convert", str(hf_family("llama")[0]), str(tmp_path / "ck"),
                 "--quantize", "int8"]) != 0  # nothing saved is overwritten



def test_quantizing_at_load_reads_no_float_matrix_onto_a_device(hf_family, target_of,
                                                                monkeypatch):
    """load_target(..., weight_dtype="int8" | "int4-sym"), with and without a mesh, quantizes
    each matrix from the host array read from the file (never a device array: the float
    model reaches no device) and keeps it on the host until it is placed; the values are
    `with_weight_dtype`'s bit for bit. On a mesh `with_weight_dtype` places each matrix as it
    is quantized."""
    from eaglejax.models import gguf_blocks

    seen = []
    for module in (quantized, gguf_blocks):
        def recording(weight, *args, original=module.quantize, **kwargs):
            seen.append((type(weight), (args + tuple(kwargs.values()))[-1]))
            return original(weight, *args, **kwargs)

        monkeypatch.setattr(module, "quantize", recording)
    directory = hf_family("llama")[0]
    for weight_dtype in ("int8", "int4-sym"):
        want = target_of("llama").with_weight_dtype(weight_dtype)
        assert all(kind is not np.ndarray for kind, _ in seen)  # quantized from device arrays
        for mesh in (None, eaglejax.make_mesh(tp=1, dp=1)):
            seen.clear()
            got = eaglejax.load_target(directory, weight_dtype=weight_dtype, mesh=mesh)
            assert seen and all(kind is np.ndarray and host for kind, host in seen)
            assert got.storage == want.storage and (got.mesh is None) == (mesh is None)
            flat = [jax.tree.leaves(jax.tree.map(lambda x: x.flat() if quantized.is_int8(x)
                                                 else x, t.params, is_leaf=quantized.is_int8))
                    for t in (got, want)]  # a mesh keeps them `split`: the same bytes
            assert len(flat[0]) == len(flat[1])
            assert all(np.array_equal(a, b) for a, b in zip(*flat))
        seen.clear()
        target_of("llama").on_mesh(eaglejax.make_mesh(tp=1, dp=1)).with_weight_dtype(weight_dtype)
        assert seen and all(host for _, host in seen)


def test_a_quantized_checkpoint_is_read_to_the_host_for_a_mesh(target_of, tmp_path,
                                                               monkeypatch):
    """A quantized checkpoint loaded onto a mesh is read into host memory and split from
    there (no device holds the whole model first), and decodes as the target it saved."""
    from eaglejax.loading import checkpoint

    target = target_of("llama").with_weight_dtype("int8")
    target.save(str(tmp_path / "ck"))
    read = []
    original = checkpoint.restore_tree

    def recording(directory, abstract):
        tree = original(directory, abstract)
        read.extend(type(leaf) for leaf in jax.tree.leaves(tree))
        return tree

    monkeypatch.setattr(checkpoint, "restore_tree", recording)
    on_mesh = eaglejax.load_target(str(tmp_path / "ck"), mesh=eaglejax.make_mesh(tp=1, dp=1))
    assert read and set(read) == {np.ndarray}
    assert on_mesh.mesh is not None and on_mesh.storage == target.storage
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(on_mesh.params))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want, got = (eaglejax.generate(prompts, target=t, max_new_tokens=8, ignore_eos=True)
                 for t in (target, on_mesh))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
