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


def _next_piece(pieces: Iterator[str]) -> str | None:
    """About `PIECE_CHARS` characters of JSON (None: the document is complete)."""
    out, size = [], 0
    for piece in pieces:
        out.append(piece)
        size += len(piece)
        if size >= PIECE_CHARS:
            break
    return "".join(out) if out else None


async def json_response(request: Request, build: Callable, *args) -> Response:
    """`build(*args)` (a JSON-able payload) as a JSON response, built and encoded in worker
    threads; a client that disconnects meanwhile gets nothing and the work stops at the
    next piece."""
    payload = await run_in_threadpool(build, *args)
    pieces = _ENCODER.iterencode(payload)
    body: list[str] = []
    while True:
        piece = await run_in_threadpool(_next_piece, pieces)
        if piece is None:
            break
        body.append(piece)
        if len(piece) >= PIECE_CHARS and await request.is_disconnected():
            logger.info("%s: client gone while its response was encoded", request.url.path)
            return Response(status_code=CLIENT_GONE)
    text = "".join(body)
    return Response(text.encode("utf-8"), media_type="application/json")
