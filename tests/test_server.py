"""`eaglejax serve`: a live server on 127.0.0.1 driven by the official `openai` client.
Replies equal offline `generate` (greedy, or the same seed), bad requests get OpenAI error
objects with a 4xx status, and a client that leaves frees its slot."""

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import numpy as np
import openai
import pytest
import tokenizers
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

import eaglejax
from eaglejax.cli import main
from eaglejax.loading.target_loader import fastest_weight_dtype
from eaglejax.serving.engine import Engine
from eaglejax.serving.server import create_app
from eaglejax.serving.textstream import TextStream
from eaglejax.tokenizer import Tokenizer
from hf_oracle import hf_logits
from test_paged_engine import expect_short_replies
from tolerances import FORWARD_UNITS, assert_close_scaled

MODEL = "tiny-llama"
CAPACITY = 128
TEMPLATE = ("{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")
STOP = ["w80", "w47 w47", "w29 w29", "2 w7"]  # "2 w7" is not on token boundaries
TIMEOUT_S = 120.0
MAX_LOGPROBS = 5  # the test server's


@pytest.fixture(scope="module")
def target(target_of):
    """The tiny random Llama with a word-level tokenizer (user, assistant, system and
    w2 .. w96; w2 is the model's EOS) and a chat template."""
    vocab = {"<unk>": 0, "user": 1, "w2": 2, "assistant": 3, "system": 4,
             **{f"w{i}": i for i in range(5, 97)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = Tokenizer(backend, chat_template=TEMPLATE, unk_token="<unk>")
    return dataclasses.replace(target_of("llama"), tokenizer=tokenizer)


class _HeldEngine:
    """The engine, whose steps the test can hold: while held, each step waits for a
    permit (`allow`)."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._permits = threading.Semaphore(0)
        self._held = False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def hold(self) -> None:
        self._permits = threading.Semaphore(0)  # none left from an earlier release
        self._held = True

    def allow(self, steps: int = 1) -> None:
        self._permits.release(steps)

    def release(self) -> None:
        self._held = False
        self._permits.release()  # wakes a step waiting for a permit

    def step(self):
        if self._held and not self._permits.acquire(timeout=TIMEOUT_S):
            raise TimeoutError("the test held the engine too long")
        return self._engine.step()


@pytest.fixture(scope="module")
def server(target):
    """A live server (4 slots of 128 tokens) on a free port; stopped at the end."""
    engine = Engine(target, num_slots=4, capacity=CAPACITY, max_logprobs=MAX_LOGPROBS)
    with _serving(_HeldEngine(engine)) as live:
        yield live


@contextlib.contextmanager
def _serving(engine):
    """`engine` served on a free port while the context lasts."""
    app = create_app(engine, model_name=MODEL, default_max_tokens=16)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        _poll(lambda: _health(url) == 200, "the server to start")
        yield types.SimpleNamespace(url=url, engine=engine)
    finally:
        uv.should_exit = True
        thread.join(TIMEOUT_S)
        sock.close()
    assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=TIMEOUT_S)


def _health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def _poll(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _metric(server, name: str, **labels) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return sample.value
    return 0.0


@dataclasses.dataclass(frozen=True)
class Case:
    prompt: str
    chat: bool
    stream: bool
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()


def _ask(client: openai.OpenAI, case: Case) -> tuple[str, str, object, dict]:
    """The server's reply to `case`: text, finish reason, usage, eaglejax extension."""
    common = dict(model=MODEL, max_tokens=case.max_tokens, temperature=case.temperature,
                  top_p=case.top_p, seed=case.seed, stop=list(case.stop) or None,
                  extra_body={"top_k": case.top_k}, stream=case.stream)
    if case.stream:
        common["stream_options"] = {"include_usage": True}
    if case.chat:
        reply = client.chat.completions.create(
            messages=[{"role": "user", "content": case.prompt}], **common)
    else:
        reply = client.completions.create(prompt=case.prompt, **common)
    if not case.stream:
        choice = reply.choices[0]
        text = choice.message.content if case.chat else choice.text
        return text, choice.finish_reason, reply.usage, reply.model_extra["eaglejax"]
    chunks = list(reply)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    choices = [c.choices[0] for c in chunks[:-1]]
    assert all(c.finish_reason is None for c in choices[:-1])
    if case.chat:
        assert choices[0].delta.role == "assistant"
        text = "".join(c.delta.content or "" for c in choices)
    else:
        text = "".join(c.text for c in choices)
    return text, choices[-1].finish_reason, chunks[-1].usage, \
        chunks[-2].model_extra["eaglejax"]


def _check_equals_offline(target, case: Case, reply) -> None:
    text, finish, usage, extension = reply
    expected = eaglejax.generate(
        [case.prompt], target=target, chat=case.chat, max_new_tokens=case.max_tokens,
        temperature=case.temperature, top_p=case.top_p, top_k=case.top_k, seed=case.seed,
        stop=list(case.stop) or None)[0]
    assert (text, finish) == (expected.text,
                              "length" if expected.finish_reason == "length" else "stop"), case
    assert usage.completion_tokens == len(expected.token_ids), case
    assert usage.prompt_tokens == expected.metrics.prompt_tokens, case
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # plain decoding: one target forward per token after the first
    assert extension == {"acceptance_length": 1.0 if extension["rounds"] else None,
                         "rounds": extension["rounds"], "speculative": None,
                         "timed_out": False}
    assert extension["rounds"] >= usage.completion_tokens - 1


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reply_equals_offline_generate(target, client, chat, stream):
    case = Case("w5 w9 w31 w60 w7", chat, stream, max_tokens=30, stop=tuple(STOP))
    _check_equals_offline(target, case, _ask(client, case))


def test_concurrent_requests_equal_offline_generate(target, client):
    """32 requests at once over 4 slots: prompts and lengths differ, half greedy, half
    sampled with their own settings and seeds; a third have stop strings."""
    cases = []
    for i in range(32):
        sampled = i % 2 == 1
        cases.append(Case(
            " ".join(f"w{5 + (7 * i + 11 * j) % 90}" for j in range(1 + (5 * i) % 11)),
            chat=i % 4 in (1, 2), stream=i % 8 >= 4, max_tokens=1 + (3 * i) % 16,
            temperature=0.6 + (i % 5) / 5 if sampled else 0.0,
            top_p=0.9 if i % 6 == 1 else 1.0, top_k=20 if i % 10 == 3 else 0,
            seed=1000 + i, stop=tuple(STOP) if i % 3 == 0 else ()))
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        replies = list(pool.map(lambda c: _ask(client, c), cases))
    for case, reply in zip(cases, replies, strict=True):
        _check_equals_offline(target, case, reply)


def test_chat_takes_text_parts_and_several_turns(target, client):
    def ask(messages):
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                               temperature=0)
        return reply.choices[0].message.content, reply.usage.prompt_tokens

    parts = [{"role": "user", "content": [{"type": "text", "text": "w5 w9"},
                                          {"type": "text", "text": " w31"}]}]
    assert ask(parts) == ask([{"role": "user", "content": "w5 w9 w31"}])
    turns = [{"role": "system", "content": "w40"}, {"role": "user", "content": "w5"},
             {"role": "assistant", "content": "w6"}, {"role": "user", "content": "w7"}]
    rendered = "system w40 user w5 assistant w6 user w7 assistant"
    expected = eaglejax.generate([target.tokenizer.encode(rendered)], target=target,
                                 max_new_tokens=6)[0]
    assert ask(turns) == (expected.text, len(target.tokenizer.encode(rendered)))


def test_token_id_prompts_and_default_max_tokens(target, client):
    reply = client.completions.create(model=MODEL, prompt=[5, 9, 31], temperature=0)
    expected = eaglejax.generate([[5, 9, 31]], target=target, max_new_tokens=16)[0]
    assert reply.choices[0].text == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)  # 16: the default


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_n_choices_are_the_replies_of_consecutive_seeds(target, client, chat):
    """n=3 sampled: choice i is `generate`'s reply with seed + i, whole and streamed (its
    chunks interleaved with the other choices'); usage counts the prompt once."""
    prompt, seed = "w5 w9 w31", 40
    want = [eaglejax.generate([prompt], target=target, chat=chat, max_new_tokens=10,
                              temperature=1.0, seed=seed + i)[0] for i in range(3)]
    common = dict(model=MODEL, max_tokens=10, temperature=1.0, seed=seed, n=3)
    ask = (lambda **kw: client.chat.completions.create(
        messages=[{"role": "user", "content": prompt}], **common, **kw)) if chat else (
        lambda **kw: client.completions.create(prompt=prompt, **common, **kw))
    whole = ask()
    texts = [c.message.content if chat else c.text for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert texts == [w.text for w in want]
    assert len(set(texts)) > 1  # different seeds, different samples
    assert whole.usage.prompt_tokens == want[0].metrics.prompt_tokens
    assert whole.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    streamed = ["", "", ""]
    chunks = list(ask(stream=True, stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        choice = chunk.choices[0]
        streamed[choice.index] += (choice.delta.content or "") if chat else choice.text
    assert streamed == texts
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_token_ids_end_the_reply_with_that_token(target, client):
    prompt = [5, 9, 31]
    whole = eaglejax.generate([prompt], target=target, max_new_tokens=16, ignore_eos=True)[0]
    stop_at = next(i for i, t in enumerate(whole.token_ids) if i >= 3 and t != 2
                   and t not in whole.token_ids[:i])  # a first occurrence, not the EOS
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True, "stop_token_ids":
                                                  [whole.token_ids[stop_at]]})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == stop_at + 1  # the stop token is kept, as EOS is
    assert reply.choices[0].text == target.tokenizer.decode(whole.token_ids[:stop_at + 1],
                                                            skip_special_tokens=True)


def test_a_repeated_prompt_prefix_is_reported_cached(target, client):
    prompt = list(range(40, 80))  # 40 tokens: one full block of 32 before the last token
    first, again = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                              temperature=0) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 31  # its last one prefilled
    assert again.choices[0].text == first.choices[0].text


