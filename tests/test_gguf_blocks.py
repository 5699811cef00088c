"""GGUF blocks kept as stored (`load_target(..., weight_dtype="gguf")`, `models.gguf_blocks`;
Q4_0 / Q4_1 / Q8_0 files and Q4_K / Q6_K ones): the values against the `gguf` package's own
dequantization, the model against transformers computing the same weights on int8-rounded
inputs, decoding on it, and checkpoints."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eaglejax
from eaglejax import InputError, LoadError
from eaglejax.loading.gguf_file import read_gguf
from eaglejax.models import gguf_blocks
from eaglejax.models.gguf_blocks import BlockMatrix, HostBlocks, PartsMatrix
from hf_oracle import hf_logits
from test_block_matmul import kquant_bytes
from test_gguf import _gguf_name, _hf_model, _write_tiny
from test_int8_storage import quantized_x
from tolerances import FORWARD_UNITS, scaled_error

Q = gguf.GGMLQuantizationType
# each matrix's block type: layer 0 Q4_1, layer 1 Q4_0 (its k_proj Q4_1: q/k/v then differ
# and their fused matrix is kept in parts), embeddings and output head Q8_0
KINDS = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q4_1}
for _name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
    KINDS.setdefault(f"blk.0.{_name}.weight", Q.Q4_1)
    KINDS.setdefault(f"blk.1.{_name}.weight", Q.Q4_0)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's q/k row order
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path, HF config, HF tensors as the file's dequantized values) of a random llama whose
    matrices are stored as KINDS says."""
    return write_blocks_gguf(tmp_path_factory.mktemp("blocks") / "tiny-blocks.gguf")


def write_blocks_gguf(path):
    """`tiny_gguf` written at `path`."""
    cfg, sd = _hf_model("llama", seed=4)
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    raw = {}
    for hf, value in sd.items():
        name = _gguf_name(hf)
        if name in KINDS:
            part = name.split(".")[-2]
            stored = _permute(value, heads[part]) if part in heads else value
            raw[name] = (gguf.quants.quantize(stored, KINDS[name]), KINDS[name])
    _write_tiny(path, "llama", cfg, sd, permute=True, q8=False, raw=raw)
    dequantized = read_gguf(path).tensors  # the gguf package's values, q/k rows unpermuted
    return path, cfg, dequantized


def test_blocks_are_the_files_values(tiny_gguf, smollm_path):
    """Every kept matrix dequantizes to exactly what the `gguf` package computes from the file
    (also through the packed layout and an embedding lookup); a fused matrix whose parts
    differ in kind is kept in parts, none widened; the default model's Q4_1 and Q8_0 tensors
    decode exactly too."""
    path, cfg, want = tiny_gguf
    target = eaglejax.load_target(path, weight_dtype="gguf")
    assert target.storage == "Q4_0 + Q4_1 + Q8_0 blocks" and target.weight_dtype == jnp.int8
    float_target = eaglejax.load_target(path)
    expect = {(0, "wqkv"): "Q4_1", (0, "w_down"): "Q4_1", (1, "wo"): "Q4_0",
              (1, "w_gate_up"): "Q4_0", (1, "wqkv"): "Q4_0x2+Q4_1x1+Q4_0x1@1"}
    _assert_kept(target, float_target, expect)
    for key in ("embed", "lm_head"):
        assert target.params[key].kind == "Q8_0"
        np.testing.assert_array_equal(target.params[key].dequantized(), float_target.params[key])
    ids = jnp.array([[0, 7, 319], [18, 3, 200]])
    np.testing.assert_array_equal(target.params["embed"].rows(ids),
                                  want["model.embed_tokens.weight"][np.asarray(ids)])

    reader = gguf.GGUFReader(smollm_path)
    for t in [t for t in reader.tensors if t.name in ("token_embd.weight",
                                                      "blk.3.ffn_down.weight")]:
        shape = tuple(reversed([int(d) for d in t.shape]))
        blocks = HostBlocks.from_file(np.asarray(t.data), gguf_blocks.KINDS[t.tensor_type.name],
                                      shape)
        exact = gguf.dequantize(t.data, t.tensor_type).reshape(shape)
        np.testing.assert_array_equal(blocks.dequantized(), exact)
        np.testing.assert_array_equal(gguf_blocks.pack(blocks).dequantized(), exact)


