"""WebSocket device endpoint on the `websockets` asyncio server (protocol reference §1).

The handshake is checked before the upgrade: a wrong path answers 404, and the identity fields
(`Authorization`, `Device-Id`, `Client-Id`, `Protocol-Version` headers, or the `authorization`,
`device-id`, `client-id`, `protocol-version` query parameters that some clients use instead) go
to `Admission`, whose refusals answer 401 or 400. After the upgrade every text frame goes to the
link's handler as it is, and every binary frame is decoded from the device's framing version into
an `AudioFrame`; one that does not decode is dropped (logged within a budget) and still charged
to the device through the handler's `on_discarded`; frames larger than `max_message_bytes` close
the link with 1009 (done by `websockets`).
"""

import asyncio
import socket
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.http11 import Request, Response

from backend.common import reachable_host, url_host
from backend.config import Settings
from backend.errors import MessageTooLarge, listen_errors
from backend.logs import LogBudget
from backend.metrics import record_cut_off, record_handshake_refused
from backend.protocol.audio import AudioFrame, AudioFrameError, decode_audio, encode_audio
from backend.transports.admission import Admission, HandshakeRequest
from backend.transports.base import DeviceIdentity, LinkAcceptor
from backend.transports.errors import HandshakeRefused, LinkClosed
from backend.transports.throttle import (
    ConnectionGuard,
)

log = structlog.get_logger("transport.websocket")

_IDENTITY_KEY = "device_identity"
GOING_AWAY = 1001
ACCEPT_BATCH = 64
CLOSE_TIMEOUT_S = 2.0
SHUTDOWN = "bridge shutting down"


