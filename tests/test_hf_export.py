"""`export_hf` and `eaglejax convert --to hf`: targets written as Hugging Face directories,
read back by transformers (model, config, tokenizer) and by eaglejax."""

from __future__ import annotations

import dataclasses
import json

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from hf_oracle import hf_greedy, hf_logits, make_hf_model
from tolerances import FORWARD_UNITS, assert_close_scaled
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import eaglejax
from eaglejax.cli import main as cli_main
from eaglejax.config import ModelConfig
from eaglejax.errors import ConfigError, InputError
from eaglejax.loading.hf_dir import HFWeights
from eaglejax.loading.hf_export import export_hf
from eaglejax.models.llama import init_params
from eaglejax.target import Target
from eaglejax.tokenizer import Tokenizer

PROMPT = "What is the capital of France?"  # answered in 8 tokens, <|im_end|> included
TEXTS = ["Hello, world!", "12345 + 678 = 13023; 3.14e-10", "x  1 and\t\t7\n\n9",
         "naïve café — “quotes” 日本語 😀", "<|im_start|>user\nHi<|im_end|>\n", "   "]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another, in 日本語 please."}],
]
# What a Hugging Face config says about the model; bos_token_id is not among them: a
# target loaded from a directory without a tokenizer does not keep it.
CONFIG_FIELDS = ("model_type", "architectures", "vocab_size", "hidden_size",
                 "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                 "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
                 "attention_bias", "sliding_window", "eos_token_id")


def _config_fields(directory) -> dict:
    config = AutoConfig.from_pretrained(directory)
    return {key: getattr(config, key, None) for key in CONFIG_FIELDS}


def _tensors(directory) -> dict[str, np.ndarray]:
    weights = HFWeights(directory)
    return {name: np.asarray(weights.get(name)) for name in weights.shapes()}


# ---------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_export(tmp_path_factory):
    """The built-in SmolLM2 written once by the CLI (float32 on CPU, about 540 MB)."""
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    assert cli_main(["convert", "smollm2-135m-instruct", str(out), "--to", "hf"]) == 0
    return out


@pytest.fixture(scope="module")
def smollm2_exported_model(smollm2_export):
    return AutoModelForCausalLM.from_pretrained(smollm2_export, dtype=torch.float32).eval()


@pytest.mark.slow
def test_smollm2_export_files_and_config(smollm2_export, smollm2):
    names = {p.name for p in smollm2_export.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"}
    config = json.loads((smollm2_export / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert ModelConfig.from_hf_dict(config) == smollm2.config
    assert json.loads((smollm2_export / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tensors = _tensors(smollm2_export)
    assert "lm_head.weight" not in tensors  # tied
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"],
                                  np.asarray(smollm2.params["embed"]))


@pytest.mark.slow
def test_smollm2_export_runs_in_transformers_like_eaglejax(smollm2_export, smollm2,
                                                           smollm2_exported_model):
    """Logits of the exported model in transformers (float32) within float32 noise of
    eaglejax's, and the same greedy continuation. The bound is test_smollm2's for eaglejax
    vs transformers reading the GGUF itself: logits reach about 40 and the residual stream
    25,000, so rounding through 30 layers differs by 4 to 6 units of eps * max|logit| *
    sqrt(30) = 2.6e-5 (4.0 units here); 40 units (1.05e-3) is far below a layout error:
    q/k rows left in llama.cpp's interleaved RoPE order are 1.3 million units off."""
    model = smollm2_exported_model
    ids = np.array([smollm2.tokenizer.render_prompt(PROMPT, chat=True)])
    assert_close_scaled(np.asarray(smollm2.logits(ids)), hf_logits(model, ids),
                        units=FORWARD_UNITS, depth=smollm2.config.num_layers)
    ours = eaglejax.generate(PROMPT, target=smollm2, max_new_tokens=16, ignore_eos=True)[0]
    assert hf_greedy(model, ids[0].tolist(), 16) == ours.token_ids
    # With the exported generation_config.json transformers stops where eaglejax stops.
    stop = next(i for i, t in enumerate(ours.token_ids) if t in smollm2.eos_token_ids)
    with torch.no_grad():
        out = model.generate(torch.as_tensor(ids), max_new_tokens=16, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == ours.token_ids[:stop + 1]


@pytest.mark.slow
def test_smollm2_export_tokenizer_matches_eaglejax(smollm2_export, smollm2):
    ours, hf = smollm2.tokenizer, AutoTokenizer.from_pretrained(smollm2_export)
    for text in TEXTS:
        for special in (False, True):
            assert hf.encode(text, add_special_tokens=special) == ours.encode(text, special)
        ids = ours.encode(text)
        assert hf.decode(ids, skip_special_tokens=False) == ours.decode(ids, False)
    for messages in CONVERSATIONS:
        for add in (True, False):
            assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add) \
                == ours.apply_chat_template(messages, add_generation_prompt=add)
    rendered = hf.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                      add_generation_prompt=True)
    assert hf.encode(rendered, add_special_tokens=False) == ours.render_prompt(PROMPT, chat=True)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)
    assert len(hf) == ours.vocab_size
    assert Tokenizer.from_hf_dir(smollm2_export).eos_token_ids == ours.eos_token_ids


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3", "tied"])
def test_transformers_model_round_trips_exactly(family, hf_family, tmp_path):
    """transformers saves -> eaglejax loads -> export: every tensor and config field equal
    (GQA, Llama-3 RoPE scaling, Qwen2 biases, Qwen3 q/k norms and head_dim 32, tied)."""
    source, _ = hf_family(family)
    target = eaglejax.load_target(source)
    out = export_hf(target, tmp_path / "hf")
    want, got = _tensors(source), _tensors(out)
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype == np.float32, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert _config_fields(out) == _config_fields(source)
    again = eaglejax.load_target(out)
    assert again.config == target.config
    ids = np.random.RandomState(0).randint(0, 97, size=(1, 12))
    np.testing.assert_array_equal(np.asarray(again.logits(ids)), np.asarray(target.logits(ids)))


def test_mistral_sliding_window_round_trips(tmp_path):
    model = make_hf_model("mistral", tmp_path / "src", seed=3, sliding_window=64)
    target = eaglejax.load_target(tmp_path / "src")
    assert target.config.sliding_window == 64
    out = export_hf(target, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert "layer_types" not in config  # transformers would read the model as Ministral
    assert _config_fields(out) == _config_fields(tmp_path / "src")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(exported) is type(model)
    want, got = model.state_dict(), exported.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_sharded_export_loads_in_transformers_and_eaglejax(hf_family, target_of, tmp_path):
    _, model = hf_family("qwen2")
    out = export_hf(target_of("qwen2"), tmp_path / "hf", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(
        4 * p.numel() for p in model.state_dict().values())
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, value in model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value), name
    assert eaglejax.load_target(out).config == target_of("qwen2").config


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16),
                                               ("float16", torch.float16)])