def _post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, timeout=30,
                      headers={"Content-Type": "application/json"})


COMPLETION = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 4}
LONG = " ".join(["w7"] * 130)


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": ', 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_type"),
    ("/v1/completions", {**COMPLETION, "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "w5"}, 400, "model", "missing_required_parameter"),
    ("/v1/completions", {**COMPLETION, "temperature": -0.5}, 400, "temperature",
     "invalid_value"),
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature",
     "invalid_type"),
    ("/v1/completions", {**COMPLETION, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [97]}, 400, "stop_token_ids",
     "invalid_value"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": list(range(5, 14))}, 400,
     "stop_token_ids", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "top_k": -1}, 400, "top_k", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "seed": 2**32}, 400, "seed", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "n": 0}, 400, "n", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "n": 17}, 400, "n", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "stop": [""]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "invalid_value"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {}}, 400, "logit_bias",
     "unknown_parameter"),
    ("/v1/completions", {**COMPLETION, "prompt": ["w5", "w6"]}, 400, "prompt",
     "invalid_value"),
    ("/v1/completions", {**COMPLETION, "prompt": [5, 97]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "prompt": "  "}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 127}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {**COMPLETION, "prompt": LONG, "max_tokens": None}, 400, "prompt",
     "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "w5"}]}, 400,
     "messages[0].role", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content", "invalid_type"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG}]}, 400,
     "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage", "invalid_type"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs",
     "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, 400,
     "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "logprobs": MAX_LOGPROBS + 1}, 400, "logprobs",
     "invalid_value"),
    ("/v1/completions", {**COMPLETION, "logprobs": True}, 400, "logprobs", "invalid_type"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, 400, "echo", "unknown_parameter"),
    ("/v1/embeddings", COMPLETION, 404, None, None),
])
def test_bad_request_gets_an_error_object(server, path, body, status, param, code):
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == \
        ("invalid_request_error", param, code), error
    assert error["message"]
    assert _health(server.url) == 200  # and the server keeps serving


