# SPDX-License-Identifier: Apache-2.0
"""`AsyncEngine`: one background thread owns the `Engine` and runs its step loop; asyncio
callers submit requests and iterate their snapshots.

Only the loop thread touches the engine. Requests, aborts and calls reach it through an
inbox queue; after every step it takes an `EngineStats` snapshot (read by any thread as
`stats`) and hands each touched request's `RequestResult` (the text a stop string might
still claim held back) to the caller's event loop. A step that raises aborts the requests
it held, with the error, and the loop carries on: one bad request never takes the server
down. (SGLang splits the same roles over processes: TokenizerManager <-> Scheduler.)
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable

from runtime.core.request import Req
from runtime.core.result import RequestResult
from runtime.core.stats import EngineInfo, EngineStats
from runtime.engine.engine import Engine

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # an idle loop wakes this often to notice a shutdown
SHUTDOWN_JOIN_S = 10.0  # how long `shutdown` waits for the loop thread to finish its step
CALL_TIMEOUT_S = 30.0  # how long `call` waits for the loop thread to run a function

# on_step(results of the requests the step touched, stats after it, seconds it took)
StepObserver = Callable[[list[RequestResult], EngineStats, float], None]


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: StepObserver | None = None):
        self.engine, self.on_step = engine, on_step
        self.info: EngineInfo = engine.info
        self._stats: EngineStats = engine.stats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    @property
    def stats(self) -> EngineStats:
        """The snapshot the loop thread published after its latest step; safe from any thread."""
        return self._stats

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=SHUTDOWN_JOIN_S)

    # caller side ----------------------------------------------------------------------------
    async def stream(self, req: Req) -> AsyncIterator[RequestResult]:
        """Snapshots of `req` after every step that touched it; the last one is finished.
        Leaving early (client gone, task cancelled) aborts the request."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        self._subscribers[req.rid] = (loop, updates)
        self._inbox.put(("add", req))
        finished = False
        try:
            while not finished:
                snapshot = await updates.get()
                finished = snapshot.finished
                yield snapshot
        finally:
            self._subscribers.pop(req.rid, None)
            if not finished:
                self.abort(req.rid)

    async def generate(self, req: Req) -> RequestResult:
        """The finished request's result."""
        last = None
        async for snapshot in self.stream(req):
            last = snapshot
        return last

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    async def call(self, fn: Callable[[], object], timeout: float = CALL_TIMEOUT_S):
        """Run `fn()` on the loop thread between steps and return what it returns."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(("call", (fn, loop, future)))
        return await asyncio.wait_for(future, timeout)

    async def flush_cache(self) -> bool:
        """`Engine.flush_cache` on the loop thread; False if the loop does not answer."""
        if not self.alive:
            return False
        try:
            return bool(await self.call(self.engine.flush_cache))
        except asyncio.TimeoutError:
            return False

    # loop thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            if self._drain(block=not self.engine.has_work()):
                self._stats = self.engine.stats()
            if not self.engine.has_work():
                continue
            start = time.perf_counter()
            try:
                touched = self.engine.step()
            except Exception:  # noqa: BLE001 - the loop must survive any single failure
                touched = self._fail_running(traceback.format_exc())
            self._report(touched, time.perf_counter() - start)

    def _drain(self, block: bool) -> bool:
        """Handle everything in the inbox; True when there was something."""
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            self.engine.add_request(payload)
            if payload.finished:  # e.g. max_new_tokens = 0
                self._publish(self.engine.request_result(payload))
        elif kind == "abort":
            req = self.engine.abort(payload)
            if req is not None:
                self._report([req], 0.0)
        elif kind == "call":
            self._answer(*payload)

    def _answer(self, fn, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        try:
            value, error = fn(), None
        except Exception as err:  # noqa: BLE001 - handed to the caller, not raised here
            value, error = None, err
        self._stats = self.engine.stats()  # e.g. a flushed cache shows before the answer

        def settle() -> None:
            if future.done():  # the caller timed out meanwhile
                return
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)

        loop.call_soon_threadsafe(settle)

    def _report(self, touched: list[Req], seconds: float) -> None:
        """Stats first, so a caller holding its final result sees them already updated."""
        results = [self.engine.request_result(req) for req in touched]
        self._stats = self.engine.stats()
        if self.on_step is not None:
            self.on_step(results, self._stats, seconds)
        for result in results:
            self._publish(result)

    def _fail_running(self, error: str) -> list[Req]:
        self.last_error = error
        logger.error("engine step failed; aborting its requests:\n%s", error)
        message = "internal error while running this request: " + error.strip().splitlines()[-1]
        return self.engine.abort_all(message)

    def _publish(self, result: RequestResult) -> None:
        target = self._subscribers.get(result.rid)
        if target is None:
            return
        loop, updates = target
        loop.call_soon_threadsafe(updates.put_nowait, result)
