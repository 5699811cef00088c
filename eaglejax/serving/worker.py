"""The engine's own thread: the only caller of the (not thread-safe) Engine. HTTP handlers
on the event loop reach it through a thread-safe inbox and get its updates back on
asyncio queues."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Hashable

from eaglejax.serving.engine import Engine, Request, Update

log = logging.getLogger("eaglejax.serving")

Sink = Callable[[object], None]  # takes _ACCEPTED, an Update or an exception
StepHook = Callable[[list[Update], int, int], None]  # updates, queued, running


class _Accepted:
    """The engine took the request (it passed `Engine.submit`'s checks)."""


_ACCEPTED = _Accepted()
_STOP = object()


class WorkerClosed(RuntimeError):
    """The engine thread stopped (the server is shutting down, or the engine failed)."""


class EngineWorker:
    """Runs the engine on a thread: submissions and cancellations from the inbox, then
    `step()` while any request is queued or running, blocking on the inbox when idle.
    `on_step` sees every round of the loop (its updates, then the queued and running
    counts)."""

    def __init__(self, engine: Engine, on_step: StepHook | None = None):
        self.engine = engine
        self._on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[Hashable, Sink] = {}
        self._lock = threading.Lock()  # orders `open` against the thread closing
        self._closed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="eaglejax-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._closed is None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop after the current step; requests still in flight get `WorkerClosed`."""
        self._inbox.put((_STOP,))
        self._thread.join(timeout)

    def open(self, request: Request) -> RequestHandle:
        """Submit `request` (call on the event loop); its updates come to the handle."""
        handle = RequestHandle(self, request.key)
        with self._lock:
            if self._closed is not None:
                raise WorkerClosed(f"the engine is not running ({self._closed})")
            self._inbox.put(("submit", request, handle.sink()))
        return handle

    def cancel(self, key: Hashable) -> None:
        self._inbox.put(("cancel", key))

    def _run(self) -> None:
        reason: BaseException = WorkerClosed("the server is shutting down")
        try:
            while self._take_inbox(block=self.engine.idle):
                updates = self.engine.step() if not self.engine.idle else []
                for update in updates:
                    self._deliver(update)
                if self._on_step is not None:
                    self._on_step(updates, self.engine.num_queued, self.engine.num_running)
        except Exception as err:  # the engine failed: fail every request, serve no more
            log.exception("the engine failed")
            reason = err
        self._close(reason)

    def _take_inbox(self, block: bool) -> bool:
        """Apply every waiting message (first waiting for one when `block`); False on stop."""
        try:
            message = self._inbox.get(block=block)
            while True:
                if message[0] is _STOP:
                    return False
                self._apply(*message)
                message = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, kind: str, *args) -> None:
        if kind == "cancel":
            if self._sinks.pop(args[0], None) is not None:
                self.engine.cancel(args[0])
            return
        request, sink = args
        try:
            self.engine.submit(request)
        except Exception as err:  # InputError: the request's fault; any other: answered too
            sink(err)
            return
        self._sinks[request.key] = sink
        sink(_ACCEPTED)

    def _deliver(self, update: Update) -> None:
        sink = self._sinks.get(update.key)
        if sink is None:
            return
        if update.finish_reason is not None:
            del self._sinks[update.key]
        try:
            sink(update)
        except RuntimeError:  # its event loop has closed: nobody waits for it
            if self._sinks.pop(update.key, None) is not None:
                self.engine.cancel(update.key)

    def _close(self, reason: BaseException) -> None:
        """No more requests: answer those in flight and those still in the inbox."""
        with self._lock:
            self._closed = reason
        sinks = list(self._sinks.values())
        self._sinks.clear()
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            if message[0] == "submit":
                sinks.append(message[2])
        for sink in sinks:
            try:
                sink(reason)
            except RuntimeError:
                pass


class RequestHandle:
    """One request in flight, seen from the event loop that opened it."""

    def __init__(self, worker: EngineWorker, key: Hashable):
        self.key = key
        self._worker = worker
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.done = False

    def sink(self) -> Sink:
        """What the engine thread calls with each item for this request."""
        return lambda item: self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def accepted(self) -> None:
        """Wait until the engine took the request; its exception if it refused it."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item

    async def updates(self) -> AsyncIterator[Update]:
        """The request's updates, up to the one that finishes it; the engine thread's
        exception if it failed."""
        while not self.done:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.done = True
                raise item
            self.done = item.finish_reason is not None
            yield item

    def cancel(self) -> bool:
        """Free the request's slot unless it has finished; whether it was still running."""
        if self.done:
            return False
        self.done = True
        self._worker.cancel(self.key)
        return True
