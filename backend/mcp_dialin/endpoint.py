"""The xiaozhi-style "MCP endpoint": a user's MCP server dials *in* and lends its tools.

A pipe (xiaozhi's sample `mcp_pipe.py`, `xiaozhi-mcp` on PyPI, `xiaozhi-client`) opens a
WebSocket to `ws[s]://<bridge>/v1/mcp-endpoint/?token=<API key>` and relays one JSON-RPC message
per text frame to and from its MCP server; the bridge is the MCP **client** on that socket. The
key may also come as `Authorization: Bearer <key>`.

What the endpoint checks, in order, before it reads a single frame (the socket is accepted and
closed at once with the code and reason below):

- the token is an active API key — else 4401 "invalid or revoked API key" (one answer for a
  missing, malformed, unknown or revoked token, and for the admin token: no oracle);
- the key has the scope `mcp:endpoint` and is bound to devices (`--device`) — else 4403;
- fewer than `max_per_key` dial-ins of this key and `max_connections` in all are open or
  handshaking — else 1013 (try again later).

Then the bridge sends `initialize` and `tools/list` (all pages), within `init_timeout_s` — else
4408 and nothing is registered. The server joins the MCP server hub (backend/mcp_servers/hub.py)
as kind `dialin`, named `dialin-<key id>`, bound to the key's devices: its tools join those
devices' conversations and the chat turns that name them, and `/mcp` for keys with the scope
`mcp:dialin` (or `mcp:dialin-<key id>`), with the hub's call timeout, result cap, audit and
confirmation rules; it shows in `GET /api/mcp/servers` while connected.

One key, one server: a second pipe with the same key that completes its handshake **replaces**
the first, which is closed with 4409. A pipe that reconnects after a network blip therefore
takes over at once instead of waiting for the old half-open socket to time out; two servers
need two keys. On disconnect the server leaves the hub, and calls in flight fail at once
("connection closed") rather than wait for their timeout.
"""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import structlog
from mcp import ClientSession
from mcp import types as mcp_types
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket

from backend import __version__
from backend.config import Settings
from backend.keys import Principal, Scope
from backend.logs import mask_uvicorn_query_tokens
from backend.mcp_dialin.pipe import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_TRY_AGAIN,
    WebSocketPipe,
    websocket_streams,
)
from backend.mcp_servers.hub import (
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TOOL_BOUNDS,
    DIALIN_PREFIX,
    DuplicateServer,
    McpServerHub,
    RiskyRule,
    SessionServer,
    ToolBounds,
    release_memory,
)

log = structlog.get_logger("mcp_dialin")

DIALIN_PATH = "/v1/mcp-endpoint/"
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_INIT_TIMEOUT = 4408
CLOSE_REPLACED = 4409
CLOSE_HANDSHAKE_FAILED = 4400
NAME_PREFIX = DIALIN_PREFIX
REPLACED = "replaced by a newer connection with the same key"

KeyResolver = Callable[[str], Principal | None]


@dataclass(frozen=True, slots=True)
class DialInLimits:
    """Bounds of the endpoint (settings `mcp_endpoint_*`, README)."""

    max_connections: int = 64
    max_per_key: int = 2
    init_timeout_s: float = 10.0
    max_frame_bytes: int = 1 << 20
    call_timeout_s: float = DEFAULT_TIMEOUT_S
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    tool_bounds: ToolBounds = DEFAULT_TOOL_BOUNDS  # what of a tools/list is kept


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a dial-in is refused: the WebSocket close code and reason."""

    code: int
    reason: str


INVALID_KEY = Refusal(CLOSE_UNAUTHORIZED, "invalid or revoked API key")


def server_name(key_id: str) -> str:
    """The hub name of a key's dial-in server (a key id is 12 hex digits, so it is valid)."""
    return f"{NAME_PREFIX}{key_id.lower()}"


