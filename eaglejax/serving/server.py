"""`eaglejax serve`: an OpenAI-compatible HTTP API (FastAPI on uvicorn) over the
continuous-batching engine.

Routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (whole replies, or
server-sent events with `stream: true`), `/health` and `/metrics` (Prometheus). Replies
carry the speculative statistics in an `eaglejax` field. Every error is an OpenAI error
object with a 4xx status (5xx: the server's own failure); a client that disconnects frees
its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import jax
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from eaglejax.decoding.token_logprobs import TokenLogprob, prompt_logprobs
from eaglejax.errors import ConfigError, InputError
from eaglejax.serving import engine as engine_api
from eaglejax.serving.logprobs_api import LogprobsFormat
from eaglejax.serving.metrics import ServingMetrics
from eaglejax.serving.openai_api import (
    APIError,
    ChatRequest,
    CompletionRequest,
    Job,
    Reply,
    finish_reason,
    parse_body,
    prepare,
    server_error,
    sse,
    usage,
)
from eaglejax.serving.textstream import FinalText, TextStream
from eaglejax.serving.worker import EngineWorker, RequestHandle, WorkerClosed

log = logging.getLogger("eaglejax.serving")
RETRY_AFTER_S = 1  # a refused request's Retry-After (seconds) when too many already wait
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A choice's new text as it streams, and the log-probabilities (if asked) of the
    tokens that arrived since the previous piece."""

    text: str
    logprobs: list[TokenLogprob] | None


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """A finished choice: its final text, OpenAI's finish reason, the engine's last
    update (its counts), and (if asked) the log-probabilities of the final text's tokens,
    those not yet streamed in `unsent`."""

    final: FinalText
    finish: str
    last: engine_api.Update
    logprobs: list[TokenLogprob] | None = None
    unsent: list[TokenLogprob] | None = None


def _usage(outcomes: list[_Outcome]) -> dict[str, Any]:
    """A reply's usage: its prompt once (cached tokens as the first choice found them),
    every choice's tokens."""
    first = outcomes[0].last
    return usage(first.prompt_tokens, sum(len(o.final.token_ids) for o in outcomes),
                 first.cached_tokens)


