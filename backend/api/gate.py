"""The HTTP API's front door, as a plain ASGI middleware in front of every route.

It resolves the bearer token from the request line's headers to a `Principal` *before* any body
is read, so an unauthenticated client cannot make the bridge buffer or parse anything: the admin
token is the principal with every scope, an API key (`esk_...`, looked up in the key store's
in-memory index, no database round trip) gives its own scopes, anything else is 401. The
principal goes into the ASGI scope (`scope["state"]["principal"]`, i.e. `request.state.principal`)
for the routes, which each require their scope (backend/api/scopes.py). The gate also caps
request bodies: a declared `Content-Length` over the cap is refused at once (413), a streamed
body is cut off the moment it passes the cap. The one exception is a firmware upload
(`PUT /api/firmware/<board>/<version>` by an admin principal), capped at `upload_bytes`
instead. Refusals use the API's JSON error shape (OpenAI's, backend/api/errors.py).

`/.well-known/...` needs no token either: MCP clients probe
`/.well-known/oauth-protected-resource` before they send a key, and a 401 there would tell them
to look for an OAuth server this bridge does not have; no route answers it, so it is 404.
"""

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from backend.api.errors import error_body, error_headers, openai_status
from backend.auth import token_matches
from backend.console import CONSOLE_PREFIX, PAGES
from backend.keys.store import Principal, admin_principal

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Readable without a token: the probes (liveness, readiness and its alias /healthz; their bodies
# hold no secret), and the API's own description.
# The console's pages and assets too: they hold no data, and what they fetch needs the key.
PROBE_PATHS = frozenset({"/livez", "/readyz", "/healthz"})
OPEN_PATHS = frozenset(
    {*PROBE_PATHS, "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", *PAGES}
)
# Public metadata by definition (RFC 8615); the console's static files.
OPEN_PREFIXES = ("/.well-known/", CONSOLE_PREFIX)
# Front ends used with API keys rather than the admin token (only the 401 message differs).
KEY_PATHS = ("/v1/", "/mcp", "/api/chat/")
PRINCIPAL = "principal"
UPLOAD_PREFIX = "/api/firmware/"  # PUT by an admin: a firmware image, capped at upload_bytes

KeyResolver = Callable[[str], Principal | None]


class BodyTooLarge(Exception):
    """Raised inside `receive` when a streamed body passes the cap."""


class AdminGate:
    """The ASGI middleware that authenticates and caps every request (see the module docstring)."""

    def __init__(
        self,
        app: AsgiApp,
        admin_token: str,
        *,
        max_body_bytes: int = 65536,
        resolve_key: KeyResolver | None = None,
        upload_bytes: int = 32 << 20,
    ) -> None:
        self.app = app
        self._upload_bytes = upload_bytes
        self._admin_token = admin_token
        self._admin = admin_principal()
        self._resolve_key = resolve_key
        self._max_body_bytes = max_body_bytes

    def principal(self, authorization: str) -> Principal | None:
        """Who sends this `Authorization` header value: admin, an API key's principal, or None."""
        if not authorization:
            return None
        if token_matches(authorization, self._admin_token):
            return self._admin
        if self._resolve_key is not None:
            return self._resolve_key(authorization)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Authenticate an HTTP request and cap its body, or refuse it before a byte is read."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        path: str = scope["path"]
        limit = self._max_body_bytes
        if path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            principal = self.principal(headers.get(b"authorization", b"").decode("latin-1"))
            if principal is None:
                what = "API key" if path.startswith(KEY_PATHS) else "admin token"
                await _refuse(send, path, 401, "unauthorized", f"missing or invalid {what}")
                return
            scope.setdefault("state", {})[PRINCIPAL] = principal
            if principal.is_admin and scope["method"] == "PUT" and path.startswith(UPLOAD_PREFIX):
                limit = self._upload_bytes
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _refuse(send, path, 413, "body_too_large", self._too_large(limit))
            return
        capped = _CappedReceive(receive, limit)
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            if capped.exceeded:  # the app answered a body it could not read (FastAPI: 400)
                if not started:
                    started = True
                    await _refuse(send, path, 413, "body_too_large", self._too_large(limit))
                return
            started = True
            await send(message)

        try:
            await self.app(scope, capped, watched_send)
        except BodyTooLarge:
            if not started:
                await _refuse(send, path, 413, "body_too_large", self._too_large(limit))

    @staticmethod
    def _too_large(limit: int) -> str:
        return f"request body larger than {limit} bytes"


class _CappedReceive:
    """`receive` that raises BodyTooLarge once the body read so far passes the cap."""

    __slots__ = ("_limit", "_receive", "_seen", "exceeded")

    def __init__(self, receive: Receive, limit: int) -> None:
        self._receive = receive
        self._limit = limit
        self._seen = 0
        self.exceeded = False

    async def __call__(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self._seen += len(message.get("body", b""))
            if self._seen > self._limit:
                self.exceeded = True
                raise BodyTooLarge
        return message


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in scope["headers"]}


async def _refuse(send: Send, path: str, status: int, code: str, message: str) -> None:
    status, code = openai_status(path, status, code)
    body = json.dumps(error_body(status, code, message)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in error_headers(status).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
