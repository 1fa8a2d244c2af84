# SPDX-License-Identifier: Apache-2.0
"""Waiting on requests from an HTTP handler: whole results, merged snapshot streams,
server-sent events, and aborting everything when the client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request

from runtime.core.request import Req
from runtime.core.result import RequestResult
from runtime.engine.async_engine import AsyncEngine

DISCONNECT_POLL_S = 0.2  # how often a non-streaming handler checks that its client is there


def sse(payload) -> str:
    """One server-sent event; a string payload (`[DONE]`) goes as is, anything else as JSON."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def json_body(request: Request):
    """The parsed body (`{}` when empty); bad JSON raises `json.JSONDecodeError` (a 400)."""
    raw = await request.body()
    return json.loads(raw) if raw else {}


async def _abort_on_disconnect(request: Request, reqs: list[Req], engine: AsyncEngine) -> None:
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        if await request.is_disconnected():
            for req in reqs:
                engine.abort(req.rid)
            return


async def collect(request: Request, engine: AsyncEngine, reqs: list[Req]) -> list[RequestResult]:
    """Final results of `reqs`, in order; a client that disconnects meanwhile aborts them."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, reqs, engine))
    try:
        return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))
    finally:
        watcher.cancel()


async def merged(engine: AsyncEngine, reqs: list[Req]) -> AsyncIterator[tuple[int, RequestResult]]:
    """(index, snapshot) of several requests as they arrive; closing it (the client left a
    streaming response) aborts the rest."""
    updates: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, req: Req) -> None:
        async for snapshot in engine.stream(req):
            await updates.put((index, snapshot))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    remaining = len(reqs)
    try:
        while remaining:
            index, snapshot = await updates.get()
            remaining -= snapshot.finished
            yield index, snapshot
    finally:
        for task in tasks:
            task.cancel()