def test_blocks_match_transformers_computing_them(tiny_gguf):
    """The oracle: transformers with the file's dequantized weights and int8-rounded inputs
    (blocks of 32) to every product whose weight is kept in blocks. As for int8 storage, a
    rounding of x / t on the other side of .5 moves a position by a quantization step, so
    75% of the positions must be within FORWARD_UNITS and all far closer than the float
    model computing the same weights is."""
    _check_against_rounding_oracle(tiny_gguf, ())


def _assert_kept(target, float_target, expect: dict) -> None:
    """Each layer matrix (layer, key) of `target` kept as `expect` says (a block kind, a
    `PartsMatrix`'s kind, or None: widened) with the float target's values exactly, and no
    other matrix left wide (all of these files' other matrices are kept kinds)."""
    for i, layer in enumerate(target.params["layers"]):
        for key in ("wqkv", "wo", "w_gate_up", "w_down"):
            leaf, wide = layer[key], float_target.params["layers"][i][key]
            kind = expect.get((i, key), "kept")
            if kind is None:
                assert not isinstance(leaf, (BlockMatrix, PartsMatrix)), (i, key)
                np.testing.assert_array_equal(leaf, wide)
                continue
            assert isinstance(leaf, (BlockMatrix, PartsMatrix)), (i, key)
            assert kind in ("kept", leaf.kind), (i, key, leaf.kind)
            assert leaf.shape == wide.shape
            np.testing.assert_array_equal(leaf.dequantized(), wide)


def _check_against_rounding_oracle(gguf, widened: tuple[str, ...]) -> None:
    """The file `gguf` (a fixture's path, config, tensors) kept in blocks against
    transformers with its dequantized weights, every product's input rounded to int8 blocks
    of 32 but those of the `widened` modules (`_assert_close_to_oracle`)."""
    from transformers import LlamaForCausalLM

    path, cfg, want_tensors = gguf
    target = eaglejax.load_target(path, weight_dtype="gguf")
    oracle = LlamaForCausalLM(cfg).eval()
    oracle.load_state_dict({k: torch.from_numpy(v) for k, v in want_tensors.items()},
                           strict=False)
    float_model = LlamaForCausalLM(cfg).eval()
    float_model.load_state_dict(oracle.state_dict())
    for name, module in oracle.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(widened):
            module.register_forward_pre_hook(_round_input)
    _assert_close_to_oracle(target, oracle, float_model, cfg)


def _round_input(module, inputs):
    """A product's input rounded to int8 blocks of 32, as block storage's products take it."""
    x = inputs[0].detach().numpy().astype(np.float32)
    p, t = quantized_x(x.reshape(-1, x.shape[-1]))
    return (torch.as_tensor((p * t[..., None]).reshape(x.shape).astype(np.float32)),)


def _assert_close_to_oracle(target, oracle, float_model, cfg) -> None:
    """75% of positions within FORWARD_UNITS of the oracle, and every one closer than half
    the float model's distance (computing the same weights without rounding x); XLA's
    products (20 rows) and the native kernel's (one row). A flipped rounding of x / t moves
    its position by one step of x: measured 0.38 of the float model's distance for the
    int4 model."""
    ids = np.random.RandomState(5).randint(0, cfg.vocab_size, size=(2, 20))
    want = hf_logits(oracle, ids)
    depth = cfg.num_hidden_layers
    for got in (np.asarray(target.logits(ids)),
                np.stack([np.asarray(target.logits(ids[:, :t]))[:, -1] for t in (4, 11)], 1)):
        want_rows = want if got.shape == want.shape else want[:, [3, 10]]
        per_position = np.abs(got - want_rows).max(axis=-1)
        unit = np.finfo(np.float32).eps * depth ** 0.5 * np.abs(want).max()
        assert np.mean(per_position <= FORWARD_UNITS * unit) >= 0.75
        float_error = scaled_error(hf_logits(float_model, ids), want, depth=depth)
        assert scaled_error(got, want_rows, depth=depth) < float_error / 2


