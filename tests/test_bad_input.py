"""Bad input gets an eaglejax error naming the cause; the CLI prints one line and exits 2."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import eaglejax
from eaglejax import ConfigError, InputError, LoadError
from eaglejax.cli import main


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path():
    with pytest.raises(LoadError, match="no-such-model"):
        eaglejax.load_target("/tmp/no-such-model")


def test_unknown_architecture(tmp_path, hf_family):
    d = _copy(hf_family("llama")[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="gpt2"):
        eaglejax.load_target(d)


def test_truncated_safetensors(tmp_path, hf_family):
    d = _copy(hf_family("llama")[0], tmp_path / "m")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(LoadError, match="truncated"):
        eaglejax.load_target(d)


def test_corrupt_safetensors_header(tmp_path, hf_family):
    d = _copy(hf_family("llama")[0], tmp_path / "m")
    weights = d / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[8:16] = b"\xff" * 8
    weights.write_bytes(bytes(raw))
    with pytest.raises(LoadError, match="model.safetensors"):
        eaglejax.load_target(d)


def test_weights_that_do_not_match_the_config(tmp_path, hf_family):
    d = _copy(hf_family("llama")[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=r"mlp\..*_proj\.weight.*shape"):
        eaglejax.load_target(d)


def test_missing_tensor(tmp_path, hf_family):
    d = _copy(hf_family("llama")[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match="model.layers.3"):
        eaglejax.load_target(d)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(seed=[1, 2]), "seed"),
    (dict(seed=None), "seed must be an int"),
    (dict(seed=[1.5]), "seed must be an int"),
])
def test_invalid_generation_arguments(kwargs, match, target_of):
    with pytest.raises(InputError, match=match):
        eaglejax.generate([[1, 2, 3]], target=target_of("llama"), **kwargs)


def test_empty_prompts(target_of):
    target = target_of("llama")
    with pytest.raises(InputError, match="prompt 1 is empty"):
        eaglejax.generate([[1, 2], []], target=target)
    with pytest.raises(InputError, match="non-empty"):
        eaglejax.generate([], target=target)


def test_prompt_longer_than_context(target_of):
    target = target_of("llama")  # max_position_embeddings 512
    with pytest.raises(InputError, match="context of 512"):
        eaglejax.generate([[1] * 500], target=target, max_new_tokens=20)


def test_token_ids_outside_vocabulary(target_of):
    with pytest.raises(InputError, match="outside the vocabulary"):
        eaglejax.generate([[1, 500]], target=target_of("llama"))
    with pytest.raises(InputError, match="token_ids"):
        target_of("llama").logits(np.array([[1, 97]]))


def test_text_prompt_without_tokenizer(target_of):
    with pytest.raises(InputError, match="no tokenizer"):
        eaglejax.generate("hello", target=target_of("llama"))


def test_cli_prints_one_line_and_exits_2(capsys):
    assert main(["generate", "hi", "--model", "/tmp/no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eaglejax: error:") and "no-such-model" in err
    assert len(err.splitlines()) == 1


def test_cli_subprocess_exit_code_for_bad_sampling(tmp_path, hf_family):
    proc = subprocess.run([sys.executable, "-m", "eaglejax.cli", "generate", "hi", "--model",
                           str(hf_family("llama")[0]), "--top-p", "2"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "--top-p" in proc.stderr
