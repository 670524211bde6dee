"""WebSocket device endpoint on the `websockets` asyncio server (protocol reference §1).

The handshake is checked before the upgrade: wrong path → 404, missing or wrong device token →
401, missing or malformed Device-Id → 400. Stock firmware sends its identity in headers; other
clients put it in the query string (`device-id`, `client-id`, `authorization`), accepted as a
fallback. After the upgrade every frame goes to the device session; frames larger than
`max_message_bytes` close the link with 1009 (done by `websockets`).
"""

import asyncio
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from backend.auth import token_matches
from backend.config import Settings
from backend.transports.base import DeviceIdentity, LinkClosed

log = structlog.get_logger("transport.websocket")

_DEVICE_ID = re.compile(r"^[A-Za-z0-9:_.\-]{1,64}$")
_IDENTITY_KEY = "device_identity"
SHUTDOWN = "bridge shutting down"


class HandshakeRejected(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class WebSocketLink:
    """A device connection as the session sees it: send, close, identity."""

    transport = "websocket"
    __slots__ = ("connection", "identity")

    def __init__(self, connection: ServerConnection, identity: DeviceIdentity) -> None:
        self.connection = connection
        self.identity = identity

    async def send_text(self, text: str) -> None:
        try:
            await self.connection.send(text)
        except ConnectionClosed as exc:
            raise LinkClosed(f"link closed ({exc.rcvd.code if exc.rcvd else 1006})") from None

    async def send_binary(self, data: bytes) -> None:
        try:
            await self.connection.send(data)
        except ConnectionClosed as exc:
            raise LinkClosed(f"link closed ({exc.rcvd.code if exc.rcvd else 1006})") from None

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self.connection.close(code, reason)


SessionFactory = Callable[[WebSocketLink], Any]


class WebSocketTransport:
    """Accepts device connections and hands each one to a new session."""

    def __init__(self, settings: Settings, device_token: str, new_session: SessionFactory) -> None:
        self._settings = settings
        self._device_token = device_token
        self._new_session = new_session
        self._server: Server | None = None
        self._links: set[WebSocketLink] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "transport not started"
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        settings = self._settings
        self._server = await serve(
            self._handle,
            settings.ws_host,
            settings.ws_port,
            process_request=self._check_handshake,
            compression=None,  # stock firmware offers no permessage-deflate
            max_size=settings.max_message_bytes,
            max_queue=settings.max_queue,
            ping_interval=settings.ping_interval_s,
            ping_timeout=settings.ping_interval_s,
            server_header=None,
        )

    async def stop(self) -> None:
        """Close every device link with 1001 (going away), then stop listening."""
        if self._server is None:
            return
        self._server.close(close_connections=False)
        await asyncio.gather(
            *(link.close(1001, SHUTDOWN) for link in list(self._links)), return_exceptions=True
        )
        await self._server.wait_closed()

    # ---- handshake ---------------------------------------------------------------------------

    def _check_handshake(self, connection: ServerConnection, request: Request) -> Response | None:
        try:
            identity = self._identify(request, connection)
        except HandshakeRejected as exc:
            log.warning(
                "handshake rejected",
                status=exc.status.value,
                reason=str(exc),
                remote=_remote(connection),
            )
            return connection.respond(exc.status, f"{exc}\n")
        setattr(connection, _IDENTITY_KEY, identity)
        return None

    def _identify(self, request: Request, connection: ServerConnection) -> DeviceIdentity:
        url = urlsplit(request.path)
        if url.path.rstrip("/") != self._settings.ws_path.rstrip("/"):
            raise HandshakeRejected(HTTPStatus.NOT_FOUND, f"no endpoint at {url.path}")
        query = {key: values[0] for key, values in parse_qs(url.query).items()}
        headers = request.headers
        if self._settings.device_auth:
            presented = _field(headers, query, "Authorization", "authorization")
            if not token_matches(presented, self._device_token):
                reason = "missing device token" if not presented else "invalid device token"
                raise HandshakeRejected(HTTPStatus.UNAUTHORIZED, reason)
        device_id = _field(headers, query, "Device-Id", "device-id")
        if not device_id:
            raise HandshakeRejected(HTTPStatus.BAD_REQUEST, "missing Device-Id header")
        if not _DEVICE_ID.match(device_id):
            raise HandshakeRejected(HTTPStatus.BAD_REQUEST, "malformed Device-Id")
        return DeviceIdentity(
            device_id=device_id.lower() if ":" in device_id else device_id,
            client_id=_field(headers, query, "Client-Id", "client-id"),
            protocol_version=_protocol_version(headers, query),
            transport="websocket",
            remote=_remote(connection),
        )

    # ---- connection ----------------------------------------------------------------------------

    async def _handle(self, connection: ServerConnection) -> None:
        link = WebSocketLink(connection, getattr(connection, _IDENTITY_KEY))
        self._links.add(link)
        session = self._new_session(link)
        reason = "closed"
        try:
            async for message in connection:
                if isinstance(message, str):
                    await session.on_text(message)
                else:
                    session.on_binary(message)
            reason = _close_reason(connection)
        except ConnectionClosed:
            reason = _close_reason(connection)
        finally:
            self._links.discard(link)
            session.on_closed(reason)


def _field(headers: Headers, query: dict[str, str], header: str, param: str) -> str | None:
    value = headers.get(header) or query.get(param)
    return value.strip() if value else None


def _protocol_version(headers: Headers, query: dict[str, str]) -> int:
    raw = _field(headers, query, "Protocol-Version", "protocol-version") or "1"
    if raw not in ("1", "2", "3"):
        raise HandshakeRejected(HTTPStatus.BAD_REQUEST, f"unsupported Protocol-Version {raw!r}")
    return int(raw)


def _remote(connection: ServerConnection) -> str | None:
    address = connection.remote_address
    return f"{address[0]}:{address[1]}" if address else None


def _close_reason(connection: ServerConnection) -> str:
    close = connection.protocol.close_rcvd or connection.protocol.close_sent
    if close is None:
        return "connection lost (1006)"
    text = f"closed ({close.code})"
    return f"{text}: {close.reason}" if close.reason else text
