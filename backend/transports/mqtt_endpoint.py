"""The bridge's own device-facing MQTT 3.1.1 endpoint (`mqtt_url = "embedded"`, docs/mqtt.md).

Devices only ever talk to the bridge, never to each other, so the embedded default is not a
broker that routes between clients: every TCP connection is one device's `DeviceLink`, behind the
same seam and admission as WebSocket. What a general broker would have to police cannot happen
here by construction:

- a device's identity is its login (username = its key, checked by the `CredentialProvider`,
  client id its key or a stock id naming it), never a topic; it may publish only to its own
  `up` and `status` topics, anything else is dropped and charged to it;
- nothing is routed: a last will is accepted only on the device's own status topic and is never
  published (the link itself is the presence), retained messages are never stored, subscriptions
  are answered (its own downlink granted at QoS 1, anything else refused) but nothing is ever
  delivered except the bridge's downlink;
- sessions are always clean: nothing is kept for a client after its connection ends;
- one connection per device: a new login replaces the old link, as on WebSocket;
- bounds as on WebSocket: the `ConnectionGuard` (per-address rate, per-address and global caps
  on connections still in their handshake, the penalty box), a CONNECT deadline, a packet size
  bound checked from the fixed header, per-device handshake and inbound limits (every packet
  that is not a delivered message costs the device like a discarded frame), at most
  `max_qos2_pending` QoS 2 messages awaiting PUBREL and `max_unacked` unacknowledged downlink
  messages, a write timeout for a device that stops reading, keepalive enforced, and every log
  line within a budget.

Downlink messages go out at QoS 1; audio rides on UDP (`mqtt_audio.LinkAudio`).
"""

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

import structlog

from backend.common import reachable_host, url_host
from backend.errors import MessageTooLarge, listen_errors
from backend.logs import LogBudget
from backend.metrics import record_cut_off
from backend.protocol import mqtt_packets as mp
from backend.protocol.audio import AudioFrame
from backend.transports.admission import Admission, HandshakeRequest
from backend.transports.base import DeviceIdentity, LinkAcceptor, LinkHandler
from backend.transports.errors import HandshakeRefused, LinkClosed, TopicError
from backend.transports.mqtt_audio import LinkAudio
from backend.transports.mqtt_credentials import CredentialProvider
from backend.transports.mqtt_topics import (
    TopicKind,
    TopicScheme,
    claims_another_device,
    device_id_from_key,
    device_key,
    is_stock_client_id,
    parse_client_id,
    parse_presence,
    validate_device_key,
)
from backend.transports.throttle import ConnectionGuard
from backend.transports.udp import UdpAudioChannel

log = structlog.get_logger("transport.mqtt_endpoint")

TRANSPORT = "mqtt"
# The endpoint's own cut-offs, as bridge_device_cutoffs_total names them.
_CUT_OFF_REASONS = {"packet_too_large": "message_too_big", "malformed": "malformed"}
POLICY_VIOLATION = 1008
GOING_AWAY = 1001
REPLACED = "replaced by a new connection"
SHUTDOWN = "bridge shutting down"
_READ_CHUNK = 65_536
_REFUSAL_CODES = {400: mp.IDENTIFIER_REJECTED, 401: mp.BAD_USERNAME_PASSWORD, 429: 3}


@dataclass(frozen=True, slots=True)
class EndpointSettings:
    """Where the bridge's own MQTT endpoint listens and the limits it applies per client."""

    host: str = "0.0.0.0"
    port: int = 1883
    topic_prefix: str = "xiaozhi"
    max_message_bytes: int = 65_536  # the largest JSON message either way, as on WebSocket
    connect_timeout_s: float = 10.0
    max_connect_bytes: int = 4096  # a CONNECT carries ids, a token and at most a small will
    write_timeout_s: float = 10.0
    keepalive_grace: float = 1.5  # MQTT 3.1.1 §3.1.2.10
    idle_timeout_s: float = 360.0  # for a client that asks for no keepalive (0)
    keepalive_check_s: float = 1.0
    max_qos2_pending: int = 16
    max_unacked: int = 256  # downlink QoS 1 messages without a PUBACK; past it: not reading
    backlog: int = 1024
    udp_public_host: str = "127.0.0.1"

    @property
    def max_packet_bytes(self) -> int:
        """A message plus its topic and header fields."""
        return self.max_message_bytes + 1024


