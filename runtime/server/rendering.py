# SPDX-License-Identifier: Apache-2.0
"""Response bodies built and encoded off the event loop, in bounded pieces.

A response can be large (logprobs: up to `--max-logprob-entries` entries); turning it into
JSON on the event loop (what returning a dict from a route does: FastAPI's
`jsonable_encoder`, then `json.dumps`) stalls every other connection, `/health` included.
Here the payload is built in a worker thread and encoded there in pieces of about
`PIECE_CHARS` characters; between pieces the handler checks its client is still there and
drops the work when it is not. The bytes are those of Starlette's `JSONResponse` (compact
separators, UTF-8, no NaN).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

logger = logging.getLogger(__name__)

PIECE_CHARS = 1 << 20  # characters of JSON encoded per worker-thread call

# Starlette's `JSONResponse.render` settings
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))

# nginx's "client closed request": logged when a body is dropped, never seen by the client
CLIENT_GONE = 499


def _next_piece(pieces: Iterator[str]) -> tuple[bytes, bool]:
    """About `PIECE_CHARS` characters of JSON, as UTF-8, and whether more may follow."""
    out, size = [], 0
    for piece in pieces:
        out.append(piece)
        size += len(piece)
        if size >= PIECE_CHARS:
            return "".join(out).encode("utf-8"), True
    return "".join(out).encode("utf-8"), False


async def json_response(request: Request, build: Callable, *args) -> Response:
    """`build(*args)` (a JSON-able payload) as a JSON response, built and encoded in worker
    threads; a client that disconnects meanwhile gets nothing and the work stops at the
    next piece."""
    payload = await run_in_threadpool(build, *args)
    pieces = _ENCODER.iterencode(payload)
    body: list[bytes] = []
    more = True
    while more:
        piece, more = await run_in_threadpool(_next_piece, pieces)
        body.append(piece)
        if more and await request.is_disconnected():
            logger.info("%s: client gone while its response was encoded", request.url.path)
            return Response(status_code=CLIENT_GONE)
    content = body[0] if len(body) == 1 else await run_in_threadpool(b"".join, body)
    return Response(content, media_type="application/json")