def test_the_openai_client_raises_on_error_objects(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-9", prompt="w5")
    assert err.value.code == "model_not_found" and err.value.param == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}],
                                       temperature=2.5, stream=True)
    assert err.value.param == "temperature"
    reply = client.completions.create(model=MODEL, prompt="w5", max_tokens=2)
    assert reply.usage.completion_tokens >= 1


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_equal_offline_generate(target, client, chat, stream):
    """Each token's log-probability and its 3 most likely alternatives, as `generate` gives
    them, in OpenAI's chat and completion shapes, whole and streamed (the chunks' entries
    concatenated), through a stop string (entries for the tokens the reply counts)."""
    prompt, top = "w5 w9 w31 w60 w7", 3
    want = eaglejax.generate([prompt], target=target, chat=chat, max_new_tokens=20,
                             stop=STOP, logprobs=top)[0]
    common = dict(model=MODEL, max_tokens=20, temperature=0, stop=STOP, stream=stream)
    if chat:
        reply = client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], logprobs=True, top_logprobs=top,
            **common)
    else:
        reply = client.completions.create(prompt=prompt, logprobs=top, **common)
    choices = [c.choices[0] for c in reply if c.choices] if stream else reply.choices
    got = [c.logprobs for c in choices if c.logprobs is not None]
    text = lambda i: target.tokenizer.token_bytes(i).decode()  # noqa: E731
    if chat:
        entries = [e for part in got for e in part.content]
        tokens = [e.token for e in entries]
        values = [e.logprob for e in entries]
        tops = [[(t.token, t.logprob) for t in e.top_logprobs] for e in entries]
        assert [e.bytes for e in entries] == [list(text(i).encode()) for i in want.token_ids]
    else:
        tokens = [t for part in got for t in part.tokens]
        values = [v for part in got for v in part.token_logprobs]
        tops = [list(d.items()) for part in got for d in part.top_logprobs]
        offsets = [o for part in got for o in part.text_offset]
        assert offsets == list(np.cumsum([0] + [len(t) for t in tokens[:-1]]))
    assert tokens == [text(i) for i in want.token_ids]
    assert [[t for t, _ in row] for row in tops] == \
        [[text(i) for i, _ in e.top] for e in want.logprobs]
    scale = max(abs(e.logprob) for e in want.logprobs)
    assert_close_scaled(values + [v for row in tops for _, v in row],
                        [e.logprob for e in want.logprobs] + [v for e in want.logprobs
                                                             for _, v in e.top],
                        units=FORWARD_UNITS, depth=target.config.num_layers, scale=scale,
                        what="the server's log-probabilities against generate's")


