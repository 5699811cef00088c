"""Tokenizer: GGUF-built and Hugging Face directory tokenizers against transformers."""

from __future__ import annotations

import json
import re

import gguf
import pytest
import tokenizers

from eaglejax.errors import InputError, LoadError
from eaglejax.loading.gguf_file import read_gguf_metadata
from eaglejax.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "12345 + 678 = 13023; 3.14159e-10 and 1,000,000",
    "x  1",
    "      42",
    "a\t\t7 and\n\n9",
    "  leading\tand\ttabs\n\n\nnewlines   trailing   ",
    "naïve café — “quotes” 日本語 한국어 Ελληνικά 😀 Ω≈ç√",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's fine, don't you think? We've SEEN it.",
    "\u00a0nbsp and \u200bzero width",
    "a\r\nb",
    "",
    "   ",
]
# transformers' GGUF converter does not know llama.cpp's `smollm` pre-tokenizer and leaves
# out its digit split; the two differ only where a whitespace run meets a digit.
_WS_DIGIT = re.compile(r"\s{2,}\d")

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 please."},
    ],
]


@pytest.fixture(scope="module")
def metadata(smollm_path):
    return read_gguf_metadata(smollm_path)


@pytest.fixture(scope="module")
def ours(metadata, smollm_path):
    return Tokenizer.from_gguf_metadata(metadata, source=str(smollm_path))


@pytest.fixture(scope="module")
def hf(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


# ---------------------------------------------------------------------------- SmolLM2 GGUF


def test_encode_decode_match_transformers(ours, hf):
    compared = 0
    for text in TEXTS:
        ids = ours.encode(text)
        if not _WS_DIGIT.search(text):
            assert ids == hf.encode(text, add_special_tokens=False), text
            compared += 1
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        if "<|" not in text:
            assert ours.decode(ids) == text
    assert compared >= 10


def test_digits_split_like_smollm2_tokenizer_json(ours, hf):
    # SmolLM2's own tokenizer.json (HuggingFaceTB/SmolLM2-135M-Instruct) pins this
    # pre-tokenizer; llama.cpp's `smollm` splits "\p{N}" first, then the GPT-2 regex, too.
    ref = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
    ref.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    assert [ours.id_to_token(i) for i in ours.encode("x  1")] == ["x", "ĠĠ", "1"]
    assert [ours.id_to_token(i) for i in ours.encode(" 2024")] == ["Ġ", "2", "0", "2", "4"]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, add_generation_prompt):
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_special_ids(ours):
    assert ours.eos_token_ids == (2,)  # <|im_end|>: EOS and the chat end of turn
    assert ours.id_to_token(2) == "<|im_end|>"
    assert ours.bos_token_id == 1 and ours.pad_token_id == 2 and ours.eos_token_id == 2
    assert ours.vocab_size == 49152
    assert ours.add_bos_token is False


def test_render_prompt(ours, hf):
    text = "What is 17 * 3?"
    rendered = hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                      add_generation_prompt=True)
    assert ours.render_prompt(text, chat=True) == hf.encode(rendered, add_special_tokens=False)
    assert ours.render_prompt(text, chat=True)[:1] == [1]  # <|im_start|>
    assert ours.render_prompt(text, chat=False) == hf.encode(text, add_special_tokens=True)
    assert ours.render_prompt(text, chat=False) == ours.encode(text)  # SmolLM2 adds no BOS


def test_save_and_reload(ours, tmp_path):
    ours.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"tokenizer.json", "tokenizer_config.json"}
    again = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text), text
        assert again.encode(text, add_special_tokens=True) == ours.encode(text, add_special_tokens=True)
        assert again.decode(ours.encode(text), skip_special_tokens=False) == ours.decode(
            ours.encode(text), skip_special_tokens=False)
    for messages in CONVERSATIONS:
        assert again.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert again.eos_token_ids == ours.eos_token_ids
    assert (again.bos_token_id, again.pad_token_id, again.vocab_size) == (1, 2, 49152)
    assert again.chat_template == ours.chat_template

    from transformers import AutoTokenizer  # and the saved files are a valid HF tokenizer

    hf_saved = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert hf_saved.encode(text, add_special_tokens=False) == ours.encode(text), text
    assert hf_saved.apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True) \
        == ours.apply_chat_template(CONVERSATIONS[0])


