"""Bad input gets an eaglejax error naming the cause; the CLI prints one line and exits 2."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import eaglejax
from eaglejax import ConfigError, InputError, LoadError, cli
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


# --------------------------------------------------------------------------------------------
# Bad arguments are refused by name before any model is loaded or any file is written.

import dataclasses  # noqa: E402
import importlib  # noqa: E402

import tokenizers  # noqa: E402

from eaglejax.decoding.stopping import StopCriteria  # noqa: E402
from eaglejax.tokenizer import Tokenizer  # noqa: E402

generate_module = importlib.import_module("eaglejax.generate")


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if generate() or the CLI tries to load a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(generate_module, "_cached_target", refuse)
    monkeypatch.setattr(eaglejax, "load_target", refuse)
    monkeypatch.setattr(cli, "load_target", refuse)  # the CLI holds its own reference


@pytest.mark.parametrize("prompts,kwargs,match", [
    ([[1, 2]], dict(seed=2**32), r"seed must lie in \[0, 2\*\*32\)"),
    ([[1, 2]], dict(seed=-1), r"seed must lie in \[0, 2\*\*32\)"),
    ([[1, 2], [3]], dict(seed=[0, 2**40]), r"seed\[1\] must lie in"),
    ([[1, 2]], dict(seed=True), "seed must be an int"),
    ([[1.7, 2]], {}, "prompt 0: token ids must be integers, got 1.7"),
    ([[1, 2], [True, 2]], {}, "prompt 1: token ids must be integers, got True"),
    ([["a"]], {}, "prompt 0: token ids must be integers"),
    ([None], {}, "prompt 0 must be a string or a list of token ids"),
    (b"hello", {}, "prompts are bytes"),
    (["hi", b"hello"], {}, "prompt 1 is bytes"),
    ([5], {}, "prompt 0 is a single integer"),
    (np.array([1, 2, 3]), {}, r"prompts: an array of token ids must be 2-D"),
    (np.array([[1.0, 2.0]]), {}, "prompt 0 must be a 1-D integer array"),
    ([np.array([1.0, 2.0])], {}, "prompt 0 must be a 1-D integer array"),
    ([np.array([True, False])], {}, "prompt 0 must be a 1-D integer array"),
    (["\ud800"], {}, "prompt 0 is not valid Unicode"),
    (["ok", "a\udcffb"], dict(chat=False), "prompt 1 is not valid Unicode"),
    ([[1, 2]], dict(stop=123), "stop must be a string or a list of strings"),
    ([[1, 2]], dict(stop=[""]), "stop strings must be non-empty"),
    ([[1, 2]], dict(stop="\ud800"), "stop is not valid Unicode"),
    ([[1, 2]], dict(top_k=10**12), "top_k must be an integer in"),
    ([[1, 2]], dict(top_k=True), "top_k must be an integer in"),
    ([[1, 2]], dict(top_k=np.float64(4)), "top_k must be an integer in"),
    ([[1, 2]], dict(temperature=float("inf")), "temperature must be a finite number"),
    ([[1, 2]], dict(temperature=float("nan")), "temperature must be a finite number"),
    ([[1, 2]], dict(temperature=1e300), "temperature must be a finite number"),
    ([[1, 2]], dict(temperature=10**400), "temperature must be a finite number"),
    ([[1, 2]], dict(temperature=np.bool_(True)), "temperature must be a finite number"),
    ([[1, 2]], dict(top_p=float("nan")), "top_p must be a finite number"),
    ([[1, 2]], dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    ([[1, 2]], dict(max_new_tokens=2.0), "max_new_tokens must be an integer"),
    ([[1, 2]], dict(chat="no"), "chat must be True or False"),
    ([[1, 2]], dict(ignore_eos=1), "ignore_eos must be True or False"),
    ([[1, 2]], dict(target=5), "target must be a Target"),
    ([[1, 2]], dict(draft="head-dir"), "draft must be a Draft"),
    ([[1, 2]], dict(speculative="bogus"), "speculative must be a SpecConfig"),
    ([[1, 2]], dict(speculative=eaglejax.SpecConfig.chain(3)),
     r"speculative \(chain K=3\) drafts with a draft head: pass draft=eaglejax.load_draft"),
])
def test_generate_refuses_bad_arguments_before_loading(prompts, kwargs, match, no_model_loading):
    with pytest.raises(InputError, match=match):
        eaglejax.generate(prompts, **kwargs)


def test_numpy_integers_are_token_ids_seeds_and_counts(target_of):
    target = target_of("llama")
    sampled = dict(temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=4)
    expected = eaglejax.generate([[1, 2, 3], [4, 5, 6]], target=target, seed=[5, 6], **sampled)
    for prompts, seed in [(np.array([[1, 2, 3], [4, 5, 6]], np.int32), np.array([5, 6])),
                          ([np.array([1, 2, 3]), [np.int64(4), np.uint8(5), 6]],
                           [np.uint32(5), np.int16(6)])]:
        got = eaglejax.generate(prompts, target=target, seed=seed,
                                **{**sampled, "max_new_tokens": np.int64(4),
                                   "top_k": np.int32(20), "temperature": np.float32(0.9)})
        assert [g.token_ids for g in got] == [e.token_ids for e in expected]


@pytest.mark.parametrize("token_ids,match", [
    ([[1.0, 2]], "token_ids row 0: token ids must be integers, got 1.0"),
    ([[1, True]], "token_ids row 0: token ids must be integers, got True"),
    ([1, False], "token_ids row 0: token ids must be integers, got False"),
    ([[None]], "token_ids row 0: token ids must be integers, got None"),
    ([[1], [1, 2]], "rows have different lengths"),
    (np.array([[0.5, 1.0]]), "must be a 1-D integer array"),
    (np.array([[True]]), "must be a 1-D integer array"),
    ([[2**70]], "outside the vocabulary"),
    (np.array([[1, 97]], np.uint64), "outside the vocabulary"),
    ("abc", r"token_ids must be a \[batch, length\]"),
])
def test_target_refuses_non_integer_token_ids(token_ids, match, target_of):
    with pytest.raises(InputError, match=match):
        target_of("llama").logits(token_ids)


def test_target_takes_numpy_integer_ids_like_lists(target_of):
    target = target_of("llama")
    expected = np.asarray(target.logits([[1, 2, 3]]))
    for ids in (np.array([[1, 2, 3]], np.int16), np.array([1, 2, 3], np.uint64),
                [np.int64(1), np.int8(2), 3]):
        np.testing.assert_array_equal(np.asarray(target.logits(ids)), expected)


def _word_tokenizer(template: str) -> Tokenizer:
    """A tiny word-level tokenizer (ids below the test models' vocabulary of 97)."""
    words = ["[UNK]", "hello", "world", "skip"]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return Tokenizer(backend, chat_template=template, unk_token="[UNK]")


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{% if m.content != 'skip' %}{{ m.content }}{% endif %}{% endfor %}",
    "{% for m in messages %}{% if m.content != 'skip' %}{{ m.content }}{% else %}  \n"
    "{% endif %}{% endfor %}",
])
def test_chat_template_rendering_nothing_is_refused(template, target_of):
    target = dataclasses.replace(target_of("llama"), tokenizer=_word_tokenizer(template))
    assert target.tokenizer.render_prompt("hello world", chat=True) == [1, 2]
    with pytest.raises(InputError, match="prompt 1: .*chat template renders this prompt to"):
        eaglejax.generate(["hello", "skip"], target=target)