def test_int4_rounds_each_block_within_half_a_step():
    """`gguf_blocks.quantize` (weight_dtype "int4": Q4_1; "int4-sym": Q4_0; their vocabulary
    matrices: Q8_0): every weight within half its block's step of the stored value (plus
    float16's rounding of the minimum or the scale), Q4_1's extremes exact up to that
    rounding, a constant block exact (Q4_1) or within half a step (Q4_0: d = value / 7 or
    / -8), a zero block exact."""
    rng = np.random.default_rng(8)
    w = rng.standard_normal((48, 96)).astype(np.float32) * np.linspace(0.01, 3, 96)
    w[5, :32] = 0.25  # a constant block: Q4_1's d = 0, every value equals the minimum
    w[6, 32:64] = 0.0
    w[7, :32] = -np.abs(w[7, :32])  # one-signed blocks: Q4_0's d takes the sign that fits
    w[8, :32] = np.abs(w[8, :32])
    blocks = w.reshape(48, 3, 32)
    for kind in ("Q4_1", "Q4_0", "Q8_0"):
        matrix = gguf_blocks.quantize(w, kind)
        assert matrix.kind == kind and matrix.shape == (48, 96)
        back = np.asarray(matrix.dequantized())
        error = np.abs(back - w).reshape(48, 3, 32).max(-1)
        if kind == "Q4_1":
            step = ((blocks.max(-1) - blocks.min(-1)) / 15).astype(np.float16).astype(np.float32)
            slack = np.abs(blocks.min(-1)) * 2.0 ** -11 + step * 2.0 ** -10
            assert np.all(back[5, :32] == 0.25)
        elif kind == "Q8_0":
            step = (np.abs(blocks).max(-1) / 127).astype(np.float16).astype(np.float32)
            slack = np.abs(blocks).max(-1) * 2.0 ** -10  # d's float16 rounding, 127 steps out
        else:
            step = np.abs(np.asarray(matrix.row_scales()[0])).reshape(48, 3)
            slack = np.abs(blocks).max(-1) * 2.0 ** -10  # d's float16 rounding, 8 steps out
            assert step[7, 0] < np.abs(blocks[7, 0]).max() / 7.5  # -8 d reaches the extreme
            assert step[8, 0] < np.abs(blocks[8, 0]).max() / 7.5
        assert np.all(error <= step / 2 + slack), kind
        assert np.all(back[6, 32:64] == 0.0)
        assert np.abs(back - w).max() > 1e-3  # a negative control: 4 bits lose something
    with pytest.raises(ValueError, match="multiples of 16"):
        gguf_blocks.quantize(w[:40])
    with pytest.raises(ValueError, match="Q4_1, Q4_0 or Q8_0, got 'Q4_K'"):
        gguf_blocks.quantize(w, "Q4_K")


def test_4_bit_storage_keeps_vocabulary_matrices_in_8_bits():
    """int4 / int4-sym keep the embedding and an untied output head in Q8_0 blocks (as
    llama.cpp's 4-bit files keep theirs in 8 bits or more) and the layers' matrices in
    Q4_1 / Q4_0; the exported loops' abstract storage is the same."""
    from eaglejax.config import ModelConfig
    from eaglejax.models import llama
    from eaglejax.programs import export

    config = ModelConfig("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                         tie_word_embeddings=False)
    params = llama.init_params(config, jax.random.key(0))
    one_device = eaglejax.make_mesh(tp=1, devices=jax.devices()[:1])
    for weight_dtype, kind in gguf_blocks.INT4_KINDS.items():
        stored = gguf_blocks.kinds_by_path(
            llama.store_matrices(llama.param_info(config), params, weight_dtype))
        assert stored["['embed']"] == stored["['lm_head']"] == "Q8_0"
        assert {stored[k] for k in stored if "layers" in k} == {kind}
        _, exported = export.abstract_params(config, one_device, weight_dtype=weight_dtype)
        assert gguf_blocks.kinds_by_path(exported) == stored


@pytest.mark.parametrize("weight_dtype,kind", [("int4", "Q4_1"), ("int4-sym", "Q4_0")])
def test_int4_target_matches_transformers_computing_it(hf_family, target_of, weight_dtype,
                                                       kind):
    """weight_dtype "int4" / "int4-sym" of a float model: transformers with every tiling
    matrix replaced by its 4-bit blocks' values (the embedding and output head: Q8_0's) and
    inputs of those products rounded to int8 blocks (the oracle of
    `test_blocks_match_transformers_computing_them`)."""
    _, model = hf_family("llama")
    target = target_of("llama").with_weight_dtype(weight_dtype)
    assert target.storage == f"{kind} blocks"  # the vocabulary (97) does not tile
    oracle = type(model)(model.config).eval()
    oracle.load_state_dict(model.state_dict())
    with torch.no_grad():
        for module in oracle.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) \
                    and gguf_blocks.tiles(tuple(module.weight.shape)):
                vocabulary = module.weight.shape[0] == model.config.vocab_size
                stored = gguf_blocks.quantize(module.weight.numpy(), "Q8_0" if vocabulary
                                              else kind)
                module.weight.copy_(torch.as_tensor(np.array(stored.dequantized())))
                if isinstance(module, torch.nn.Linear):
                    module.register_forward_pre_hook(_round_input)
    float_model = type(model)(model.config).eval()
    float_model.load_state_dict(oracle.state_dict())
    _assert_close_to_oracle(target, oracle, float_model, model.config)


