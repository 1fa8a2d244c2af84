# SPDX-License-Identifier: Apache-2.0
"""`AsyncEngine`: one background thread owns the `Engine` and runs its step loop; asyncio
callers submit requests and iterate their snapshots.

Only the loop thread touches the engine. Requests and aborts reach it through a queue;
after every step each touched request's snapshot (its `/generate` result so far, with the
text a stop string might still claim held back) is handed to the caller's event loop.
A step that raises aborts the requests it held, with the error, and the loop carries on:
one bad request never takes the server down.
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
from runtime.engine.engine import Engine

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(
        self, engine: Engine, on_step: Callable[[Engine, list[Req], float], None] | None = None
    ):
        self.engine, self.on_step = engine, on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=10)

    # caller side ----------------------------------------------------------------------------
    async def stream(self, req: Req) -> AsyncIterator[dict]:
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
                finished = snapshot["finished"]
                yield snapshot
        finally:
            self._subscribers.pop(req.rid, None)
            if not finished:
                self.abort(req.rid)

    async def generate(self, req: Req) -> dict:
        """The finished request's result."""
        last = None
        async for update in self.stream(req):
            last = update
        last.pop("finished")
        return last

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    # loop thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            start = time.perf_counter()
            try:
                touched = self.engine.step()
            except Exception:  # noqa: BLE001 - the loop must survive any single failure
                touched = self._fail_running(traceback.format_exc())
            if self.on_step is not None:
                self.on_step(self.engine, touched, time.perf_counter() - start)
            for req in touched:
                self._publish(req)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            self.engine.add_request(payload)
            if payload.finished:  # e.g. max_new_tokens = 0
                self._publish(payload)
        elif kind == "abort":
            req = self.engine.abort(payload)
            if req is not None:
                if self.on_step is not None:
                    self.on_step(self.engine, [req], 0.0)
                self._publish(req)

    def _fail_running(self, error: str) -> list[Req]:
        self.last_error = error
        logger.error("engine step failed; aborting its requests:\n%s", error)
        message = "internal error while running this request: " + error.strip().splitlines()[-1]
        failed = []
        for req in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
            self.engine.abort(req.rid, message)
            failed.append(req)
        return failed

    def _publish(self, req: Req) -> None:
        target = self._subscribers.get(req.rid)
        if target is None:
            return
        loop, updates = target
        snapshot = self.engine.result(req)
        snapshot["finished"] = req.finished
        if not req.finished:
            snapshot["text"] = req.visible_text() if snapshot["text"] is not None else None
        loop.call_soon_threadsafe(updates.put_nowait, snapshot)