def test_stop_string_without_tokens_is_refused(target_of):
    target = dataclasses.replace(target_of("llama"), tokenizer=_word_tokenizer("{{ '' }}"))
    with pytest.raises(InputError, match="stop string ' ' encodes to no tokens"):
        eaglejax.generate([[1, 2]], target=target, stop=[" "])
    with pytest.raises(InputError, match="stop sequence"):
        StopCriteria((), ((1,), ()))


def test_tokenizer_refuses_lone_surrogates():
    with pytest.raises(InputError, match="text is not valid Unicode: lone surrogate"):
        _word_tokenizer("{{ '' }}").encode("hello \ud800")


def test_draft_without_target_uses_the_drafts_target(target_of, no_model_loading):
    from eaglejax.draft.draft import new_eagle3_draft

    target = target_of("llama")
    draft = new_eagle3_draft(target)
    spec = eaglejax.generate([[1, 2, 3]], draft=draft, max_new_tokens=3,
                             speculative=eaglejax.SpecConfig.chain(2))
    plain = eaglejax.generate([[1, 2, 3]], target=target, max_new_tokens=3)
    assert spec[0].token_ids == plain[0].token_ids


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """Run the CLI in this process: exit status and stderr (argparse errors exit directly)."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


_TRAIN = ["train-draft", "--data", "README.md"]


@pytest.mark.parametrize("argv,flag", [
    (["generate", "hi", "--seed", "-1"], "--seed must lie in [0, 2**32)"),
    (["generate", "hi", "--seed", str(2**32)], "--seed must lie in [0, 2**32)"),
    (["generate", "hi", "--seed", "x"], "argument --seed: invalid int value"),
    (["generate", "hi", "--temperature", "inf"], "--temperature must be a finite number"),
    (["generate", "hi", "--temperature", "nan"], "--temperature must be a finite number"),
    (["generate", "hi", "--top-k", str(10**12)], "--top-k must be an integer"),
    (["generate", "hi", "--top-p", "0"], "--top-p must be a finite number in (0, 1]"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be an integer"),
    (["generate", "hi", "--stop", ""], "--stop strings must be non-empty"),
    (["generate", "hi", "--stop", "\udcff"], "--stop is not valid Unicode"),
    (["generate", "hi", "\udcff"], "prompt 1 is not valid Unicode"),
    (["generate", "hi", "  "], "prompt 1 is empty"),
    (["generate", "hi", "--num-draft-tokens", "3"], "--num-draft-tokens needs --draft"),
    (["generate", "hi", "--tree", "4,4,12"], "--tree needs --draft"),
    (["generate", "hi", "--static-tree", "[[0]]"], "--static-tree needs --draft"),
    (["generate", "hi", "--auto-tree"], "--auto-tree needs --draft"),
    (["generate", "hi", "--draft", "x", "--draft-model", "y"],
     "--draft and --draft-model exclude each other"),
    (["generate", "hi", "--suffix", "--no-draft"], "--suffix and --no-draft exclude each other"),
    (["generate", "hi", "--suffix", "4,6"], "--suffix wants TOP_K,DEPTH,TOTAL (3 integers)"),
    (["generate", "hi", "--suffix", "4,6,12,9"], "min_match must be an integer in [1, 8], "
                                                 "got 9"),
    (["generate", "hi", "--suffix", "auto", "--lookup", "3"], "--lookup needs the shape it "
                                                              "extends"),
    (["generate", "hi", "--draft-model", "y", "--parallel", "3"],
     "parallel K=3: a draft model drafts chains and dynamic trees only"),
    (["bench", "--draft-model", "y", "--suffix"], "--draft-model and --suffix exclude each other"),
    (["serve", "--draft", "x", "--suffix"], "--draft and --suffix exclude each other"),
    (["generate", "hi", "--draft", "random", "--no-draft"], "--draft and --no-draft exclude"),
    (["generate", "hi", "--draft", "random", "--tree", "4,4"], "--tree wants TOP_K,DEPTH,TOTAL"),
    (["generate", "hi", "--draft", "/no/such/head"], "--draft: /no/such/head: no such file"),
    (["bench", "--seed", str(2**32)], "--seed must lie in [0, 2**32)"),
    (["bench", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["bench", "--batch-size", "0"], "--batch-size must be an integer"),
    (["bench", "--num-prompts", "0"], "--num-prompts must be an integer"),
    (["bench", "--num-prompts", "81"], "--num-prompts 81: the questions file has only 80"),
    (["bench", "--auto-tree"], "--auto-tree needs --draft"),
    (["bench", "--questions", "/no/such.jsonl"], "/no/such.jsonl: MT-bench question file"),
    (["convert", "/no/such/head", "{tmp}/out", "--target", "x"], "SRC: /no/such/head"),
    (["convert", "{tmp}", "{tmp}", "--target", "x"], "already exists and is not empty"),
    (_TRAIN + ["--out", "{tmp}/run", "--seed", str(2**32)], "--seed must lie in [0, 2**32)"),
    (_TRAIN + ["--out", "{tmp}/run", "--seed", "-5"], "--seed must lie in [0, 2**32)"),
    (_TRAIN + ["--out", "{tmp}/run", "--lr", "inf"], "--lr must be a finite number > 0"),
    (_TRAIN + ["--out", "{tmp}/run", "--steps", "0"], "--steps must be an integer"),
    (_TRAIN + ["--out", "{tmp}/run", "--regen-temperature", "nan"], "--regen-temperature"),
    (_TRAIN + ["--out", "{tmp}/run", "--init-head", "/no/head"], "--init-head: /no/head"),
    (_TRAIN + ["--out", "README.md"], "--out: README.md exists and is not a directory"),
    (["train-draft", "--data", "/no/data.jsonl", "--out", "{tmp}/run"], "--data: /no/data"),
])
def test_cli_refuses_bad_arguments_in_one_line_before_loading(argv, flag, tmp_path, capsys,
                                                              no_model_loading):
    (tmp_path / "keep").write_text("a user's file")
    before = sorted(tmp_path.rglob("*"))
    code, err = _cli([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("eaglejax: error: ")
    assert flag in err
    assert sorted(tmp_path.rglob("*")) == before  # no run folder, no output written


@pytest.mark.parametrize("dest", sorted(cli._TRAIN_FLAGS))
def test_train_flags_take_their_bounds_from_the_config_fields(dest, tmp_path, capsys,
                                                               no_model_loading):
    """A value just past a config field's bound: the dataclass and its flag refuse it with
    the same words (the field's name, the flag's), since the bound lives in one place."""
    from eaglejax.validation import cli_flag

    cls, name = cli._TRAIN_FLAGS[dest]
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    kind, low, _, low_open = field.metadata["bounds"]
    bad = -1 if kind == "seed" else low if low_open else low - 1
    with pytest.raises(InputError) as refused:
        cls(**{name: bad})
    code, err = _cli(_TRAIN + ["--out", str(tmp_path / "run"), cli_flag(dest), str(bad)], capsys)
    assert code == 2
    assert str(refused.value).replace(name, cli_flag(dest), 1) in err


def test_cli_train_draft_bad_seed_exits_2_without_a_run_folder(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "eaglejax.cli", "train-draft", "--data",
                           "README.md", "--out", str(out), "--seed", str(2**32)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["eaglejax: error: --seed must lie in "
                                                "[0, 2**32), got 4294967296"]
    assert not out.exists()


@pytest.mark.parametrize("kwargs, named", [
    (dict(dtype="bogus"), "dtype"), (dict(dtype="int8"), "dtype"),
    (dict(weight_dtype="float64"), "weight_dtype"), (dict(weight_dtype=3), "weight_dtype"),
])
def test_load_target_refuses_bad_dtypes_before_loading(kwargs, named):
    with pytest.raises(InputError, match=named):
        eaglejax.load_target("/tmp/no-such-model", **kwargs)  # checked before the path


@pytest.mark.parametrize("path", [None, 5, ["a"]])
def test_load_target_refuses_what_is_not_a_path(path):
    with pytest.raises(InputError, match="model name or path"):
        eaglejax.load_target(path)


@pytest.mark.parametrize("layer_ids", ["a", [1.5], [True], [], [99]])
def test_features_refuses_bad_layer_ids(layer_ids, target_of):
    with pytest.raises(InputError, match="layer_ids"):
        target_of("llama").features([[1, 2, 3]], layer_ids=layer_ids)


def test_jax_token_arrays_are_accepted(target_of):
    import jax.numpy as jnp

    target = target_of("llama")
    ids = [[1, 2, 3], [4, 5, 6]]
    want = np.asarray(target.logits(ids))
    assert np.array_equal(np.asarray(target.logits(jnp.asarray(ids))), want)
    assert np.array_equal(np.asarray(target.features(jnp.asarray(ids, jnp.int32))),
                          np.asarray(target.features(ids)))
    with pytest.raises(InputError, match="token_ids"):
        target.logits(jnp.asarray([[1.5, 2.0]]))