class DialInEndpoint:
    """The WebSocket route and every live dial-in; `stop()` closes them (bridge shutdown)."""

    def __init__(
        self,
        hub: McpServerHub,
        resolve_key: KeyResolver,
        limits: DialInLimits | None = None,
    ) -> None:
        self._hub = hub
        self._resolve_key = resolve_key
        self.limits = limits or DialInLimits()
        self._open: dict[str, int] = {}  # key id -> sockets past the checks (handshaking or live)
        self._live: dict[str, tuple[SessionServer, WebSocketPipe]] = {}  # by server name
        self._stopping = False
        mask_uvicorn_query_tokens()  # uvicorn logs each WebSocket's path with its ?token=

    @property
    def routes(self) -> list[BaseRoute]:
        """The dial-in WebSocket routes, with and without the trailing slash."""
        # With and without the slash: the stock tools use whatever URL the user pastes.
        return [
            WebSocketRoute(DIALIN_PATH, self.serve),
            WebSocketRoute(DIALIN_PATH.rstrip("/"), self.serve),
        ]

    @property
    def open_count(self) -> int:
        """How many dial-in connections are open."""
        return sum(self._open.values())

    def live_servers(self) -> list[SessionServer]:
        """The servers of the live dial-ins."""
        return [server for server, _pipe in self._live.values()]

    async def stop(self) -> None:
        """Close every dial-in (1001); their handlers unregister them."""
        self._stopping = True
        # Together: a close waits for the peer's close frame (up to uvicorn's close timeout).
        await asyncio.gather(
            *(
                pipe.close(CLOSE_GOING_AWAY, "bridge shutting down")
                for _s, pipe in self._live.values()
            )
        )

    async def serve(self, websocket: WebSocket) -> None:
        """One dial-in, from the upgrade to the close."""
        principal = self._resolve(websocket)
        await websocket.accept()
        refusal = self._refusal(principal)
        if refusal is not None:
            log.info("mcp dial-in refused", code=refusal.code, reason=refusal.reason)
            await websocket.close(refusal.code, refusal.reason)
            return
        assert principal is not None  # _refusal checked it
        key_id = principal.key_id
        self._open[key_id] = self._open.get(key_id, 0) + 1
        try:
            await self._run(WebSocketPipe(websocket, self.limits.max_frame_bytes), principal)
        finally:
            self._open[key_id] -= 1
            if not self._open[key_id]:
                del self._open[key_id]

    def _resolve(self, websocket: WebSocket) -> Principal | None:
        token = websocket.query_params.get("token") or websocket.headers.get("authorization")
        if not token:
            return None
        return self._resolve_key(token)

    def _refusal(self, principal: Principal | None) -> Refusal | None:
        if principal is None:
            return INVALID_KEY
        if Scope.MCP_ENDPOINT not in principal.scopes:
            return Refusal(CLOSE_FORBIDDEN, f"this key lacks the scope {Scope.MCP_ENDPOINT}")
        if not principal.device_ids:
            return Refusal(CLOSE_FORBIDDEN, "this key is not bound to any device")
        if self._stopping:
            return Refusal(CLOSE_GOING_AWAY, "bridge shutting down")
        if self._open.get(principal.key_id, 0) >= self.limits.max_per_key:
            return Refusal(CLOSE_TRY_AGAIN, "too many dial-in connections with this key")
        if self.open_count >= self.limits.max_connections:
            return Refusal(CLOSE_TRY_AGAIN, "too many dial-in connections")
        return None

    async def _run(self, pipe: WebSocketPipe, principal: Principal) -> None:
        name = server_name(principal.key_id)
        bound = structlog.contextvars.bound_contextvars(server=name, key_id=principal.key_id)
        server = SessionServer(
            name,
            kind="dialin",
            bound_device_ids=principal.device_ids,
            risky=RiskyRule.from_setting(None),
            timeout_s=self.limits.call_timeout_s,
            max_result_bytes=self.limits.max_result_bytes,
            tool_bounds=self.limits.tool_bounds,
        )
        with bound:
            try:
                async with websocket_streams(pipe) as (read, write):
                    session = ClientSession(
                        read,
                        write,
                        message_handler=server.message_handler,
                        client_info=mcp_types.Implementation(
                            name="esp32-mcp-bridge", version=__version__
                        ),
                    )
                    async with session:
                        if await self._handshake(pipe, session, server):
                            await self._serve_until_closed(pipe, server)
            finally:
                await pipe.close(CLOSE_NORMAL, "closing")
                info = pipe.close_info
                log.info(
                    "mcp dial-in closed",
                    code=info.code if info else None,
                    reason=info.reason if info else None,
                    by_peer=info.by_peer if info else None,
                )
        # The session, its pages and the server are unreferenced now: give their memory back.
        release_memory()

    async def _handshake(
        self, pipe: WebSocketPipe, session: ClientSession, server: SessionServer
    ) -> bool:
        """`initialize` and `tools/list` within the timeout; False (socket closed) otherwise."""
        limit = self.limits.init_timeout_s
        try:
            with anyio.fail_after(limit):
                await session.initialize()
                await server.attach(session)
        except TimeoutError:
            await pipe.close(CLOSE_INIT_TIMEOUT, f"no answer to initialize in {limit:g} s")
            return False
        except Exception as exc:  # an error reply, a broken frame, the peer gone
            await pipe.close(CLOSE_HANDSHAKE_FAILED, f"handshake failed: {_describe(exc)}")
            return False
        return True

    async def _serve_until_closed(self, pipe: WebSocketPipe, server: SessionServer) -> None:
        if not await self._register(server, pipe):
            return
        devices = len(server.bound_device_ids or ())
        log.info("mcp dial-in ready", tools=len(server.tools), devices=devices)
        try:
            await pipe.closed.wait()
        finally:
            live = self._live.get(server.name)
            if live is not None and live[0] is server:
                del self._live[server.name]
            self._hub.remove(server.name, server)
            server.detach("disconnected")

    async def _register(self, server: SessionServer, pipe: WebSocketPipe) -> bool:
        """Put `server` in the hub, replacing this key's older dial-in (closed with 4409).

        No await until the hub and `_live` agree again: two handshakes of one key finishing
        together must not both take (or both lose) the name."""
        older = self._live.pop(server.name, None)
        if older is not None:
            self._hub.remove(server.name, older[0])
            older[0].detach(REPLACED)
        try:
            self._hub.add(server)
        except DuplicateServer:  # a configured server has this name
            await pipe.close(CLOSE_REPLACED, f"the server name {server.name} is taken")
            return False
        self._live[server.name] = (server, pipe)
        if older is not None:
            await older[1].close(CLOSE_REPLACED, REPLACED)
        return True


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}"[:100] if text else type(exc).__name__


def dialin_limits(settings: Settings) -> DialInLimits:
    """The endpoint's bounds from the bridge settings (`mcp_endpoint_*`)."""
    return DialInLimits(
        max_connections=settings.mcp_endpoint_max_connections,
        max_per_key=settings.mcp_endpoint_max_per_key,
        init_timeout_s=settings.mcp_endpoint_init_timeout_s,
        max_frame_bytes=settings.mcp_endpoint_max_frame_bytes,
    )
