"""The OpenAI API surface: request schemas, their checks against the served model, error
objects, and the response and stream-chunk bodies."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
import uuid
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from eaglejax import validation
from eaglejax.decoding.output import MAX_TOP_LOGPROBS
from eaglejax.errors import InputError
from eaglejax.prompting import encode_prompts, stop_criteria
from eaglejax.serving.engine import MAX_STOP_TOKEN_IDS, SamplingOptions
from eaglejax.target import Target

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_CHOICES = 16  # `n`: replies to one request
MAX_TIMEOUT_S = 86400.0  # a request's `timeout`: at most a day


class APIError(Exception):
    """An error answered with an OpenAI-style JSON error object and an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = \
            status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def server_error(err: BaseException) -> APIError:
    """The 500 error object for a failure of the server itself (not of the request)."""
    return APIError(500, f"the server failed: {type(err).__name__}: {err}",
                    kind="server_error")


class _Strict(BaseModel):
    """JSON types as written (no "1" for 1, no true for 1); unknown fields are refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """The fields both endpoints take. `top_k`, `ignore_eos` and `stop_token_ids` extend
    OpenAI's API (as vLLM's do), and `timeout` (seconds the request may take, waiting for
    a slot and decoding); temperature 0 is greedy."""

    model: str
    max_tokens: int | None = Field(None, ge=0, le=validation.INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=validation.INT32_MAX)
    seed: int | None = Field(None, ge=0, lt=validation.SEED_LIMIT)
    stop: Any = None  # a string or a list of strings, checked by `_stop_strings`
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field([], max_length=MAX_STOP_TOKEN_IDS)
    timeout: float | None = Field(None, gt=0.0, le=MAX_TIMEOUT_S)


class CompletionRequest(_Generation):
    prompt: Any  # a string or a list of token ids, checked by `_completion_prompt`
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any  # a string or a list of text parts, checked by `_message_text`


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=validation.INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


def _param(loc: tuple[str | int, ...]) -> str | None:
    """A pydantic error location as the parameter path OpenAI writes: messages[0].role."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else part
    return path or None