class DeviceLogin:
    """`DeviceCredentials` for Admission: the CONNECT's password checked against the device's
    broker login (the key of its Device-Id is the username)."""

    def __init__(self, provider: CredentialProvider) -> None:
        self._provider = provider

    def refusal(self, device_id: str, presented: str | None) -> str | None:
        """Check the CONNECT password against the device's credential; the reason when refused."""
        if not presented:
            return "missing password"
        try:
            key = device_key(device_id)
        except TopicError:
            return "device id has no MQTT key"
        return None if self._provider.verify(key, presented) else "bad device credentials"


class _Refused(Exception):
    def __init__(self, code: int, reason: str, status: int = 0) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.status = status


class _Close(Exception):
    """Close this connection now (a bound broken, a protocol error, DISCONNECT)."""

    def __init__(self, reason: str, code: int = 1000) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class EndpointLink:
    """One device's MQTT connection as the session sees it."""

    conversation_scoped = False

    def __init__(
        self,
        endpoint: "MqttEndpoint",
        writer: asyncio.StreamWriter,
        identity: DeviceIdentity,
        key: str,
    ) -> None:
        self._endpoint = endpoint
        self._writer = writer
        self._identity = identity
        self.key = key
        self.down_topic = endpoint.scheme.down(key)
        self.audio = LinkAudio(
            endpoint.udp, endpoint.settings.udp_public_host, identity.device_id, self._on_audio
        )
        self.handler: LinkHandler | None = None
        self.closed = False
        self.close_reason = "connection lost"
        self.close_code = 1006
        self.unacked: set[int] = set()
        self.qos2_pending: set[int] = set()
        self.last_packet = time.monotonic()
        self.keepalive_s = 0.0
        self._next_id = 0
        self.task: asyncio.Task[None] | None = None

    @property
    def identity(self) -> DeviceIdentity:
        """Who the device is, as established at its CONNECT (client id, login)."""
        return self._identity

    async def send_text(self, text: str) -> None:
        """Publish a JSON message on the down topic; raises LinkClosed or MessageTooLarge."""
        if self.closed:
            raise LinkClosed("link closed")
        data = text.encode()
        limit = self._endpoint.settings.max_message_bytes
        if len(data) > limit:
            raise MessageTooLarge(len(data), limit)
        if len(self.unacked) >= self._endpoint.settings.max_unacked:
            self.abort("downlink not acknowledged: the device is not reading", POLICY_VIOLATION)
            raise LinkClosed("the device does not acknowledge its downlink")
        packet_id = self._packet_id()
        self.unacked.add(packet_id)
        await self.write(mp.publish(self.down_topic, data, qos=1, packet_id=packet_id))

    def _packet_id(self) -> int:
        for _ in range(65_535):
            self._next_id = self._next_id % 65_535 + 1
            if self._next_id not in self.unacked:
                return self._next_id
        raise LinkClosed("no free packet id")  # unreachable while max_unacked < 65535

    async def write(self, data: bytes) -> None:
        """Write packet bytes, draining at most the write timeout; raises LinkClosed."""
        writer = self._writer
        if self.closed or writer.transport.is_closing():
            raise LinkClosed("link closed")
        writer.write(data)
        transport = writer.transport
        if transport.get_write_buffer_size() <= transport.get_write_buffer_limits()[1]:
            return  # taken whole: no timer on the hot path
        try:
            async with asyncio.timeout(self._endpoint.settings.write_timeout_s):
                await writer.drain()
        except TimeoutError:
            self.abort("write timed out: the device is not reading", POLICY_VIOLATION)
            raise LinkClosed("write timed out: the device is not reading") from None
        except ConnectionError as exc:
            raise LinkClosed(f"connection lost: {exc}") from None

    async def send_audio(self, frame: AudioFrame) -> None:
        """Send one frame over the conversation's UDP session; counted and dropped without one."""
        if self.closed:
            raise LinkClosed("link closed")
        if not self.audio.send(frame):
            self._endpoint.count("udp_no_session")

    def hello_fields(self, session_id: str) -> dict[str, object]:
        """Open the conversation's UDP session; the hello carries its server, port, key, nonce."""
        if self.closed:
            raise LinkClosed("link closed")
        return self.audio.open(session_id)

    def conversation_ended(self, session_id: str) -> None:
        """Release the UDP session of that conversation."""
        self.audio.ended(session_id)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Drop the client's connection (MQTT has no close frame: code and reason are kept)."""
        self.abort(reason or f"closed by the bridge ({code})", code)

    def abort(self, reason: str, code: int = 1000) -> None:
        """Drop the TCP connection; the connection's task reports `on_closed` once."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self.close_code = code
        self.audio.release()
        self._writer.transport.abort()

    def _on_audio(self, frame: AudioFrame) -> None:
        handler = self.handler
        if handler is not None and not self.closed:
            handler.on_audio(frame)


class MqttEndpoint:
    """Accepts device MQTT connections; each admitted one is a link handed to the acceptor."""

    name = TRANSPORT

    def __init__(
        self,
        settings: EndpointSettings,
        admission: Admission,
        guard: ConnectionGuard,
        *,
        udp: UdpAudioChannel,
    ) -> None:
        self.settings = settings
        self.admission = admission
        self.guard = guard
        self.udp = udp
        self.scheme = TopicScheme(settings.topic_prefix)
        self.counters: dict[str, int] = {}
        self._acceptor: LinkAcceptor | None = None
        self._server: asyncio.Server | None = None
        self._links: dict[str, EndpointLink] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._budget = LogBudget(log, burst=5, interval_s=60.0)

    # ---- Transport ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound TCP port (the real one when configured as 0)."""
        assert self._server is not None, "endpoint not started"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def endpoints(self) -> dict[str, str]:
        """The MQTT and UDP URLs devices can reach (a wildcard bind is given as loopback)."""
        host = url_host(reachable_host(self.settings.host))
        return {"mqtt": f"mqtt://{host}:{self.port}", "udp": f"udp://{host}:{self.udp.port}"}

    @property
    def links(self) -> dict[str, EndpointLink]:
        """A snapshot of the connected links by device key."""
        return dict(self._links)

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a named counter of the endpoint's stats."""
        self.counters[name] = self.counters.get(name, 0) + amount

    def stats(self) -> dict[str, int]:
        """The endpoint's counters, its link count and its UDP channel's counters."""
        udp = {f"udp_{name}": value for name, value in self.udp.stats().items()}
        return {**self.counters, "links": len(self._links), **udp}

    async def start(self, acceptor: LinkAcceptor) -> None:
        """Bind the UDP channel and the TCP listener; raises a clear error when a port is taken."""
        self._acceptor = acceptor
        settings = self.settings
        if not self.udp.running:
            await self.udp.start()
        with listen_errors("devices over MQTT", settings.host, settings.port, "mqtt"):
            listener = socket.create_server(
                (settings.host, settings.port),
                family=socket.AF_INET6 if ":" in settings.host else socket.AF_INET,
                backlog=settings.backlog,
            )
        # At most 64 accepts per loop wakeup (a connection storm cannot hold the loop), over a
        # deep kernel queue (a fleet reconnecting at once); as on the WebSocket listener.
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, sock=listener, backlog=64
        )
        listener.listen(settings.backlog)
        self._watchdog = asyncio.create_task(self._keepalive_watchdog(), name="mqtt-keepalive")
        log.info("mqtt endpoint listening", host=settings.host, port=self.port)

    async def stop(self) -> None:
        """Stop listening, end every link, then close the UDP channel."""
        if self._server is not None:
            self._server.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for link in list(self._links.values()):
            link.abort(SHUTDOWN, GOING_AWAY)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._watchdog is not None:
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        await self.udp.stop()

    # ---- one connection -------------------------------------------------------------------------

    def _protocol(self) -> asyncio.BaseProtocol:
        return _GuardedStream(self, asyncio.StreamReader(limit=_READ_CHUNK), self._accept)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """The guard's decision at accept time, before a task or a byte of the connection."""
        if self.guard.admit(transport, _address(transport.get_extra_info("peername"))):
            return True
        self.count("connections_dropped")
        return False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer = writer.get_extra_info("peername")
        address = _address(peer)
        remote = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else None
        token: Hashable = writer.transport  # what `admit` was given
        _nodelay(writer)
        link: EndpointLink | None = None
        try:
            packets = mp.PacketReader(self.settings.max_connect_bytes)
            try:
                connect = await self._read_connect(reader, packets)
                link = await self._login(connect, writer, address, remote)
            finally:
                self.guard.done(token)
            if link is not None:
                packets.max_packet_bytes = self.settings.max_packet_bytes
                await self._serve(link, reader, packets)
        except _Refused:
            pass
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            self._tasks.discard(task)
            if link is None:
                writer.transport.abort()

    async def _read_connect(
        self, reader: asyncio.StreamReader, packets: mp.PacketReader
    ) -> mp.Connect:
        """The first packet, a CONNECT, within the deadline and size bound; _Refused otherwise
        (no CONNACK: a client that never sent a valid CONNECT is just dropped)."""
        try:
            async with asyncio.timeout(self.settings.connect_timeout_s):
                while True:
                    data = await reader.read(_READ_CHUNK)
                    if not data:
                        raise _Refused(0, "closed before CONNECT")
                    packets.feed(data)
                    for packet in packets.packets():
                        if isinstance(packet, mp.Connect):
                            return packet
                        raise _Refused(0, "first packet is not CONNECT")
        except TimeoutError:
            self.count("connect_timeouts")
            raise _Refused(0, "no CONNECT in time") from None
        except mp.MalformedPacket as exc:
            self.count("connects_malformed")
            self._budget.warning("mqtt connect malformed", key="malformed", reason=str(exc))
            raise _Refused(0, str(exc)) from None

    async def _login(
        self,
        connect: mp.Connect,
        writer: asyncio.StreamWriter,
        address: str | None,
        remote: str | None,
    ) -> EndpointLink | None:
        try:
            key, identity = self._decide(connect, remote)
        except _Refused as refused:
            self.count("logins_refused")
            if refused.status in (401, 429):
                self.guard.handshake_refused(address)
            self._budget.warning(
                "mqtt login refused", key=refused.reason, reason=refused.reason, remote=remote
            )
            writer.write(mp.connack(refused.code))
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await writer.drain()
            raise
        old = self._links.get(key)
        if old is not None:
            old.abort(REPLACED)
            self.count("links_replaced")
        link = EndpointLink(self, writer, identity, key)
        link.keepalive_s = connect.keepalive_s * self.settings.keepalive_grace
        self._links[key] = link
        writer.write(mp.connack(mp.ACCEPTED))
        assert self._acceptor is not None
        try:
            link.handler = self._acceptor.open_link(link)
        except Exception:
            del self._links[key]
            link.abort("could not open the link")
            raise
        self.count("links_opened")
        return link

    def _decide(self, connect: mp.Connect, remote: str | None) -> tuple[str, DeviceIdentity]:
        """The device key and identity of a CONNECT, or _Refused with its CONNACK code."""
        if connect.protocol_level != 4:
            raise _Refused(mp.UNACCEPTABLE_PROTOCOL, "not MQTT 3.1.1")
        key = connect.username or ""
        try:
            validate_device_key(key)
        except TopicError:
            raise _Refused(mp.BAD_USERNAME_PASSWORD, "username is not a device key") from None
        client_uuid = _client_uuid(connect.client_id, key)
        will = connect.will
        if will is not None and not self.scheme.is_own(key, will.topic, TopicKind.STATUS):
            # A will is a message the device cannot be held to when it is sent: only its own
            # presence topic is acceptable (and the link's end says the same anyway).
            raise _Refused(mp.NOT_AUTHORIZED, "last will on a topic that is not its own status")
        try:
            identity = self.admission.admit(
                HandshakeRequest(
                    transport=TRANSPORT,
                    credential=connect.password,
                    device_id=device_id_from_key(key),
                    client_id=client_uuid,
                    protocol_version="1",
                    remote=remote,
                )
            )
        except HandshakeRefused as exc:
            code = _REFUSAL_CODES.get(exc.status, mp.NOT_AUTHORIZED)
            raise _Refused(code, exc.reason, exc.status) from None
        return key, identity

    async def _serve(
        self, link: EndpointLink, reader: asyncio.StreamReader, packets: mp.PacketReader
    ) -> None:
        handler = link.handler
        assert handler is not None
        link.task = asyncio.current_task()
        try:
            # Packets that came in the CONNECT's read (a client that does not wait for CONNACK)
            # first, then whatever arrives.
            while not link.closed:
                for packet in packets.packets():
                    await self._on_packet(link, handler, packet)
                    if link.closed:
                        break
                else:
                    data = await reader.read(_READ_CHUNK)
                    if not data:
                        break
                    link.last_packet = time.monotonic()
                    packets.feed(data)
        except mp.PacketTooLarge as exc:
            self._violation(link, "packet_too_large", str(exc))
        except mp.MalformedPacket as exc:
            self._violation(link, "malformed", str(exc))
        except _Close as close:
            if close.code == POLICY_VIOLATION:
                self._violation(link, close.reason, close.reason)
            else:
                link.abort(close.reason, close.code)
        except (ConnectionError, LinkClosed):
            pass
        finally:
            self._finish(link, handler)

    def _violation(self, link: EndpointLink, reason: str, detail: str) -> None:
        if reason in _CUT_OFF_REASONS:  # others were counted by the session that closed it
            record_cut_off(TRANSPORT, _CUT_OFF_REASONS[reason])
        self.count(f"cut_off_{reason}" if " " not in reason else "cut_off")
        self._budget.warning(
            "mqtt device cut off", key=reason, reason=detail, device_id=link.identity.device_id
        )
        link.abort(detail, POLICY_VIOLATION)

    def _finish(self, link: EndpointLink, handler: LinkHandler) -> None:
        if not link.closed:
            link.abort("connection lost")
        if self._links.get(link.key) is link:
            del self._links[link.key]
        if link.close_code == POLICY_VIOLATION:
            self.admission.cut_off(link.identity.device_id)
        self.count("links_closed")
        handler.on_closed(link.close_reason)

    async def _on_packet(self, link: EndpointLink, handler: LinkHandler, packet: mp.Packet) -> None:
        if isinstance(packet, mp.Publish):
            await self._on_publish(link, handler, packet)
        elif isinstance(packet, mp.Ack):
            self._on_ack(link, handler, packet)
            if packet.kind == mp.PUBREL:
                await link.write(mp.ack(mp.PUBCOMP, packet.packet_id))
        elif isinstance(packet, mp.Subscribe):
            handler.on_discarded(len(packet.filters) * 8)
            codes = [self._grant(link, topic, qos) for topic, qos in packet.filters]
            await link.write(mp.suback(packet.packet_id, codes))
        elif isinstance(packet, mp.Unsubscribe):
            handler.on_discarded(len(packet.filters) * 8)
            await link.write(mp.ack(mp.UNSUBACK, packet.packet_id))
        elif isinstance(packet, mp.Simple):
            if packet.kind == mp.DISCONNECT:
                raise _Close("device disconnected")
            handler.on_discarded(2)
            await link.write(mp.PINGRESP_BYTES)
        else:  # a second CONNECT (§3.1.0-2)
            raise _Close("second CONNECT", POLICY_VIOLATION)

    def _grant(self, link: EndpointLink, topic: str, qos: int) -> int:
        """Only the device's own downlink can be subscribed to (and it is delivered anyway)."""
        if topic == link.down_topic:
            return min(qos, 1)
        self.count("subscriptions_refused")
        return mp.SUBSCRIBE_FAILURE

    def _on_ack(self, link: EndpointLink, handler: LinkHandler, packet: mp.Ack) -> None:
        if packet.kind == mp.PUBACK and packet.packet_id in link.unacked:
            link.unacked.discard(packet.packet_id)
            return  # the answer to our own message costs nothing
        if packet.kind == mp.PUBREL:
            link.qos2_pending.discard(packet.packet_id)
        else:
            self.count("acks_unexpected")
        handler.on_discarded(4)

    async def _on_publish(
        self, link: EndpointLink, handler: LinkHandler, packet: mp.Publish
    ) -> None:
        size = len(packet.payload)
        if packet.retain:
            self.count("retain_ignored")  # never stored: nothing here is ever replayed to anyone
        deliver = True
        if packet.qos == 2:
            assert packet.packet_id is not None
            if packet.packet_id in link.qos2_pending:
                deliver = False  # a repeat before PUBREL: once only
            elif len(link.qos2_pending) >= self.settings.max_qos2_pending:
                raise _Close("too many QoS 2 messages awaiting PUBREL", POLICY_VIOLATION)
            link.qos2_pending.add(packet.packet_id)
        if deliver:
            await self._deliver(link, handler, packet.topic, packet.payload)
        else:
            handler.on_discarded(size)
        if packet.qos == 1 and packet.packet_id is not None:
            await link.write(mp.ack(mp.PUBACK, packet.packet_id))
        elif packet.qos == 2 and packet.packet_id is not None:
            await link.write(mp.ack(mp.PUBREC, packet.packet_id))

    async def _deliver(
        self, link: EndpointLink, handler: LinkHandler, topic: str, payload: bytes
    ) -> None:
        if topic == self.scheme.up(link.key):
            try:
                text = payload.decode("utf-8")
            except UnicodeDecodeError:
                self._drop(link, handler, "not_utf8", len(payload))
                return
            if claims_another_device(text, link.identity.device_id):
                self._drop(link, handler, "claims_other_device", len(payload))
                return
            self.count("received")
            await handler.on_text(text)
        elif topic == self.scheme.status(link.key):
            handler.on_discarded(len(payload))
            try:
                presence = parse_presence(payload)
            except TopicError:
                self._drop(link, handler, "bad_presence", 0)
                return
            if not presence.online:
                raise _Close("device offline")
        else:
            self._drop(link, handler, "foreign_topic", len(payload), topic=topic[:120])

    def _drop(
        self, link: EndpointLink, handler: LinkHandler, reason: str, size: int, **fields: object
    ) -> None:
        self.count(f"dropped_{reason}")
        self._budget.warning(
            "mqtt message dropped",
            key=reason,
            reason=reason,
            device_id=link.identity.device_id,
            **fields,
        )
        if size:
            handler.on_discarded(size)

    async def _keepalive_watchdog(self) -> None:
        """Drop a device silent for 1.5 × its keepalive (or `idle_timeout_s` without one)."""
        while True:
            await asyncio.sleep(self.settings.keepalive_check_s)
            now = time.monotonic()
            for link in list(self._links.values()):
                limit = link.keepalive_s or self.settings.idle_timeout_s
                if now - link.last_packet > limit:
                    self.count("keepalive_timeouts")
                    link.abort(f"no packet for {limit:g} s (keepalive)")