def test_from_hf_dir_reads_stop_ids_and_template_file(ours, tmp_path):
    ours.save(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.eos_token_ids == (2, 7, 0)  # EOS, generation_config, end of turn in the template
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|endoftext|>\n<|im_start|>assistant\n")


def test_add_bos_token_flag(metadata, tmp_path):
    tok = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.add_bos_token": True})
    assert tok.add_bos_token is True
    assert tok.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]
    assert tok.render_prompt("hi", chat=False)[0] == 1
    tok.save(tmp_path)
    assert Tokenizer.from_hf_dir(tmp_path).encode("hi", add_special_tokens=True)[0] == 1


def test_chat_template_errors(metadata):
    tok = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template":
                                        "{{ raise_exception('roles must alternate') }}"})
    with pytest.raises(InputError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    plain = Tokenizer.from_gguf_metadata({k: v for k, v in metadata.items()
                                          if k != "tokenizer.chat_template"})
    with pytest.raises(InputError, match="no chat template"):
        plain.render_prompt("x", chat=True)
    assert plain.eos_token_ids == (2,)


def test_template_helpers(metadata):
    template = ("{{ bos_token }}{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
                "{% generation %}!{% endgeneration %}{{ eos_token }}")
    tok = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": template})
    out = tok.apply_chat_template([{"role": "user", "content": "é<"}])
    assert out == '<|im_start|>[{"role": "user", "content": "é<"}]|4!<|im_end|>'


_QWEN_STYLE_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=2) }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'tool' %}{% continue %}{% endif %}
    <|im_start|>{{ message.role }}
    {{ message.content | trim }}{% if loop.index0 == ns.last_user %} [last user]{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}"""


@pytest.mark.parametrize("kwargs", [
    {}, {"enable_thinking": False},
    {"tools": [{"type": "function", "function": {"name": "add", "description": "a+b → ∑"}}]},
])
def test_template_rendering_matches_transformers_renderer(metadata, kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    tok = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": _QWEN_STYLE_TEMPLATE})
    messages = CONVERSATIONS[2] + [{"role": "tool", "content": "ignored"},
                                   {"role": "user", "content": "  padded  "}]
    expected, _ = render_jinja_template(conversations=[messages], chat_template=_QWEN_STYLE_TEMPLATE,
                                        add_generation_prompt=True, **kwargs)
    assert tok.apply_chat_template(messages, **kwargs) == expected[0]
    assert "[last user]" in expected[0] and "ignored" not in expected[0]
    assert ("∑" in expected[0]) == ("tools" in kwargs)
    assert tok.eos_token_ids == (2,)  # <|im_end|> found by probing this template too


# ---------------------------------------------------------------------------- other GGUF vocabularies


def _write_tokenizer_gguf(path, metadata, pre: str) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(metadata["tokenizer.ggml.tokens"])
    w.add_token_types(metadata["tokenizer.ggml.token_type"])
    w.add_token_merges(metadata["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default"])
def test_other_pre_tokenizers_match_transformers(metadata, tmp_path, pre):
    from transformers import AutoTokenizer

    path = tmp_path / f"{pre}.gguf"
    _write_tokenizer_gguf(path, metadata, pre)  # SmolLM2's vocabulary, another split
    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(path), source=str(path))
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:  # all NFC already: transformers leaves out Qwen2's NFC normalizer
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), (pre, text)
    split = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str("x 12345")]
    assert split == {"llama-bpe": ["x", "Ġ", "123", "45"], "qwen2": ["x", "Ġ", "1", "2", "3", "4", "5"],
                     "default": ["x", "Ġ12345"]}[pre]
    if pre == "qwen2":  # Qwen2's tokenizer.json normalizes to NFC
        assert ours.encode("cafe\u0301") == ours.encode("café")


def test_unsupported_gguf_tokenizers(metadata):
    with pytest.raises(LoadError, match=r"x\.gguf.*'llama'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "llama"}, source="x.gguf")
    with pytest.raises(LoadError, match=r"x\.gguf.*'mystery'.*tokenizer\.ggml\.pre"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "mystery"}, source="x.gguf")
    no_merges = {k: v for k, v in metadata.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(LoadError, match=r"x\.gguf.*'tokenizer\.ggml\.merges'"):
        Tokenizer.from_gguf_metadata(no_merges, source="x.gguf")


def test_from_hf_dir_errors(tmp_path):
    with pytest.raises(LoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(LoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