def parse_body(schema: type[_Generation], raw: bytes) -> _Generation:
    """The request `raw` JSON as `schema`; APIError 400 naming the first bad field."""
    try:
        return schema.model_validate_json(raw)
    except pydantic.ValidationError as err:
        first = err.errors(include_url=False)[0]
    param, kind = _param(first["loc"]), first["type"]
    if kind == "json_invalid":
        raise APIError(400, f"could not parse the JSON body of your request: {first['msg']}",
                       code="invalid_json") from None
    if param is None:
        raise APIError(400, "the request body must be a JSON object", code="invalid_type")
    if kind == "extra_forbidden":
        raise APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                       code="unknown_parameter")
    if kind == "missing":
        raise APIError(400, f"Missing required parameter: {param}", param=param,
                       code="missing_required_parameter")
    got = json.dumps(first.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    raise APIError(400, f"{param}: {first['msg']}, got {got}", param=param, code=code)


@dataclasses.dataclass(frozen=True)
class Job:
    """A checked request, ready for the engine: prompt ids and how to continue them."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingOptions
    stop: list[str]
    stop_sequences: tuple[tuple[int, ...], ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    logprobs: int | None = None  # most likely tokens per token (None: no log-probabilities)
    timeout: float | None = None  # seconds the request may take (None: no limit)
    echo: bool = False  # the reply starts with the prompt (a completion's `echo`)

    def choice_sampling(self, index: int) -> SamplingOptions:
        """Choice `index`'s sampling: the request's, its seed + index (mod the seed limit)."""
        return dataclasses.replace(self.sampling,
                                   seed=(self.sampling.seed + index) % validation.SEED_LIMIT)


def prepare(body: _Generation, target: Target, *, capacity: int, default_max_tokens: int,
            max_logprobs: int | None = None, request_timeout: float | None = None) -> Job:
    """Check `body` against the served model (the caller checked its name); prompt tokens
    plus max_tokens must fit `capacity`, log-probabilities asked for `max_logprobs` (None:
    none may be); the request's time limit is its `timeout`, at most `request_timeout`.
    APIError 400 naming the field at fault."""
    stop = _stop_strings(body.stop)
    logprobs = _logprobs(body, max_logprobs)
    try:
        sequences = stop_criteria(target, stop, ignore_eos=True).stop_sequences
    except InputError as err:
        raise APIError(400, f"stop: {err}", param="stop", code="invalid_value") from None
    if isinstance(body, ChatRequest):
        prompt, where = _chat_prompt(body.messages, target), "messages"
        limit = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    else:
        prompt, where, limit = _completion_prompt(body.prompt, target), "prompt", "max_tokens"
    max_tokens = getattr(body, limit)
    echo = isinstance(body, CompletionRequest) and body.echo
    if max_tokens == 0 and not echo:
        raise APIError(400, f"{limit}: 0 tokens is a reply only with echo (a completion that "
                            f"scores its prompt)", param=limit, code="invalid_value")
    room = capacity - len(prompt)
    if max_tokens is None and room >= 1:
        max_tokens = min(default_max_tokens, room)
    if max_tokens is None or max_tokens > room:
        asked = len(prompt) + (max_tokens or 1)
        raise APIError(400, f"This model's maximum context length is {capacity} tokens. "
                            f"However, you requested {asked} tokens ({len(prompt)} in the "
                            f"{where}, {asked - len(prompt)} in the completion). Please reduce "
                            f"the length of the {where} or completion.",
                       param=where if max_tokens is None else limit,
                       code="context_length_exceeded")
    seed = secrets.randbelow(validation.SEED_LIMIT) if body.seed is None else body.seed
    options = body.stream_options
    try:
        validation.in_vocabulary("stop_token_ids", body.stop_token_ids,
                                 target.config.vocab_size)
    except InputError as err:
        raise APIError(400, str(err), param="stop_token_ids", code="invalid_value") from None
    return Job(prompt, max_tokens, SamplingOptions(body.temperature, body.top_k, body.top_p, seed),
               stop, sequences, body.ignore_eos, body.stream,
               options is not None and options.include_usage, tuple(body.stop_token_ids),
               body.n, logprobs, min((t for t in (body.timeout, request_timeout)
                                      if t is not None), default=None), echo)


def _logprobs(body: _Generation, max_logprobs: int | None) -> int | None:
    """Most likely tokens to report per generated token (None: no log-probabilities): a
    chat's `top_logprobs` (with `logprobs: true`), a completion's `logprobs`."""
    if isinstance(body, ChatRequest):
        param = "top_logprobs"
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: set logprobs to true to use top_logprobs",
                           param=param, code="invalid_value")
        count = (body.top_logprobs or 0) if body.logprobs else None
    else:
        param, count = "logprobs", body.logprobs
    if count is None:
        return None
    if max_logprobs is None:
        raise APIError(400, "logprobs: this server reports no log-probabilities (started with "
                            "--max-logprobs -1)", param="logprobs", code="invalid_value")
    if count > max_logprobs:
        raise APIError(400, f"{param}: at most {max_logprobs} most likely tokens (the server's "
                            f"--max-logprobs), got {count}", param=param, code="invalid_value")
    return count


def _stop_strings(value: Any) -> list[str]:
    try:
        stop = validation.stop_strings(value, name="stop")
    except InputError as err:
        raise APIError(400, str(err), param="stop", code="invalid_value") from None
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}",
                       param="stop", code="invalid_value")
    return stop


def _completion_prompt(value: Any, target: Target) -> list[int]:
    """Token ids of one prompt: text (encoded as it is, BOS added as the model does) or
    token ids; a list of several prompts is refused (one reply per request)."""
    one_token_list = isinstance(value, list) and bool(value) and all(
        validation.is_int(t) for t in value)
    try:
        prompts = validation.prompt_list([value] if one_token_list else value)
        if len(prompts) != 1:
            raise InputError(f"prompt: send one prompt per request, got {len(prompts)}")
        return encode_prompts(prompts, target, chat=False)[0]
    except InputError as err:
        raise APIError(400, str(err), param="prompt", code="invalid_value") from None


def _chat_prompt(messages: list[ChatMessage], target: Target) -> list[int]:
    """Token ids of `messages` rendered with the chat template and the assistant's
    generation prompt (as `generate(..., chat=True)` renders one user turn)."""
    turns = [{"role": m.role, "content": _message_text(i, m.content)}
             for i, m in enumerate(messages)]
    try:
        ids = target.tokenizer.encode(target.tokenizer.apply_chat_template(turns),
                                      add_special_tokens=False)
    except InputError as err:
        raise APIError(400, str(err), param="messages", code="invalid_value") from None
    if not ids:
        raise APIError(400, "messages: the chat template renders them to no tokens",
                       param="messages", code="invalid_value")
    return ids


def _message_text(index: int, content: Any) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts."""
    param = f"messages[{index}].content"
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"{param} must be a string or a list of text parts "
                            f'({{"type": "text", "text": "..."}})', param=param,
                       code="invalid_type")
    try:
        return validation.text(param, content)
    except InputError as err:
        raise APIError(400, str(err), param=param, code="invalid_value") from None


def finish_reason(engine_reason: str) -> str:
    """OpenAI's finish reason for the engine's ("eos" and a stop string both are "stop"; a
    reply cut by its timeout, as by its length limit, is "length")."""
    return "length" if engine_reason in ("length", "timeout") else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    """OpenAI's usage object (`cached_tokens`: prompt tokens the prefix cache held)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclasses.dataclass(frozen=True)
class Reply:
    """Names one reply (id, creation time, model) and builds its bodies: a chat completion
    or a text completion, whole or as stream chunks."""

    chat: bool
    model: str
    id: str
    created: int

    @staticmethod
    def new(chat: bool, model: str) -> Reply:
        prefix = "chatcmpl" if chat else "cmpl"
        return Reply(chat, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, choices: list[tuple[str, str, dict[str, Any] | None]],
                 usage_: dict[str, Any], extension: dict[str, Any]) -> dict[str, Any]:
        """The whole reply (`stream: false`): its choices' (text, finish reason, logprobs
        object or None)."""
        bodies = []
        for index, (text, finish, logprobs) in enumerate(choices):
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice.update(logprobs=logprobs, finish_reason=finish)
            bodies.append(choice)
        return {**self._head(False), "choices": bodies, "usage": usage_,
                "eaglejax": extension}

    def chunk(self, text: str | None, finish: str | None = None,
              extension: dict[str, Any] | None = None, index: int = 0,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A stream chunk of choice `index`: new text (with its tokens' `logprobs` object,
        if asked), or (chat) None for the opening chunk that carries the role; a choice's
        last chunk has its finish reason and extension."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if text is None else \
                {"content": text} if text else {}
        else:
            choice["text"] = text or ""
        choice.update(logprobs=logprobs, finish_reason=finish)
        body = {**self._head(True), "choices": [choice]}
        return body if extension is None else {**body, "eaglejax": extension}

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        """The chunk `stream_options.include_usage` adds before the end: no choices."""
        return {**self._head(True), "choices": [], "usage": usage_}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event (a JSON body, or the final "[DONE]")."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