def test_echo_scores_the_prompt(target, hf_family, client):
    """`echo` with `logprobs`: each prompt token's log-probability after those before it
    (transformers' log-softmax; the first: null) and its 2 most likely tokens, then the
    reply's; `max_tokens` 0 scores the prompt alone (what evaluation harnesses send)."""
    prompt = "w5 w9 w31 w60 w7 w12"
    ids = target.tokenizer.encode(prompt)
    logits = torch.as_tensor(hf_logits(hf_family("llama")[1], np.array([ids]))[0]).double()
    oracle = torch.log_softmax(logits, -1).numpy()
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                       logprobs=2)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == prompt.split() and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(d) == 2 for d in lp.top_logprobs[1:])
    assert_close_scaled(lp.token_logprobs[1:], oracle[np.arange(len(ids) - 1), ids[1:]],
                        units=FORWARD_UNITS, depth=target.config.num_layers,
                        what="prompt log-probabilities")
    want = eaglejax.generate([prompt], target=target, chat=False, max_new_tokens=4,
                             ignore_eos=True)[0]
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True,
                                       logprobs=1, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.text for c in chunks) == prompt + want.text
    values = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert len(values) == len(ids) + 4 and values[0] is None
    assert values[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)


def test_replies_carry_no_logprobs_unless_asked(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                   "content": "w5"}],
                                           max_tokens=3, temperature=0)
    assert reply.choices[0].logprobs is None
    reply = client.completions.create(model=MODEL, prompt="w5", max_tokens=3, stream=True)
    assert all(c.choices[0].logprobs is None for c in reply)


def _check_dropped_request_frees_its_slot(server, send, drop) -> None:
    """Hold the engine to one step, `send` a 100-token request, wait for its slot, `drop`
    the connection: the server must cancel it, and the engine free its slot long before
    the request's 100 tokens."""
    tokens_before = _metric(server, "eaglejax_generated_tokens_total")
    cancelled_before = _metric(server, "eaglejax_requests_total", outcome="cancelled")
    server.engine.hold()
    try:
        server.engine.allow(1)
        sent = send({"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 100,
                     "temperature": 0, "ignore_eos": True})
        _poll(lambda: _metric(server, "eaglejax_running_rows") == 1, "the request's slot")
        drop(sent)
        _poll(lambda: _metric(server, "eaglejax_requests_total", outcome="cancelled")
              == cancelled_before + 1, "the server to cancel the request")
    finally:
        server.engine.release()
    _poll(lambda: _metric(server, "eaglejax_running_rows") == 0, "the slot to be freed")
    assert _metric(server, "eaglejax_generated_tokens_total") - tokens_before < 100
    assert _metric(server, "eaglejax_queue_depth") == 0


