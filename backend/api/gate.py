"""The admin API's front door, as a plain ASGI middleware in front of every route.

It checks the bearer token from the request line's headers *before* any body is read, so an
unauthenticated client cannot make the bridge buffer or parse anything, and it caps request
bodies: a declared `Content-Length` over the cap is refused at once (413), a streamed body is
cut off the moment it passes the cap. Both refusals use the API's JSON error shape.
"""

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from backend.auth import token_matches

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Readable without a token: health for probes, and the API's own description.
OPEN_PATHS = frozenset({"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class BodyTooLarge(Exception):
    """Raised inside `receive` when a streamed body passes the cap."""


class AdminGate:
    def __init__(self, app: AsgiApp, admin_token: str, *, max_body_bytes: int = 65536) -> None:
        self.app = app
        self._admin_token = admin_token
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if scope["path"] not in OPEN_PATHS and not token_matches(
            headers.get(b"authorization", b"").decode("latin-1"), self._admin_token
        ):
            await _refuse(send, 401, "unauthorized", "missing or invalid admin token")
            return
        declared = headers.get(b"content-length")
        if declared is not None and (
            not declared.isdigit() or int(declared) > self._max_body_bytes
        ):
            await _refuse(send, 413, "body_too_large", self._too_large())
            return
        capped = _CappedReceive(receive, self._max_body_bytes)
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, capped, watched_send)
        except BodyTooLarge:
            if not started:
                await _refuse(send, 413, "body_too_large", self._too_large())

    def _too_large(self) -> str:
        return f"request body larger than {self._max_body_bytes} bytes"


class _CappedReceive:
    """`receive` that raises BodyTooLarge once the body read so far passes the cap."""

    __slots__ = ("_limit", "_receive", "_seen")

    def __init__(self, receive: Receive, limit: int) -> None:
        self._receive = receive
        self._limit = limit
        self._seen = 0

    async def __call__(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self._seen += len(message.get("body", b""))
            if self._seen > self._limit:
                raise BodyTooLarge
        return message


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in scope["headers"]}


async def _refuse(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