def _client_uuid(client_id: str, key: str) -> str | None:
    """A device uses its key or a stock id naming it as client id; its uuid part, if any."""
    if is_stock_client_id(client_id):
        try:
            stock = parse_client_id(client_id)
        except TopicError:
            raise _Refused(mp.IDENTIFIER_REJECTED, "malformed GID@@@device@@@uuid") from None
        if stock.device_key != key:
            raise _Refused(mp.IDENTIFIER_REJECTED, "client id names another device")
        return stock.client_id
    if client_id != key:
        raise _Refused(mp.IDENTIFIER_REJECTED, "client id names another device")
    return None


class _GuardedStream(asyncio.StreamReaderProtocol):
    """A stream protocol whose connection is first put to the endpoint's `ConnectionGuard`:
    a dropped one costs no StreamWriter, no task and no read (a storm of thousands is cheap)."""

    def __init__(
        self,
        endpoint: MqttEndpoint,
        reader: asyncio.StreamReader,
        accept: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    ) -> None:
        super().__init__(reader, accept)
        self._endpoint = endpoint
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._endpoint.admit(transport):
            self._refused = True
            if isinstance(transport, asyncio.Transport):
                transport.abort()
            return
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._refused:
            super().connection_lost(exc)


def _address(peer: object) -> str | None:
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