class WebSocketLink:
    """A device connection as the session sees it. Stock devices open it for a conversation."""

    __slots__ = ("_high_water", "_limits", "connection", "identity")
    conversation_scoped = True

    def __init__(
        self, connection: ServerConnection, identity: DeviceIdentity, limits: "LinkLimits"
    ) -> None:
        self.connection = connection
        self.identity = identity
        self._limits = limits
        self._high_water = connection.transport.get_write_buffer_limits()[1]

    async def send_text(self, text: str) -> None:
        """Send a JSON message; raises MessageTooLarge past the link's limit."""
        limit = self._limits.max_message_bytes
        if len(text) * 4 > limit:  # only long texts need their UTF-8 size worked out
            size = len(text.encode())
            if size > limit:
                raise MessageTooLarge(size, limit)
        await self._send(text)

    async def send_audio(self, frame: AudioFrame) -> None:
        """Send one frame in the device's binary protocol version; raises MessageTooLarge."""
        data = encode_audio(self.identity.protocol_version, frame.payload, frame.timestamp_ms)
        if len(data) > self._limits.max_message_bytes:
            raise MessageTooLarge(len(data), self._limits.max_message_bytes)
        await self._send(data)

    async def _send(self, data: str | bytes) -> None:
        try:
            if self._cannot_wait(data):
                await self.connection.send(data)
            else:
                async with asyncio.timeout(self._limits.write_timeout_s):
                    await self.connection.send(data)
        except ConnectionClosed as exc:
            raise LinkClosed(f"link closed ({exc.rcvd.code if exc.rcvd else 1006})") from None
        except TimeoutError:
            # The device stopped reading: its buffers are full and nothing more will fit.
            self.connection.transport.abort()
            raise LinkClosed("write timed out: the device is not reading") from None

    def _cannot_wait(self, data: str | bytes) -> bool:
        """True when this write cannot wait for the device: nothing is buffered and the frame
        fits under the high-water mark, so the transport takes it whole without pausing (and
        a closing connection has its own close timeout). Skipping the write timeout here saves
        a timer per message on the path every tool call takes."""
        size = len(data) * 4 + 14 if isinstance(data, str) else len(data) + 14  # + frame header
        transport = self.connection.transport
        return size <= self._high_water and not transport.get_write_buffer_size()

    def hello_fields(self, session_id: str) -> dict[str, str]:
        """The hello reply's transport fields (stock firmware needs `transport` exactly)."""
        # Must be present and exactly "websocket": a missing transport crashes stock firmware.
        return {"transport": "websocket"}

    def conversation_ended(self, session_id: str) -> None:
        """Nothing to release: the link is the conversation."""
        pass  # nothing is held per conversation: the link is the conversation

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the WebSocket with this code and reason."""
        await self.connection.close(code, reason)


@dataclass(frozen=True, slots=True)
class LinkLimits:
    """Per-link limits: the largest message in bytes and the write timeout in seconds."""

    max_message_bytes: int
    write_timeout_s: float


class HandshakeGuard(ConnectionGuard):
    """`ConnectionGuard` applied in `websockets`' `connection_made`, before a byte is parsed."""

    def connection_class(self) -> type[ServerConnection]:
        """A `ServerConnection` subclass that asks the guard at `connection_made`."""
        guard = self

        class GuardedConnection(ServerConnection):
            _refused = False

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                peer = transport.get_extra_info("peername")
                address = str(peer[0]) if isinstance(peer, tuple) and peer else None
                if not guard.admit(self, address):
                    self._refused = True
                    if isinstance(transport, asyncio.Transport):
                        transport.abort()
                    return
                super().connection_made(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                if self._refused:
                    return
                guard.done(self)
                super().connection_lost(exc)

        return GuardedConnection


class WebSocketTransport:
    """Accepts device connections and hands each admitted one to the acceptor."""

    name = "websocket"

    def __init__(self, settings: Settings, admission: Admission) -> None:
        self._settings = settings
        self._admission = admission
        self._acceptor: LinkAcceptor | None = None
        self._server: Server | None = None
        self._links: set[WebSocketLink] = set()
        self._limits = LinkLimits(settings.max_message_bytes, settings.write_timeout_s)
        # Refusals are logged a few at a time, then counted: a refused client may retry fast.
        self._refusals = LogBudget(log, burst=5)
        self.handshakes = HandshakeGuard.for_listener(settings, log, transport=self.name)

    @property
    def port(self) -> int:
        """The bound port (the real one when configured as 0)."""
        assert self._server is not None, "transport not started"
        port: int = next(iter(self._server.sockets)).getsockname()[1]
        return port

    @property
    def url(self) -> str:
        """The URL devices connect to (a wildcard bind is given as loopback)."""
        host = url_host(reachable_host(self._settings.ws_host))
        return f"ws://{host}:{self.port}{self._settings.ws_path}"

    def endpoints(self) -> dict[str, str]:
        """The device WebSocket URL."""
        return {"websocket": self.url}

    async def start(self, acceptor: LinkAcceptor) -> None:
        """Bind the listener and serve devices; raises a clear error when the port is taken."""
        settings = self._settings
        self._acceptor = acceptor
        # Our own listening socket, so its kernel queue can be deep (see below).
        with listen_errors("device WebSockets", settings.ws_host, settings.ws_port, "ws"):
            listener = socket.create_server(
                (settings.ws_host, settings.ws_port),
                family=socket.AF_INET6 if ":" in settings.ws_host else socket.AF_INET,
                backlog=settings.ws_backlog,
            )
        self._server = await serve(
            self._handle,
            sock=listener,
            process_request=self._check_handshake,
            compression=None,  # stock firmware offers no permessage-deflate
            max_size=settings.max_message_bytes,
            max_queue=settings.max_queue,
            ping_interval=settings.ping_interval_s,
            ping_timeout=settings.ping_interval_s,
            # A device cut off for flooding keeps sending until its TCP link is gone: do not
            # wait long for its half of the closing handshake.
            close_timeout=CLOSE_TIMEOUT_S,
            server_header=None,
            # asyncio accepts up to `backlog` connections per wakeup: a small batch keeps a
            # connection storm from holding the loop (and every device's calls) in one go.
            backlog=ACCEPT_BATCH,
            create_connection=self.handshakes.connection_class(),
        )
        # ...while the kernel queue stays deep: a fleet reconnecting at once would overflow a
        # short one, and every dropped SYN costs its device a retransmission second.
        listener.listen(settings.ws_backlog)

    async def stop(self) -> None:
        """Close every device link with 1001 (going away), then stop listening."""
        if self._server is None:
            return
        self._server.close(close_connections=False)
        await asyncio.gather(
            *(link.close(GOING_AWAY, SHUTDOWN) for link in list(self._links)),
            return_exceptions=True,
        )
        await self._server.wait_closed()

    # ---- handshake ---------------------------------------------------------------------------

    def _check_handshake(self, connection: ServerConnection, request: Request) -> Response | None:
        url = urlsplit(request.path)
        remote = _remote(connection)
        if url.path.rstrip("/") != self._settings.ws_path.rstrip("/"):
            record_handshake_refused(self.name, "not_found")
            return _refuse(
                connection, HandshakeRefused(404, "no device endpoint here"), remote, self._refusals
            )
        query = {key: values[0] for key, values in parse_qs(url.query).items()}
        headers = request.headers
        try:
            identity = self._admission.admit(
                HandshakeRequest(
                    transport=self.name,
                    credential=_field(headers, query, "Authorization", "authorization"),
                    device_id=_field(headers, query, "Device-Id", "device-id"),
                    client_id=_field(headers, query, "Client-Id", "client-id"),
                    protocol_version=_field(headers, query, "Protocol-Version", "protocol-version"),
                    remote=remote,
                )
            )
        except HandshakeRefused as refused:
            if refused.status in (401, 429):
                self.handshakes.handshake_refused(_address(connection))
            return _refuse(connection, refused, remote, self._refusals)
        setattr(connection, _IDENTITY_KEY, identity)
        return None

    # ---- connection ----------------------------------------------------------------------------

    async def _handle(self, connection: ServerConnection) -> None:
        assert self._acceptor is not None
        self.handshakes.done(connection)
        link = WebSocketLink(connection, getattr(connection, _IDENTITY_KEY), self._limits)
        # websockets keeps the handshake's response only for inspection (the request it needs:
        # `request is None` means "still in the handshake"); nothing reads it again.
        connection.response = None
        self._links.add(link)
        try:
            handler = self._acceptor.open_link(link)
        except Exception:
            self._links.discard(link)
            raise
        # One coroutine frame per device for the whole link: no helper coroutine held open.
        version = link.identity.protocol_version
        drops: LogBudget | None = None
        try:
            while True:
                message: str | bytes | None = await connection.recv()
                if isinstance(message, str):
                    await handler.on_text(message)
                else:
                    assert message is not None
                    try:
                        handler.on_audio(decode_audio(version, message))
                    except AudioFrameError as exc:
                        # Undecodable, it still costs the device a frame of its inbound limit:
                        # junk must not flood past the bound that valid audio is held to.
                        handler.on_discarded(len(message))
                        if drops is None:
                            drops = LogBudget(log.bind(device_id=link.identity.device_id))
                        drops.warning("dropped audio frame", reason=str(exc), size=len(message))
                message = None  # an idle device must not keep its last message alive
        except (ConnectionClosed, LinkClosed):
            pass  # the device went away, or the link was closed while answering it
        finally:
            if drops is not None:
                drops.close()
            self._links.discard(link)
            if _we_closed_for_policy(connection):
                self._admission.cut_off(link.identity.device_id)
                if _close_code(connection) == CloseCode.MESSAGE_TOO_BIG:  # websockets closed it
                    record_cut_off(self.name, "message_too_big")
            handler.on_closed(_close_reason(connection))


def _refuse(
    connection: ServerConnection, refused: HandshakeRefused, remote: str | None, budget: LogBudget
) -> Response:
    budget.warning(f"handshake refused ({refused.status})", reason=refused.reason, remote=remote)
    return connection.respond(HTTPStatus(refused.status), f"{refused.reason}\n")


def _field(headers: Headers, query: dict[str, str], header: str, param: str) -> str | None:
    value = headers.get(header) or query.get(param)
    return value.strip() if value else None


def _address(connection: ServerConnection) -> str | None:
    address = connection.remote_address
    return str(address[0]) if address else None


def _remote(connection: ServerConnection) -> str | None:
    address = connection.remote_address
    return f"{address[0]}:{address[1]}" if address else None


_BROKE_A_BOUND = (CloseCode.POLICY_VIOLATION, CloseCode.MESSAGE_TOO_BIG)


def _we_closed_for_policy(connection: ServerConnection) -> bool:
    """The bridge, not the device, closed this link with 1008 or 1009 (it broke a bound)."""
    sent = connection.protocol.close_sent
    return (
        sent is not None
        and sent.code in _BROKE_A_BOUND
        and not connection.protocol.close_rcvd_then_sent
    )


def _close_code(connection: ServerConnection) -> int | None:
    sent = connection.protocol.close_sent
    return sent.code if sent is not None else None


def _close_reason(connection: ServerConnection) -> str:
    close = connection.protocol.close_rcvd or connection.protocol.close_sent
    if close is None:
        return "connection lost (1006)"
    text = f"closed ({close.code})"
    return f"{text}: {close.reason}" if close.reason else text