def test_16_bit_export_is_the_rounded_weights(dtype, torch_dtype, hf_family, target_of,
                                              tmp_path):
    """Each tensor is its float32 value rounded once to the nearest 16-bit value, as
    PyTorch rounds it; transformers then loads the model in that dtype by default."""
    _, model = hf_family("llama")
    out = export_hf(target_of("llama"), tmp_path / "hf", dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == dtype
    exported = AutoModelForCausalLM.from_pretrained(out)
    for name, param in exported.state_dict().items():
        assert param.dtype == torch_dtype, name
        assert torch.equal(param, model.state_dict()[name].to(torch_dtype)), name


def test_bias_only_on_qkv_exports_a_zero_o_proj_bias(tmp_path):
    """A Llama with q/k/v biases (possible from GGUF) has no o_proj bias; transformers'
    `attention_bias` adds one to o_proj too, written as zeros: the logits agree."""
    config = ModelConfig("llama", vocab_size=97, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         attention_bias=True)
    params = init_params(config, jax.random.PRNGKey(0), scale=0.08)
    params["layers"] = [{**layer, "bqkv": layer["bqkv"] + 0.1} for layer in params["layers"]]
    target = Target(config, params, None, "synthetic", (2,))
    out = export_hf(target, tmp_path / "hf")
    assert not _tensors(out)["model.layers.1.self_attn.o_proj.bias"].any()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = np.random.RandomState(1).randint(0, 97, size=(2, 24))
    assert_close_scaled(np.asarray(target.logits(ids)), hf_logits(model, ids),
                        units=FORWARD_UNITS, depth=config.num_layers)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


# ---------------------------------------------------------------------------- refusals


def test_export_refuses_a_non_empty_directory(target_of, tmp_path):
    (tmp_path / "keep").write_text("a user's file")
    with pytest.raises(InputError, match=f"path: {tmp_path} already exists and is not empty"):
        export_hf(target_of("llama"), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]


def test_export_refuses_a_bad_dtype_or_a_biased_mistral(target_of, tmp_path):
    with pytest.raises(InputError, match="dtype must be one of"):
        export_hf(target_of("llama"), tmp_path / "a", dtype="int8")
    target = target_of("mistral")
    biased = dataclasses.replace(target.config, attention_bias=True)
    with pytest.raises(ConfigError, match="Mistral model with attention biases"):
        export_hf(dataclasses.replace(target, config=biased), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr("eaglejax.cli.load_target", refuse)


@pytest.mark.parametrize("argv,message", [
    (["convert", "llama", "{tmp}", "--to", "hf"], "DST: {tmp} already exists and is not empty"),
    (["convert", "llama", "{tmp}/out", "--to", "hf", "--target", "llama"],
     "--target is not used with --to hf"),
    (["convert", "/no/such/model", "{tmp}/out", "--to", "hf"], "SRC: /no/such/model"),
    (["convert", "{tmp}", "{tmp}/out"], "--target is required with --to eaglejax"),
    (["convert", "{tmp}", "{tmp}/out", "--to", "speculators"],
     "--target is required with --to speculators"),
])
def test_cli_refusals_name_the_argument(argv, message, hf_family, tmp_path, capsys,
                                        no_loading):
    (tmp_path / "keep").write_text("a user's file")
    source = str(hf_family("llama")[0])
    argv = [source if a == "llama" else a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("eaglejax: error: ") and len(err.strip().splitlines()) == 1
    assert message.replace("{tmp}", str(tmp_path)) in err
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]


def test_cli_exports_an_eaglejax_checkpoint(hf_family, target_of, tmp_path, capsys):
    """`convert CHECKPOINT DST --to hf --dtype bfloat16` (the SmolLM2 fixture runs the
    built-in name through the CLI in float32)."""
    _, model = hf_family("tied")
    target_of("tied").save(tmp_path / "ckpt")
    out = tmp_path / "hf"
    argv = ["convert", str(tmp_path / "ckpt"), str(out), "--to", "hf", "--dtype", "bfloat16"]
    assert cli_main(argv) == 0
    assert "Hugging Face layout; llama, 3 layers, vocab 97, bfloat16" in capsys.readouterr().out
    tensors = _tensors(out)
    assert "lm_head.weight" not in tensors
    for name, value in model.state_dict().items():
        if name != "lm_head.weight":
            want = value.numpy().astype(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(tensors[name], want, err_msg=name)
