# SPDX-License-Identifier: Apache-2.0
"""`AsyncEngine`: one background thread owns the `EngineCore` and runs its step loop; asyncio
callers submit requests and iterate their snapshots.

Only the loop thread touches the engine. Requests, aborts and calls reach it through an
inbox queue; after every step it takes an `EngineStats` snapshot (read by any thread as
`stats`) and hands each touched request's `RequestResult` (the text a stop string might
still claim held back) to the caller's event loop. The scheduler pins a failing step on
its culprit (`scheduler.fault_isolation`); should the scheduler itself raise, the loop
aborts what it held and carries on: one bad request never takes the server down.
(SGLang splits the same roles over processes: TokenizerManager <-> Scheduler.)

On the event loop side every live request id is claimed (`submit`) until its caller has
its final result: a second request with a live id is refused (`DuplicateRequestError`)
instead of stealing the first one's output, and the client's id of an `n > 1` request
names its choices (`abort` aborts them all).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from runtime.core.errors import DuplicateRequestError
from runtime.core.request import Req
from runtime.core.result import RequestResult
from runtime.core.stats import EngineInfo, EngineStats
from runtime.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # an idle loop wakes this often to notice a shutdown
SHUTDOWN_JOIN_S = 10.0  # how long `shutdown` waits for the loop thread to finish its step
CALL_TIMEOUT_S = 30.0  # how long `call` waits for the loop thread to run a function

# on_step(results of the requests the step touched, stats after it, seconds it took)
StepObserver = Callable[[list[RequestResult], EngineStats, float], None]


@dataclass(frozen=True)
class _Subscription:
    req: Req
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: EngineCore, on_step: StepObserver | None = None):
        self.engine, self.on_step = engine, on_step
        self.info: EngineInfo = engine.info
        self._stats: EngineStats = engine.stats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._subscribers: dict[str, _Subscription] = {}  # live request id -> its caller
        self._children: dict[str, list[str]] = {}  # client id of a live n > 1 request -> choices
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

    def shutdown(self, message: str = "the server is shutting down") -> None:
        """Abort what is left (its callers get their results) and stop the loop thread."""
        self._inbox.put(("abort_all", message))
        self._inbox.put(("stop", None))
        self._thread.join(timeout=SHUTDOWN_JOIN_S)
        self._stopped.set()

    # caller side ----------------------------------------------------------------------------
    def submit(self, reqs: Sequence[Req]) -> None:
        """Claim the ids of `reqs` and queue them; call on the event loop, then read each
        with `stream` or `generate`. Raises `DuplicateRequestError` (nothing is queued)
        when an id, or the client id of an `n > 1` request, is live or repeated."""
        loop = asyncio.get_running_loop()
        ids = [r.rid for r in reqs]
        parents = {r.parent_rid for r in reqs if r.parent_rid is not None}
        wanted = Counter(ids + sorted(parents))
        clashes = sorted(rid for rid, count in wanted.items() if count > 1 or self.is_live(rid))
        if clashes:
            raise DuplicateRequestError(
                f"request id(s) {clashes} already belong to a live request; use new ids",
                param="rid",
            )
        for req in reqs:
            self._subscribers[req.rid] = _Subscription(req, loop, asyncio.Queue())
        for parent in parents:
            self._children[parent] = [r.rid for r in reqs if r.parent_rid == parent]
        for req in reqs:
            self._inbox.put(("add", req))

    def is_live(self, rid: str) -> bool:
        return rid in self._subscribers or rid in self._children

    async def stream(self, req: Req) -> AsyncIterator[RequestResult]:
        """Snapshots of `req` after every step that touched it; the last one is finished.
        Submits `req` unless `submit` did. Leaving early (client gone, task cancelled)
        aborts the request."""
        sub = self._subscribers.get(req.rid)
        if sub is None or sub.req is not req:
            self.submit([req])
            sub = self._subscribers[req.rid]
        finished = False
        try:
            while not finished:
                snapshot = await sub.updates.get()
                finished = snapshot.finished
                yield snapshot
        finally:
            if not finished:
                self._inbox.put(("abort", req.rid))
            self._unclaim(req)

    async def generate(self, req: Req) -> RequestResult:
        """The finished request's result."""
        last = None
        async for snapshot in self.stream(req):
            last = snapshot
        return last

    def abort(self, rid: str) -> list[str]:
        """Abort the live request `rid`, or every choice of the `n > 1` request the client
        named `rid`. Returns the ids it aborts (empty: nothing live has that id)."""
        if rid in self._subscribers:
            targets = [rid]
        else:
            targets = list(self._children.get(rid, ()))
        for target in targets:
            self._inbox.put(("abort", target))
        return targets

    def cancel(self, req: Req) -> None:
        """Abort `req` if it is still live (a later request reusing its id is left alone)."""
        sub = self._subscribers.get(req.rid)
        if sub is not None and sub.req is req:
            self._inbox.put(("abort", req.rid))

    def abort_all(self, message: str) -> None:
        """Abort every request the engine holds (a shutdown past its grace period); safe
        from any thread."""
        self._inbox.put(("abort_all", message))

    def _unclaim(self, req: Req) -> None:
        sub = self._subscribers.get(req.rid)
        if sub is not None and sub.req is req:
            del self._subscribers[req.rid]
        siblings = self._children.get(req.parent_rid) if req.parent_rid else None
        if siblings is not None and req.rid in siblings:
            siblings.remove(req.rid)
            if not siblings:
                del self._children[req.parent_rid]

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
        try:
            self._handle_one(kind, payload)
        except Exception:  # noqa: BLE001 - the loop must survive any single failure
            logger.exception("engine loop: handling %r failed", kind)
            if kind == "add" and not payload.finished:
                self.engine.abort(payload.rid, "internal error while queueing this request")
                payload.abort("internal error while queueing this request")
                self._report([payload], 0.0)

    def _handle_one(self, kind: str, payload) -> None:
        if kind == "stop":
            self._stopped.set()
        elif kind == "add":
            self.engine.add_request(payload)
            if payload.finished:  # e.g. max_new_tokens = 0: counted like any other
                self._report([payload], 0.0)
        elif kind == "abort":
            req = self.engine.abort(payload)
            if req is not None:
                self._report([req], 0.0)
        elif kind == "abort_all":
            self._report(self.engine.abort_all(payload), 0.0)
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
        for req, result in zip(touched, results):
            self._publish(req, result)

    def _fail_running(self, error: str) -> list[Req]:
        self.last_error = error
        logger.error("engine step failed; aborting its requests:\n%s", error)
        message = "internal error while running this request: " + error.strip().splitlines()[-1]
        return self.engine.abort_all(message)

    def _publish(self, req: Req, result: RequestResult) -> None:
        """Hand `result` to the caller of `req` (not to a later request reusing its id)."""
        sub = self._subscribers.get(req.rid)
        if sub is None or sub.req is not req:
            return
        sub.loop.call_soon_threadsafe(sub.updates.put_nowait, result)
