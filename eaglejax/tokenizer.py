"""Tokenizer: a Hugging Face ``tokenizers`` backend plus chat template and stop ids.

Built either from a Hugging Face tokenizer directory (``tokenizer.json`` and friends) or from
the ``tokenizer.ggml.*`` metadata of a GGUF file. ``save`` writes the Hugging Face layout, so
``Tokenizer.from_hf_dir(d)`` reloads a saved tokenizer identically.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from eaglejax import validation
from eaglejax.errors import InputError, LoadError

# --------------------------------------------------------------------------------------------
# GGUF byte-level BPE: pre-tokenizers by ``tokenizer.ggml.pre`` (llama.cpp's names).

# Llama 3's split pattern (its tokenizer.json; llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2/Qwen2.5/Qwen3 split pattern: single digits (their tokenizer.json; llama.cpp QWEN2).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's own regex is the GPT-2 pattern.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # SmolLM2 / StarCoder tokenizer.json: every digit on its own, then the GPT-2 pattern
    # (llama.cpp: "\p{N}" then the GPT-2 regex for the smollm/starcoder pre-tokenizers).
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()]
    )


def _split_pre(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


# name -> (pre-tokenizer factory, NFC normalizer?, BPE ignore_merges?)
_GGUF_PRE: dict[str, tuple[Any, bool, bool]] = {
    **{k: (_gpt2_pre, False, False) for k in ("default", "gpt-2", "gpt2", "mpt", "olmo", "jais")},
    **{k: (_digits_gpt2_pre, False, False) for k in ("smollm", "starcoder", "refact", "codeshell")},
    **{
        k: (lambda: _split_pre(_LLAMA3_SPLIT), False, True)
        for k in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx")
    },
    **{k: (lambda: _split_pre(_QWEN2_SPLIT), True, False) for k in ("qwen2", "deepseek-r1-qwen")},
}

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# End-of-turn markers used when the chat template cannot be probed.
_KNOWN_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
_PROBE = "EAGLEJAXPROBE"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    visible = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars = visible[:]
    extra = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(visible, map(chr, chars)))


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    """The inverse of `_bytes_to_unicode`."""
    return {c: b for b, c in _bytes_to_unicode().items()}


# --------------------------------------------------------------------------------------------
# Chat templates rendered the way Hugging Face renders them.


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (HF assistant-mask marker); renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(template: str, source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise LoadError(f"{source}: chat template does not compile: {e}") from e


# --------------------------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _int_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise LoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus special tokens, chat template and stop ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        source: str = "tokenizer",
    ) -> None:
        """Wrap ``backend``. ``add_bos_token``/``add_eos_token``: None keeps the backend's
        post-processor; an explicit flag that disagrees with it rebuilds the post-processor."""
        self._backend = backend
        self._source = source
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        for name, token in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token),
                            ("unk", unk_token)):
            if token is not None and backend.token_to_id(token) is None:
                raise LoadError(f"{source}: {name}_token {token!r} is not in the vocabulary")
        self._apply_special_flags(add_bos_token, add_eos_token)
        self._template = _compile_template(chat_template, source) if chat_template else None
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        ids: list[int] = []
        for i in [self.eos_token_id, *extra_eos_token_ids, *self._end_of_turn_ids()]:
            if i is not None and i not in ids:
                if not 0 <= i < self._vocab_size:
                    raise LoadError(f"{source}: eos token id {i} is outside the vocabulary "
                                    f"(size {self._vocab_size})")
                ids.append(int(i))
        self._eos_ids = tuple(ids)

    # ----------------------------------------------------------------------------- builders

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``special_tokens_map.json``,
        ``chat_template.jinja``, ``generation_config.json``/``config.json`` eos ids) from a directory."""
        root = pathlib.Path(path)
        tj = root / "tokenizer.json"
        if not tj.is_file():
            raise LoadError(f"{root}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # the Rust side raises plain Exceptions
            raise LoadError(f"{tj}: cannot parse tokenizer: {e}") from e

        cfg_path = root / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        stm_path = root / "special_tokens_map.json"
        stm = _read_json(stm_path) if stm_path.is_file() else {}

        def special(name: str) -> str | None:
            return _token_content(cfg.get(name)) or _token_content(stm.get(name))

        template: Any = None
        jinja_path = root / "chat_template.jinja"
        if jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        elif (root / "chat_template.json").is_file():
            template = _read_json(root / "chat_template.json").get("chat_template")
        if template is None:
            template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise LoadError(f"{cfg_path}: chat_template must be a string, got {type(template).__name__}")

        extra: list[int] = _int_ids(cfg.get("eaglejax_eos_token_ids"))
        for name in ("generation_config.json", "config.json"):
            if (root / name).is_file():
                extra += _int_ids(_read_json(root / name).get("eos_token_id"))

        def flag(name: str) -> bool | None:
            value = cfg.get(name)
            return value if isinstance(value, bool) else None

        return cls(
            backend,
            chat_template=template,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            add_bos_token=flag("add_bos_token"),
            add_eos_token=flag("add_eos_token"),
            extra_eos_token_ids=extra,
            source=str(root),
        )

    @classmethod
    def from_gguf_metadata(cls, fields: Mapping[str, Any], source: str = "GGUF metadata") -> Tokenizer:
        """Build a byte-level BPE tokenizer from decoded GGUF metadata (``tokenizer.ggml.*``).

        ``fields`` maps keys to plain Python values (strings, numbers, lists). Only
        ``tokenizer.ggml.model == "gpt2"`` is supported; ``source`` names the file in errors.
        """

        def need(key: str) -> Any:
            if key not in fields:
                raise LoadError(f"{source}: missing required metadata key {key!r}")
            return fields[key]

        kind = need("tokenizer.ggml.model")
        if kind != "gpt2":
            raise LoadError(
                f"{source}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; "
                "only byte-level BPE ('gpt2': Llama 3, Qwen, SmolLM2, ...) can be built from GGUF. "
                "Load the model's Hugging Face tokenizer directory instead."
            )
        pre_name = fields.get("tokenizer.ggml.pre", "default")
        if pre_name not in _GGUF_PRE:
            raise LoadError(
                f"{source}: pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported; "
                f"supported: {', '.join(sorted(_GGUF_PRE))}"
            )
        tokens = need("tokenizer.ggml.tokens")
        merges_raw = need("tokenizer.ggml.merges")
        types = fields.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise LoadError(f"{source}: tokenizer.ggml.tokens must be a list of strings")
        if len(types) != len(tokens):
            raise LoadError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries, "
                            f"tokenizer.ggml.tokens has {len(tokens)}")

        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        control: list[str] = []
        user: list[str] = []
        for i, (tok, ttype) in enumerate(zip(tokens, types)):
            if ttype == _TOKEN_CONTROL:
                control.append(tok)
            elif ttype == _TOKEN_USER_DEFINED:
                user.append(tok)
            elif not set(tok) <= alphabet:  # stored raw: respell in the byte alphabet
                tok = "".join(spelling[b] for b in tok.encode("utf-8"))
            vocab.setdefault(tok, i)
        merges: list[tuple[str, str]] = []
        for n, m in enumerate(merges_raw):
            parts = m.split(" ") if isinstance(m, str) else []
            if len(parts) != 2:
                raise LoadError(f"{source}: tokenizer.ggml.merges[{n}] = {m!r} is not 'left right'")
            merges.append((parts[0], parts[1]))

        make_pre, nfc, ignore_merges = _GGUF_PRE[pre_name]
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                             ignore_merges=ignore_merges)
        except Exception as e:
            raise LoadError(f"{source}: cannot build BPE from tokenizer.ggml.*: {e}") from e
        backend = tokenizers.Tokenizer(bpe)
        backend.normalizer = normalizers.NFC() if nfc else None
        backend.pre_tokenizer = make_pre()
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
        if control:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        if user:
            backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

        def token(key: str) -> str | None:
            i = fields.get(key)
            if i is None:
                return None
            if not isinstance(i, int) or not 0 <= i < len(tokens):
                raise LoadError(f"{source}: {key} = {i!r} is not a token id (vocab {len(tokens)})")
            return tokens[i]

        extra = [fields[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                 if isinstance(fields.get(k), int)]
        template = fields.get("tokenizer.chat_template")
        return cls(
            backend,
            chat_template=template if isinstance(template, str) else None,
            bos_token=token("tokenizer.ggml.bos_token_id"),
            eos_token=token("tokenizer.ggml.eos_token_id"),
            pad_token=token("tokenizer.ggml.padding_token_id"),
            unk_token=token("tokenizer.ggml.unknown_token_id"),
            add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
            extra_eos_token_ids=extra,
            source=source,
        )

    # ----------------------------------------------------------------------------- internals

    def _adds(self, token_id: int | None, first: bool) -> bool:
        if token_id is None:
            return False
        with_sp = self._backend.encode("a", add_special_tokens=True).ids
        without = self._backend.encode("a", add_special_tokens=False).ids
        if len(with_sp) <= len(without):
            return False
        return (with_sp[0] if first else with_sp[-1]) == token_id

    def _apply_special_flags(self, add_bos: bool | None, add_eos: bool | None) -> None:
        has_bos = self._adds(self.bos_token_id, first=True)
        has_eos = self._adds(self.eos_token_id, first=False)
        want_bos = has_bos if add_bos is None else add_bos
        want_eos = has_eos if add_eos is None else add_eos
        want_bos = want_bos and self.bos_token is not None  # a flag without a token adds nothing
        want_eos = want_eos and self.eos_token is not None
        self.add_bos_token, self.add_eos_token = want_bos, want_eos
        if (want_bos, want_eos) == (has_bos, has_eos):
            return
        if not want_bos and not want_eos:
            self._backend.post_processor = processors.ByteLevel(trim_offsets=False)
            return
        pre = f"{self.bos_token}:0 " if want_bos else ""
        post = f" {self.eos_token}:0" if want_eos else ""
        specials = [(t, self._backend.token_to_id(t))
                    for t, on in ((self.bos_token, want_bos), (self.eos_token, want_eos)) if on]
        self._backend.post_processor = processors.TemplateProcessing(
            single=f"{pre}$A:0{post}",
            pair=f"{pre}$A:0{post} {pre.replace(':0', ':1')}$B:1{post.replace(':0', ':1')}",
            special_tokens=list(dict.fromkeys(specials)),
        )

    def _end_of_turn_ids(self) -> list[int]:
        """The special token closing an assistant turn in the chat template (e.g. <|im_end|>)."""
        if self._template is None or self.chat_template is None:
            return []
        specials = sorted(
            (t.content for t in self._backend.get_added_tokens_decoder().values() if t.special),
            key=len, reverse=True,
        )
        try:
            text = self.apply_chat_template(
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}],
                add_generation_prompt=False,
            )
        except Exception:  # templates may insist on other conversations; fall back below
            text = ""
        if _PROBE in text:
            tail = text.split(_PROBE, 1)[1].lstrip()
            for tok in specials:
                if tail.startswith(tok):
                    return [self._backend.token_to_id(tok)]
            return []
        return [self._backend.token_to_id(t) for t in _KNOWN_END_OF_TURN
                if t in self.chat_template and t in specials]

    # ----------------------------------------------------------------------------- public API

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids (largest id + 1, added tokens included)."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (``eos_token``); see ``eos_token_ids`` for all stop ids."""
        return self.token_to_id(self.eos_token) if self.eos_token is not None else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All stop ids: EOS, EOS ids from the model configs, and the chat end-of-turn token."""
        return self._eos_ids

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token) if self.pad_token is not None else None

    def spare_special_token_id(self) -> int | None:
        """The highest-numbered special token that text never produces and decoding never
        needs (not bos/eos/pad/unk, not in the chat template), or None: a safe id for a
        P-EAGLE mask token."""
        used = {self.bos_token, self.eos_token, self.pad_token, self.unk_token}
        used.update(self.id_to_token(i) for i in self.eos_token_ids)
        spare = [i for i, t in self._backend.get_added_tokens_decoder().items()
                 if t.special and t.content not in used
                 and t.content not in (self.chat_template or "")]
        return max(spare, default=None)

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` (None when absent)."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary string of ``token_id`` (byte-level spelling; None when absent)."""
        return self._backend.id_to_token(int(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (a token may hold part of a UTF-8 character):
        a byte-level vocabulary's spelling mapped back to bytes, a ``<0xNN>`` byte token's
        byte, an added token's text, else the token decoded alone."""
        piece = self.id_to_token(token_id)
        if piece is None:
            return b""
        if int(token_id) in self._backend.get_added_tokens_decoder():
            return piece.encode()
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if type(self._backend.decoder).__name__ == "ByteLevel":
            table = _unicode_to_bytes()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS as the model does."""
        validation.text("text", text)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (ids past the vocabulary, e.g. embedding padding, decode to nothing)."""
        ids = [int(i) for i in ids]
        negative = [i for i in ids if i < 0]
        if negative:
            raise InputError(f"decode: negative token id {negative[0]}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render ``messages`` with the chat template as Hugging Face does (tokenize=False)."""
        if self._template is None:
            raise InputError(f"{self._source}: this tokenizer has no chat template; "
                             "encode the prompt without chat formatting (chat=False, --no-chat)")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InputError("messages must be a list of dicts with 'role' and 'content'")
        specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                      ("unk_token", self.unk_token), ("pad_token", self.pad_token))
                    if v is not None}
        context = {"tools": None, "documents": None, **specials, **template_kwargs}
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise InputError(f"{self._source}: chat template rejected the messages: {e}") from e

    def render_prompt(self, text: str, chat: bool) -> list[int]:
        """Prompt ids: ``chat`` renders ``text`` as one user turn through the chat template
        (plus the generation prompt); otherwise plain encoding with BOS if the model adds one."""
        if chat:
            rendered = self.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True)
            if not rendered.strip():
                raise InputError(f"{self._source}: the chat template renders this prompt to "
                                 f"{rendered!r}, no text to decode from")
            return self.encode(rendered, add_special_tokens=False)
        return self.encode(text, add_special_tokens=True)

    def save(self, directory: str | pathlib.Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
        root = pathlib.Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(root / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
            "eaglejax_eos_token_ids": list(self._eos_ids),
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (root / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self._source!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token!r}, eos_ids={self.eos_token_ids})")