def test_timeout_cuts_a_running_reply_and_refuses_a_waiting_one(target, server, client):
    """A request's `timeout`: running past it, the reply ends with the tokens it has (a
    prefix of `generate`'s, finish reason "length", `timed_out`); waiting past it for a
    slot, 503 `deadline_exceeded` (an error event when streamed)."""
    body = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "timeout": 0.5}
    want = eaglejax.generate(["w5 w6 w7"], target=target, chat=False, max_new_tokens=100,
                             ignore_eos=True)[0]
    _post(server, "/v1/completions", {**body, "timeout": None})  # its programs compiled
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        server.engine.hold()
        try:
            server.engine.allow(2)  # the prefill, one call of 16 steps: then held
            running = pool.submit(_post, server, "/v1/completions", body)
            _poll(lambda: _metric(server, "eaglejax_running_rows") == 1, "the request's slot")
            time.sleep(0.6)
        finally:
            server.engine.release()
        reply = running.result(TIMEOUT_S).json()
        server.engine.hold()
        try:
            waiting = pool.submit(_post, server, "/v1/completions", {**body, "timeout": 0.2})
            streamed = pool.submit(lambda: httpx.post(
                f"{server.url}/v1/completions", json={**body, "timeout": 0.2, "stream": True},
                timeout=30).text)
            _poll(lambda: server.engine.num_queued >= 1, "a request queued")  # the other
            time.sleep(0.3)  # waits in the engine thread's inbox: both past their timeout
        finally:
            server.engine.release()
        refused, events = waiting.result(TIMEOUT_S), streamed.result(TIMEOUT_S)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and reply["eaglejax"]["timed_out"]
    n = reply["usage"]["completion_tokens"]
    assert 1 < n < 100 and choice["text"] == target.tokenizer.decode(want.token_ids[:n])
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "deadline_exceeded"
    assert '"code": "deadline_exceeded"' in events and events.endswith("data: [DONE]\n\n")
    assert _metric(server, "eaglejax_requests_total", outcome="timeout") >= 2


def test_dropped_stream_frees_its_slot(server, client):
    def send(body):
        stream = client.completions.create(stream=True, extra_body={"ignore_eos": True},
                                           **{k: v for k, v in body.items()
                                              if k != "ignore_eos"})
        assert next(iter(stream)).choices[0].finish_reason is None
        return stream

    _check_dropped_request_frees_its_slot(server, send, lambda stream: stream.close())


def test_client_leaving_a_whole_reply_frees_its_slot(server):
    host, port = server.url.removeprefix("http://").split(":")

    def send(body):
        data = json.dumps(body).encode()
        conn = socket.create_connection((host, int(port)))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        return conn

    _check_dropped_request_frees_its_slot(server, send, lambda conn: conn.close())


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert _health(server.url) == 200
    assert _metric(server, "eaglejax_generated_tokens_total") > 0
    assert _metric(server, "eaglejax_requests_total", outcome="rejected") > 0
    assert _metric(server, "eaglejax_time_to_first_token_seconds_count") > 0
    assert _metric(server, "eaglejax_acceptance_length_count") > 0
    assert _metric(server, "eaglejax_tokens_per_second") >= 0
    health = httpx.get(f"{server.url}/health", timeout=5).json()
    assert health["running"] == health["waiting"] == health["kv_tokens_used"] == 0
    assert health["kv_tokens"] == 4 * CAPACITY and health["max_waiting"] is None
    assert health["prefix_cache_blocks_used"] == _metric(server,
                                                         "eaglejax_prefix_cache_blocks_used")
    assert _metric(server, "eaglejax_prefix_cache_hit_tokens_total") >= 31
    assert _metric(server, "eaglejax_prefix_cache_prompt_tokens_total") > 0
    assert 0 < _metric(server, "eaglejax_prefix_cache_blocks_used") <= 4096 // 32


class _ByteTokenizer:
    """Token i decodes to PIECES[i] (bytes; a split UTF-8 character decodes to U+FFFD)."""

    PIECES = [b"a", b"\xc3", b"\xa9", b"S", b"T", b"O", b"P", b" "]

    def decode(self, ids):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def _stream_text(stop, ids):
    stream = TextStream(types.SimpleNamespace(tokenizer=_ByteTokenizer()), stop)
    sent = [stream.push([i]) for i in ids]
    tail, final = stream.finish()
    return sent, tail, final