def test_decoding_on_blocks_and_clear_errors(tiny_gguf, hf_family, tmp_path):
    """Greedy speculation on block storage gives plain decoding's tokens (with a head the
    target's int8 storage quantizes too); a mesh takes them; storing again, a file that is not
    GGUF and a GGUF without kept blocks are refused with one clear error each."""
    from eaglejax.draft.draft import new_eagle3_draft

    path, cfg, _ = tiny_gguf
    target = eaglejax.load_target(path, weight_dtype="gguf")
    draft = new_eagle3_draft(target, seed=2)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    kwargs = dict(target=target, max_new_tokens=10, ignore_eos=True)
    plain = eaglejax.generate(prompts, **kwargs)
    for spec in (eaglejax.SpecConfig.chain(3),
                 eaglejax.SpecConfig(method="tree", top_k=2, depth=3, total_tokens=6)):
        got = eaglejax.generate(prompts, draft=draft, speculative=spec, **kwargs)
        assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    with pytest.raises(InputError, match="already quantized"):
        target.with_weight_dtype("bfloat16")
    on_mesh = eaglejax.load_target(path, weight_dtype="gguf",
                                   mesh=eaglejax.make_mesh(tp=1, dp=1))  # more: test_quantized_mesh
    assert on_mesh.mesh is not None and on_mesh.storage == target.storage
    with pytest.raises(InputError, match="not a GGUF file"):
        eaglejax.load_target(hf_family("llama")[0], weight_dtype="gguf")
    cfg_f, sd = _hf_model("llama", seed=5)
    _write_tiny(tmp_path / "float.gguf", "llama", cfg_f, sd, permute=True, q8=False)
    with pytest.raises(LoadError, match="no matrix is stored in a block type"):
        eaglejax.load_target(tmp_path / "float.gguf", weight_dtype="gguf")


