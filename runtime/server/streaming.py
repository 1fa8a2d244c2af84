# SPDX-License-Identifier: Apache-2.0
"""Waiting on requests from an HTTP handler: whole results, merged snapshot streams,
server-sent events, and aborting everything when the client goes away."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request

from runtime.core.request import Req
from runtime.core.result import RequestResult
from runtime.engine.async_engine import AsyncEngine
from runtime.server.errors import error_payload

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2  # how often a handler checks that its client is still there


def sse(payload) -> str:
    """One server-sent event; a string payload (`[DONE]`) goes as is, anything else as JSON."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def guarded_sse(events: AsyncIterator[str], path: str) -> AsyncIterator[str]:
    """`events`, but an error part-way (the status line is gone already) ends the stream
    with an error event in the route's shape and `[DONE]` (as SGLang's streams do)."""
    try:
        async for event in events:
            yield event
    except Exception as err:  # noqa: BLE001 - reported to the client, logged here
        logger.error("stream of %s failed", path, exc_info=err)
        message = f"internal server error: {type(err).__name__}: {err}"
        yield sse(error_payload(path, message, 500))
        yield sse("[DONE]")


async def _abort_on_disconnect(request: Request, reqs: list[Req], engine: AsyncEngine) -> None:
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        if await request.is_disconnected():
            for req in reqs:
                engine.cancel(req)
            return


async def collect(request: Request, engine: AsyncEngine, reqs: list[Req]) -> list[RequestResult]:
    """Final results of `reqs`, in order; a client that disconnects meanwhile aborts them."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, reqs, engine))
    try:
        return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))
    finally:
        watcher.cancel()


def merged(
    request: Request, engine: AsyncEngine, reqs: list[Req]
) -> AsyncIterator[tuple[int, RequestResult]]:
    """(index, snapshot) of several requests as they arrive. Reading starts now, not when
    the response body starts: a client gone before its first byte still aborts them (and
    frees their ids). Closing the iterator (the client left mid-stream) aborts the rest.

    Each snapshot holds everything before it, so one that arrives while an older one of the
    same request still waits replaces it: a reader that falls behind costs one pending
    snapshot per request and one rendering per read, not one per step it missed."""
    pending: dict[int, RequestResult] = {}  # index -> newest snapshot not yet read
    ready = asyncio.Event()

    async def pump(index: int, req: Req) -> None:
        async for snapshot in engine.stream(req):
            pending.pop(index, None)  # re-inserted last: snapshots are read in arrival order
            pending[index] = snapshot
            ready.set()

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    tasks.append(asyncio.create_task(_abort_on_disconnect(request, reqs, engine)))
    return _drain(pending, ready, len(reqs), tasks)


async def _drain(
    pending: dict[int, RequestResult], ready: asyncio.Event, count: int, tasks: list
) -> AsyncIterator[tuple[int, RequestResult]]:
    remaining = count
    try:
        while remaining:
            await ready.wait()
            ready.clear()
            batch = list(pending.items())
            pending.clear()
            for index, snapshot in batch:
                remaining -= snapshot.finished
                yield index, snapshot
    finally:
        for task in tasks:
            task.cancel()