def test_a_request_beyond_the_waiting_limit_gets_429(target, client):
    """One slot, none may wait: while a reply decodes, the next request is refused with
    OpenAI's rate-limit error and Retry-After, and served once the slot is free."""
    engine = _HeldEngine(Engine(target, num_slots=1, capacity=CAPACITY, max_waiting=0))
    with _serving(engine) as live:
        busy = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0,
                             timeout=TIMEOUT_S)
        engine.hold()
        try:
            engine.allow(1)  # the first step fills the slot; the second waits
            stream = busy.completions.create(model=MODEL, prompt="w5 w6", max_tokens=100,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
            assert next(iter(stream)).choices[0].finish_reason is None
            _poll(lambda: _metric(live, "eaglejax_running_rows") == 1, "the slot taken")
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                refused = pool.submit(_post, live, "/v1/completions", COMPLETION)
                time.sleep(0.2)  # in the engine's inbox, applied after the held step
                engine.release()
                response = refused.result(TIMEOUT_S)
        finally:
            engine.release()
        assert response.status_code == 429 and response.headers["Retry-After"] == "1"
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
        assert "already wait" in error["message"]
        stream.close()
        _poll(lambda: _metric(live, "eaglejax_running_rows") == 0, "the slot freed")
        assert busy.completions.create(model=MODEL, prompt="w5", max_tokens=2).usage


def test_text_stream_holds_back_split_characters_and_stop_prefixes():
    sent, tail, final = _stream_text(["STOP"], [0, 1, 2, 3, 4, 7, 3, 4, 5, 6, 0])
    assert sent == ["a", "", "é", "", "", "ST ", "", "", "", "", ""]
    assert (tail, final.text, final.token_ids, final.stopped) == \
        ("", "aéST ", [0, 1, 2, 3, 4, 7, 3, 4, 5, 6], True)
    sent, tail, final = _stream_text(["STOP"], [0, 3, 4, 1])
    assert "".join(sent) + tail == final.text == "aST\ufffd" and not final.stopped


def test_serve_command_warms_up_serves_and_stops(hf_family, target, tmp_path):
    """`eaglejax serve` in its own process: warm-up, a chat reply equal to `generate`,
    exit status 0 on Ctrl-C."""
    model = tmp_path / "tiny"
    shutil.copytree(hf_family("llama")[0], model)
    target.tokenizer.save(model)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "eaglejax.cli", "serve", "--model", str(model), "--capacity",
         "32", "--num-slots", "2", "--port", str(port)], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    try:
        _poll(lambda: proc.poll() is not None or _health(url) == 200, "eaglejax serve",
              timeout_s=TIMEOUT_S)
        assert proc.poll() is None, proc.stdout.read()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                               timeout=TIMEOUT_S)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w5 w9"}], max_tokens=6,
            temperature=0)
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=TIMEOUT_S)[0]
    assert proc.returncode == 0, output
    assert "compiling: 100%" in output and "warmed up in" in output
    storage = fastest_weight_dtype()  # the server stores its matrices as decodes fastest
    stored = target if storage is None else target.with_weight_dtype(storage)
    expected = eaglejax.generate(["w5 w9"], target=stored, max_new_tokens=6)[0]
    assert reply.choices[0].message.content == expected.text


def test_serve_flags_are_checked_before_loading(capsys):
    for flags, message in [(["--no-chat"], "--no-chat"), (["--json"], "--json"),
                           (["--port", "70000"], "--port"), (["--num-slots", "0"], "--num-slots")]:
        assert main(["serve", "--model", "no-such-model", *flags]) == 2
        assert message in capsys.readouterr().err


def test_a_paged_server_reports_its_blocks_and_preempts_without_loss(target, server, client):
    """A server over a paged KV cache of 4 blocks with 4 slots, expecting short replies:
    concurrent replies too long to fit at once are preempted and resumed (`/metrics` counts it), and each reply equals
    the slot server's; `/health` reports the blocks."""
    engine = Engine(target, num_slots=4, capacity=CAPACITY, kv_tokens=4 * 32,
                    prefix_cache_tokens=64)
    expect_short_replies(engine)  # so that the replies outgrow the pool
    cases = [Case(f"w{i} w{i + 3} w{2 * i}", chat=False, stream=False, max_tokens=60)
             for i in range(4)]
    with _serving(engine) as live:
        paged = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0,
                              timeout=TIMEOUT_S)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda case: _ask(paged, case)[:2], cases))
        assert _metric(live, "eaglejax_preemptions_total") > 0
        assert _metric(live, "eaglejax_kv_blocks_free") == 4
        assert _metric(live, "eaglejax_kv_blocks_used") == 0
        health = httpx.get(f"{live.url}/health", timeout=5).json()
        assert (health["kv_blocks"], health["kv_blocks_used"], health["kv_tokens"]) == (4, 0, 128)
        assert health["preemptions"] == _metric(live, "eaglejax_preemptions_total")
    assert got == [_ask(client, case)[:2] for case in cases]