def test_block_checkpoints_reload_as_stored(tiny_gguf, hf_family, tmp_path):
    """A GGUF file's blocks (Q4_0, Q4_1 and Q8_0: kinds with and without minimums) and int4 /
    int4-sym storage of a float model, saved (`Target.save`, `eaglejax convert --quantize
    gguf|int4|int4-sym`), reload bit for bit without quantizing again, stay as saved under
    "auto", "gguf" (and "int4" / "int4-sym" where the layers' are Q4_1 / Q4_0), load onto a mesh,
    and refuse another storage and a damaged manifest with one clear error each."""
    import json

    from eaglejax.cli import main

    path, _, _ = tiny_gguf
    blocks = eaglejax.load_target(path, weight_dtype="gguf")
    int4 = eaglejax.load_target(hf_family("llama")[0], weight_dtype="int4")
    sym = eaglejax.load_target(hf_family("llama")[0], weight_dtype="int4-sym")
    assert main(["convert", str(path), str(tmp_path / "gguf-ck"), "--quantize", "gguf"]) == 0
    for name in ("int4", "int4-sym"):
        assert main(["convert", str(hf_family("llama")[0]), str(tmp_path / f"{name}-ck"),
                     "--quantize", name]) == 0
    blocks.save(str(tmp_path / "gguf-saved"))
    int4.save(str(tmp_path / "int4-saved"))
    sym.save(str(tmp_path / "int4-sym-saved"))
    ids = [[5, 6, 7, 8, 9, 10]]
    for want, name, asks in ((blocks, "gguf", (None, "auto", "gguf")),
                             (int4, "int4", (None, "auto", "gguf", "int4")),
                             (sym, "int4-sym", (None, "auto", "gguf", "int4-sym"))):
        for directory in (f"{name}-ck", f"{name}-saved"):
            for weight_dtype in asks:
                got = eaglejax.load_target(str(tmp_path / directory),
                                           weight_dtype=weight_dtype)
                assert got.storage == want.storage
                pairs = list(zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)))
                assert len(pairs) == len(jax.tree.leaves(want.params))
                assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in pairs)
            np.testing.assert_array_equal(got.logits(ids), want.logits(ids))
    assert blocks.storage == "Q4_0 + Q4_1 + Q8_0 blocks"
    assert int4.storage == "Q4_1 blocks" and sym.storage == "Q4_0 blocks"
    for directory, other in (("gguf-ck", "int4"), ("int4-ck", "int4-sym"),
                             ("int4-sym-ck", "int4")):
        with pytest.raises(InputError, match="already quantized"):
            eaglejax.load_target(str(tmp_path / directory), weight_dtype=other)
    on_mesh = eaglejax.load_target(str(tmp_path / "int4-ck"),
                                   mesh=eaglejax.make_mesh(tp=1, dp=1))
    assert on_mesh.mesh is not None and on_mesh.storage == "Q4_1 blocks"
    manifest = tmp_path / "int4-ck" / "eaglejax.json"
    saved = json.loads(manifest.read_text())
    saved["blocks"] = {**saved["blocks"], "['layers'][0]['no_such']": "Q4_1"}
    manifest.write_text(json.dumps(saved))
    with pytest.raises(LoadError, match="no_such.*not a matrix of this model"):
        eaglejax.load_target(str(tmp_path / "int4-ck"))
    saved["blocks"] = {key: "Q5_K" for key in saved["blocks"]}
    manifest.write_text(json.dumps(saved))
    with pytest.raises(LoadError, match="Q5_K"):
        eaglejax.load_target(str(tmp_path / "int4-ck"))
    assert main(["convert", str(path), str(tmp_path / "gguf-ck"),
                 "--quantize", "gguf"]) != 0  # nothing saved is overwritten


# a Q4_K_M-like mix: layer 0 Q4_K but w_down Q6_K; layer 1 Q6_K but v_proj Q4_K (q/k/v then
# differ: their fused matrix is kept in parts) and up_proj Q5_K (a kind not kept: gate/up
# widened); the embedding Q4_K, the output head Q6_K
K_KINDS = {"token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K,
           "blk.1.attn_v.weight": Q.Q4_K, "blk.1.ffn_up.weight": Q.Q5_K}
for _name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
    K_KINDS.setdefault(f"blk.0.{_name}.weight", Q.Q4_K)
    K_KINDS.setdefault(f"blk.1.{_name}.weight", Q.Q6_K)


def write_kquant_gguf(path):
    """(path, HF config, HF tensors as the file's dequantized values) of a random llama of
    width 256 whose matrices are random Q4_K / Q6_K super-blocks as K_KINDS says (w_down's
    K = 512: two super-blocks)."""
    cfg, sd = _hf_model("llama", seed=6, hidden_size=256, intermediate_size=512)
    rng = np.random.default_rng(6)
    raw = {}
    for hf, value in sd.items():
        name = _gguf_name(hf)
        if name in K_KINDS:
            raw[name] = (kquant_bytes(K_KINDS[name].name, *value.shape, rng), K_KINDS[name])
    _write_tiny(path, "llama", cfg, sd, permute=True, q8=False, raw=raw)
    return path, cfg, read_gguf(path).tensors


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    return write_kquant_gguf(tmp_path_factory.mktemp("kquants") / "tiny-kquants.gguf")