class _Service:
    """The routes' state: the engine's thread, the served model's name and the metrics."""

    def __init__(self, engine: engine_api.Engine, model_name: str, default_max_tokens: int,
                 request_timeout: float | None):
        if engine.target.tokenizer is None:
            raise ConfigError(f"{engine.target.source}: serving text needs a tokenizer")
        self.target = engine.target
        self.capacity = engine.capacity
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.request_timeout = request_timeout
        self.speculative = engine.speculation
        self.max_logprobs = engine.max_logprobs
        self.metrics = ServingMetrics(engine.policy, engine.round_splits, engine.prefix,
                                      engine if getattr(engine, "blocks", None) else None)
        self.worker = EngineWorker(engine, on_step=self.metrics.observe_step)
        self.created = int(time.time())

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "eaglejax"}

    async def list_models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def get_model(self, request: Request) -> JSONResponse:
        self._check_model(request.path_params["model"])
        return JSONResponse(self.model_card())

    async def health(self, request: Request) -> JSONResponse:
        """Whether the engine runs, and its load: requests running and waiting, the KV
        positions they hold of all the cache holds (a paged cache: also its blocks used of
        all, and preemptions so far), the prefix cache's blocks in use."""
        if self.worker.alive:
            engine = self.worker.engine
            prefix = engine.prefix
            blocks = getattr(engine, "blocks", None)
            return JSONResponse({
                "status": "ok", "running": engine.num_running, "waiting": engine.num_waiting,
                "max_waiting": engine.max_waiting, "kv_tokens_used": engine.kv_tokens(),
                "kv_tokens": engine.kv_capacity(),
                "kv_blocks_used": None if blocks is None else int(blocks.used),
                "kv_blocks": None if blocks is None else blocks.blocks,
                "preemptions": None if blocks is None else engine.preemptions,
                "prefix_cache_blocks_used": None if prefix is None else len(prefix.index),
                "prefix_cache_blocks": None if prefix is None else prefix.blocks})
        return JSONResponse({"status": "the engine is not running"}, status_code=503)

    async def metrics_page(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_body(CompletionRequest, await request.body()))

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, parse_body(ChatRequest, await request.body()))

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"`{self.model_name}`", param="model", code="model_not_found")

    async def _generate(self, request: Request, body: CompletionRequest | ChatRequest
                        ) -> Response:
        started = time.perf_counter()
        self._check_model(body.model)
        job = prepare(body, self.target, capacity=self.capacity,
                      default_max_tokens=self.default_max_tokens, max_logprobs=self.max_logprobs,
                      request_timeout=self.request_timeout)
        deadline = None if job.timeout is None else time.monotonic() + job.timeout
        reply = Reply.new(chat=isinstance(body, ChatRequest), model=self.model_name)
        echo = await self._echo(job)
        handles: list[RequestHandle] = []
        try:
            for index in range(job.n if job.max_tokens else 0):  # choice i: seed + i
                handles.append(self.worker.open(engine_api.Request(
                    reply.id if job.n == 1 else f"{reply.id}-{index}", job.prompt,
                    job.max_tokens, job.choice_sampling(index), job.stop_sequences,
                    job.ignore_eos, job.stop_token_ids, job.logprobs, deadline)))
                await handles[-1].accepted()
        except BaseException as err:
            for handle in handles:
                handle.cancel()
            raise _refusal(err) from None
        events = [self._events(handle, job, started, echo) for handle in handles] or \
            [self._echo_only(job, echo) for _ in range(job.n)]  # max_tokens 0
        if job.stream:
            return StreamingResponse(self._stream(reply, job, events),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        outcomes = await _unless_disconnected(request, asyncio.gather(*map(_last, events)))
        if outcomes is None:
            return Response(status_code=499)  # the client has gone: nobody reads this
        logprobs = LogprobsFormat(self.target.tokenizer, reply.chat)
        prefix = echo or _Piece("", [])
        return JSONResponse(reply.response(
            [(prefix.text + o.final.text, o.finish, None if o.logprobs is None else
              logprobs.body((prefix.logprobs or []) + o.logprobs)[0]) for o in outcomes],
            _usage(outcomes), self._extension(outcomes)))

    async def _echo(self, job: Job) -> _Piece | None:
        """A completion's prompt as its reply's first piece (`echo`): its text, and with
        `logprobs` each prompt token's after those before it (one forward over the prompt,
        on a worker thread)."""
        if not job.echo:
            return None
        entries = None
        if job.logprobs is not None:
            if jax.process_count() > 1:
                raise APIError(400, "echo with logprobs: a multi-process server does not score "
                                    "prompts", param="echo", code="invalid_value")
            entries = await asyncio.to_thread(prompt_logprobs, self.target, job.prompt,
                                              job.logprobs)
        return _Piece(self.target.tokenizer.decode(job.prompt), entries)

    async def _echo_only(self, job: Job, echo: _Piece) -> AsyncIterator[_Piece | _Outcome]:
        """A choice of `max_tokens` 0 (with `echo`): the prompt, and no token."""
        yield echo
        asked = job.logprobs is not None
        yield _Outcome(FinalText("", [], False), "length",
                       engine_api.Update(None, [], "length", len(job.prompt), 0, 0),
                       [] if asked else None, [] if asked else None)

    async def _events(self, handle: RequestHandle, job: Job, started: float,
                      echo: _Piece | None = None) -> AsyncIterator[_Piece | _Outcome]:
        """The reply's new text as it comes (after the `echo` piece, if any; each piece with
        the log-probabilities, if asked, of the tokens that came with it or were held back
        before it), then its `_Outcome`. Leaving early (the client disconnected) frees the
        request's slot."""
        if echo is not None:
            yield echo
        text = TextStream(self.target, job.stop)
        last, outcome = None, "cancelled"
        asked = job.logprobs is not None
        logprobs: list[TokenLogprob] = []
        sent = 0  # entries of `logprobs` streamed
        try:
            async for update in handle.updates():
                if last is None:
                    self.metrics.observe_first_token(time.perf_counter() - started)
                last = update
                if update.finish_reason == "timeout" and not update.generated:
                    outcome = "timeout"
                    raise APIError(503, f"the request waited {job.timeout:g} s (its timeout) "
                                        f"and got no slot; retry later", code="deadline_exceeded",
                                   kind="server_error")
                logprobs.extend(update.logprobs or [])
                delta = text.push(update.token_ids)
                if delta:
                    yield _Piece(delta, logprobs[sent:] if asked else None)
                    sent = len(logprobs)
                if text.stop_seen:  # a stop string the engine's token sequences missed
                    handle.cancel()
                    break
            tail, final = text.finish()
            del logprobs[len(final.token_ids):]  # past a stop string: not the reply's
            if tail:
                yield _Piece(tail, logprobs[sent:] if asked else None)
                sent = len(logprobs)
            result = _Outcome(final, "stop" if final.stopped else
                              finish_reason(last.finish_reason), last,
                              logprobs if asked else None,
                              logprobs[sent:] if asked else None)
            outcome = "timeout" if last.finish_reason == "timeout" else result.finish
        except APIError:
            raise  # the request's own end (its outcome set)
        except Exception:
            outcome = "error"
            raise
        finally:
            handle.cancel()
            self.metrics.observe_finished(
                outcome, None if last is None else last.acceptance_length)
        yield result

    async def _stream(self, reply: Reply, job: Job,
                      events: list[AsyncIterator[_Piece | _Outcome]]) -> AsyncIterator[str]:
        """The reply as server-sent events in OpenAI's chunk format, its choices' chunks
        as they come, ending with [DONE]; a failure mid-stream is sent as an error object."""
        if reply.chat:
            for index in range(len(events)):
                yield sse(reply.chunk(None, index=index))
        outcomes: dict[int, _Outcome] = {}
        logprobs = LogprobsFormat(self.target.tokenizer, reply.chat)
        offsets = [0] * len(events)  # a completion's text offset of each choice's next token

        def entries(index: int, items: list[TokenLogprob] | None) -> dict[str, Any] | None:
            if items is None:
                return None
            body, offsets[index] = logprobs.body(items, offsets[index])
            return body

        try:
            async for index, event in _merged(events):
                if isinstance(event, _Piece):
                    yield sse(reply.chunk(event.text, index=index,
                                          logprobs=entries(index, event.logprobs)))
                    continue
                outcomes[index] = event
                yield sse(reply.chunk("", event.finish, self._extension([event]), index,
                                      entries(index, event.unsent)))
            if job.include_usage:
                yield sse(reply.usage_chunk(_usage([outcomes[i] for i in sorted(outcomes)])))
        except APIError as err:  # the request's own end (a deadline passed)
            yield sse(err.body())
        except Exception as err:
            log.exception("a streamed reply failed")
            yield sse(server_error(err).body())
        yield sse("[DONE]")

    def _extension(self, outcomes: list[_Outcome]) -> dict[str, Any]:
        """The `eaglejax` field: these choices' speculative statistics (acceptance length:
        tokens per target forward after each first token; rounds: those forwards), and
        whether a choice was cut by the request's timeout (its finish reason: "length")."""
        rounds = sum(o.last.rounds for o in outcomes)
        after_first = sum(o.last.generated - 1 for o in outcomes)
        return {"acceptance_length": after_first / rounds if rounds else None,
                "rounds": rounds, "speculative": self.speculative,
                "timed_out": any(o.last.finish_reason == "timeout" for o in outcomes)}


def _refusal(err: BaseException) -> BaseException:
    """The error answering a request the engine refused (or could not take)."""
    if isinstance(err, engine_api.QueueFull):
        return APIError(429, str(err), code="queue_full", kind="rate_limit_error",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(err, InputError):
        return APIError(400, str(err), code="invalid_value")
    if isinstance(err, WorkerClosed):
        return APIError(503, str(err), kind="server_error")
    return err


async def _merged(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index, item) of every item of `iterators` as they come (each one's in order);
    closing it closes them all."""
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield index, item
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()


async def _last(events: AsyncIterator[_Piece | _Outcome]) -> _Outcome:
    async for event in events:
        if isinstance(event, _Outcome):
            return event
    raise RuntimeError("the reply ended without an outcome")


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the request body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None (`work` cancelled, and done) if the client disconnects
    first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    return None if task.cancelled() else task.result()


def create_app(engine: engine_api.Engine, *, model_name: str, default_max_tokens: int = 128,
               request_timeout: float | None = None) -> FastAPI:
    """The HTTP app serving `engine` as `model_name`; requests without max_tokens get
    `default_max_tokens` (at most what the context leaves); a request may take at most
    `request_timeout` seconds (None: no limit; its own `timeout` may be shorter), waiting and
    decoding. The app's lifespan runs the engine's thread: call the engine from no other
    thread meanwhile."""
    service = _Service(engine, model_name, default_max_tokens, request_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.worker.start()
        try:
            yield
        finally:
            service.worker.stop()

    app = FastAPI(title="eaglejax", lifespan=lifespan)
    app.add_api_route("/health", service.health, methods=["GET"])
    app.add_api_route("/metrics", service.metrics_page, methods=["GET"])
    app.add_api_route("/v1/models", service.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model}", service.get_model, methods=["GET"])
    app.add_api_route("/v1/completions", service.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", service.chat_completions, methods=["POST"])

    async def api_error(request: Request, err: APIError) -> JSONResponse:
        service.metrics.observe_rejected(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return await api_error(request, APIError(err.status_code, str(err.detail)))

    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        return await api_error(request, server_error(err))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
    return app


def run_server(engine: engine_api.Engine, *, host: str, port: int, model_name: str,
               default_max_tokens: int = 128, request_timeout: float | None = None,
               log_level: str = "info") -> None:
    """Serve `engine` on host:port until interrupted (Ctrl-C, SIGTERM)."""
    app = create_app(engine, model_name=model_name, default_max_tokens=default_max_tokens,
                     request_timeout=request_timeout)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
