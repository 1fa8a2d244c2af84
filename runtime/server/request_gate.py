# SPDX-License-Identifier: Apache-2.0
"""What every request passes before routing: the API key and the body size limit.

A pure ASGI middleware (as Starlette's docs recommend over `@app.middleware("http")`,
whose `BaseHTTPMiddleware` wraps `receive` so a handler never sees its client disconnect:
non-streaming requests of a client that hung up would run to the end). The body is read
here, up to `--max-body-size` bytes (413 beyond), and handed to the app unchanged; after it
the app reads the client's own `receive`, so `http.disconnect` still arrives.

The key is `Authorization: Bearer <key>`, the scheme case-insensitive (RFC 7235) and the
key compared in constant time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.errors import error_payload

OPEN_PATHS = ("/health",)  # answered without an API key (liveness probes)
# A body over the limit is still read (and dropped) up to this many bytes, so the client
# gets its 413 instead of a reset connection; past it the connection is just closed.
DRAIN_LIMIT_BYTES = 256 * 2**20


def bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
            return None
    return None


class RequestGate:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_size: int):
        self.app, self.max_body_size = app, max_body_size
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.api_key is not None and path not in OPEN_PATHS:
            token = bearer_token(scope)
            if token is None or not hmac.compare_digest(token, self.api_key):
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                await self._reply(scope, receive, send, message, 401)
                return
        body, complete = await self._read_body(receive)
        if body is None:  # the client left while sending
            return
        if not complete:
            message = (
                f"the request body is larger than {self.max_body_size} bytes "
                "(--max-body-size); send a smaller request"
            )
            await self._reply(scope, receive, send, message, 413)
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, bool]:
        """(body, True) within the limit; (b"", False) over it; (None, _) on disconnect."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, False
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_body_size:
                chunks = []
                if size > DRAIN_LIMIT_BYTES:
                    break
                continue
            chunks.append(chunk)
        if size > self.max_body_size:
            return b"", False
        return b"".join(chunks), True

    @staticmethod
    async def _reply(scope: Scope, receive: Receive, send: Send, message: str, status: int):
        payload = error_payload(scope["path"], message, status)
        await JSONResponse(payload, status_code=status)(scope, receive, send)