def test_kquant_blocks_are_the_files_values_and_bad_data_is_named(kquant_gguf, tmp_path):
    """Q4_K and Q6_K matrices are kept as stored and dequantize to exactly the `gguf`
    package's values (through the packed layout and an embedding lookup too); a fused matrix
    of both kinds is kept in parts, one with a Q5_K part widened; a K-quant tensor whose bytes
    do not fit its shape is refused naming the file and the tensor."""
    path, cfg, want = kquant_gguf
    target = eaglejax.load_target(path, weight_dtype="gguf")
    assert target.storage == "Q4_K + Q6_K blocks"
    float_target = eaglejax.load_target(path)
    expect = {(0, "wqkv"): "Q4_K", (0, "w_gate_up"): "Q4_K", (0, "w_down"): "Q6_K",
              (1, "wo"): "Q6_K", (1, "w_down"): "Q6_K", (1, "wqkv"): "Q6_Kx3+Q4_Kx1@1",
              (1, "w_gate_up"): None}
    _assert_kept(target, float_target, expect)
    assert (target.params["embed"].kind, target.params["lm_head"].kind) == ("Q4_K", "Q6_K")
    for key in ("embed", "lm_head"):
        np.testing.assert_array_equal(target.params[key].dequantized(), float_target.params[key])
    ids = jnp.array([[0, 7, 319], [18, 3, 200]])
    np.testing.assert_array_equal(target.params["embed"].rows(ids),
                                  want["model.embed_tokens.weight"][np.asarray(ids)])

    cfg_b, sd = _hf_model("llama", seed=6, hidden_size=256, intermediate_size=512)
    rng = np.random.default_rng(1)
    short = kquant_bytes("Q6_K", 128, 1024, rng)  # the bytes of [128, 1024], not [256, 512]
    _write_tiny(tmp_path / "bad.gguf", "llama", cfg_b, sd, permute=True, q8=False,
                raw={"blk.0.ffn_down.weight": (short, Q.Q6_K)})
    with pytest.raises(LoadError, match=r"bad\.gguf: tensor 'blk\.0\.ffn_down\.weight' .*Q6_K"):
        eaglejax.load_target(tmp_path / "bad.gguf", weight_dtype="gguf")


def test_kquant_model_matches_transformers_computing_it(kquant_gguf):
    """The oracle of `test_blocks_match_transformers_computing_them` for the K-quant file:
    transformers with its dequantized weights and int8-rounded inputs (blocks of 32) to every
    product kept in blocks."""
    _check_against_rounding_oracle(kquant_gguf, ("layers.1.mlp.gate_proj",
                                                 "layers.1.mlp.up_proj"))


def test_kquant_checkpoints_reload_as_stored(kquant_gguf, tmp_path):
    """Q4_K and Q6_K blocks saved (`Target.save`, `eaglejax convert --quantize gguf`) reload
    bit for bit under None, "auto" and "gguf", and load onto a mesh."""
    from eaglejax.cli import main

    path, _, _ = kquant_gguf
    blocks = eaglejax.load_target(path, weight_dtype="gguf")
    blocks.save(str(tmp_path / "saved"))
    assert main(["convert", str(path), str(tmp_path / "ck"), "--quantize", "gguf"]) == 0
    ids = [[5, 6, 7, 8, 9, 10]]
    want = np.asarray(blocks.logits(ids))
    for directory, weight_dtype in (("saved", None), ("ck", "auto"), ("ck", "gguf")):
        got = eaglejax.load_target(str(tmp_path / directory), weight_dtype=weight_dtype)
        assert got.storage == "Q4_K + Q6_K blocks"
        pairs = list(zip(jax.tree.leaves(got.params), jax.tree.leaves(blocks.params)))
        assert len(pairs) == len(jax.tree.leaves(blocks.params))
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in pairs)
    np.testing.assert_array_equal(got.logits(ids), want)
    on_mesh = eaglejax.load_target(str(tmp_path / "ck"), mesh=eaglejax.make_mesh(tp=1, dp=1))
    assert on_mesh.storage == "Q4_K + Q6_K blocks"
    np.testing.assert_array_equal(on_mesh.logits(ids), want)
