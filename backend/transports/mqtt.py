"""MQTT + UDP device transport (protocol reference §2) on `aiomqtt`.

The bridge is one MQTT client of an external broker (EMQX, or Mosquitto for devices that subscribe
themselves; the embedded default is not a broker but the bridge's own endpoint, `mqtt_endpoint`).
It subscribes to every device's uplink and presence topics (`mqtt_topics`) and keeps one
`DeviceLink` per online device:

- a device comes online with a retained `online` on its status topic (our firmware and the
  simulator set it, with a last will `offline`), with a broker's presence event (EMQX), or —
  stock firmware on a broker without presence events — with its first uplink message;
- it goes offline with `offline` (last will or presence event), after `silence_timeout_s` without
  any message when no presence was ever seen for it, or when the bridge loses the broker (then
  every link closes at once with "broker connection lost" and devices come back as they publish
  again);
- a message on `<prefix>/<key>/up` is that device's, whatever it says: the topic is the identity
  (the broker's ACL confines each device to its own topics) and a message whose content claims
  another device id is dropped;
- messages are handed to the session in order per device, through a bounded queue and one task
  per device, so a slow device never holds up the others; a full queue drops (counted, logged);
- every message of a device with a link costs it against its inbound limit, delivered or not:
  one dropped here (not UTF-8, claiming another device, past a full queue, a repeated or bad
  status) is charged through the session's `on_discarded`;
- no message larger than `max_message_bytes` is published to a device (`MessageTooLarge`, as on
  WebSocket).

Several bridge instances share one broker by shards (`mqtt_topics`, docs/mqtt.md): with
`MqttSettings.shards` > 1 the topics carry the device key's shard, and `set_shards` says which
shards this instance serves (None, the default: all). It subscribes to the filters of shards
gained, unsubscribes from those lost and closes the links of their devices locally (nothing is
sent to the device, which stays connected to the broker): the new owner's subscription receives
the retained `online` and opens the link there.

Audio rides on UDP (`udp.UdpAudioChannel`), opened by the session's hello (`hello_fields`) and
dropped by `conversation_ended`. The transport reconnects to the broker with exponential backoff
and jitter, forever, until `stop`.
"""

import asyncio
import socket
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import aiomqtt
import structlog

from backend.common import WILDCARD_HOSTS, Backoff
from backend.errors import MessageTooLarge
from backend.logs import EventBudget
from backend.protocol.audio import AudioFrame
from backend.transports.admission import Admission, HandshakeRequest
from backend.transports.base import DeviceIdentity, DeviceLink, LinkAcceptor, LinkHandler, Transport
from backend.transports.errors import (
    HandshakeRefused,
    LinkClosed,
    MqttConfigError,
    TopicError,
    WrongShard,
)
from backend.transports.mqtt_audio import LinkAudio
from backend.transports.mqtt_topics import (
    DEFAULT_PREFIX,
    TopicKind,
    TopicScheme,
    claimed_device_id,
    claims_another_device,
    device_id_from_key,
    parse_presence,
)
from backend.transports.udp import UdpAudioChannel
from backend.transports.udp_packet import DEFAULT_MAX_PAYLOAD

POLICY_VIOLATION = 1008  # a revoked device, or one cut off for breaking a bound
log = structlog.get_logger("transport.mqtt")

TRANSPORT = "mqtt"
BROKER_LOST = "broker connection lost"
SHUTDOWN = "bridge shutting down"
SHARD_MOVED = "shard moved to another bridge instance"
# Filters per SUBSCRIBE/UNSUBSCRIBE packet: 1024 shards are 2048 filters, which in one packet
# could pass a broker's max_packet_size.
_FILTERS_PER_PACKET = 64
# What the transport presents to Admission as the device's credential: the broker has already
# checked the device's own login and confined it to its topics (see `BrokerVouched`).
BROKER_CREDENTIAL = "mqtt-broker-authenticated"
_CLOSE = object()  # queue sentinel: process what came before, then close
_MAX_OFFLINE_NOTES = 10_000


class BrokerVouched:
    """`DeviceCredentials` for MQTT: a device the broker let publish on its own topic is in.

    `Admission(BrokerVouched())` is what the core hands this transport; anything else that
    implements `refusal` (an allow-list, a registry lookup) can replace it.
    """

    def refusal(self, device_id: str, presented: str | None) -> str | None:
        """Admit only links the broker authenticated (the transport passes a marker, never a
        secret)."""
        return None if presented == BROKER_CREDENTIAL else "not authenticated by the broker"


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    """`mqtt://[user:pass@]host[:port]` (1883) or `mqtts://…` (TLS, 8883)."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str) -> "BrokerAddress":
        """Parse an `mqtt://` or `mqtts://` URL; raises MqttConfigError with what is wrong."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise MqttConfigError(f"invalid broker URL: {exc}") from None
        if parts.scheme not in ("mqtt", "mqtts"):
            raise MqttConfigError("broker URL must start with mqtt:// or mqtts://")
        if not parts.hostname:
            raise MqttConfigError("broker URL has no host")
        tls = parts.scheme == "mqtts"
        return cls(
            host=parts.hostname,
            port=port or (8883 if tls else 1883),
            tls=tls,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password is not None else None,
        )

    def redacted(self) -> str:
        """The URL without the password, for logs and `endpoints()`."""
        user = f"{self.username}@" if self.username else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'mqtts' if self.tls else 'mqtt'}://{user}{host}:{self.port}"

    def client(
        self,
        identifier: str,
        *,
        keepalive_s: int,
        timeout_s: float,
        tls_ca_file: str | None = None,
        **options: Any,
    ) -> aiomqtt.Client:
        """An aiomqtt client of this broker (credentials, TLS for `mqtts://`), with Nagle off:
        paho leaves it on, and a PUBACK of ours still unacknowledged then held the next request
        until the broker's delayed ACK, 40 ms per call through a local broker. `options` go to
        aiomqtt (protocol, will, queue bounds)."""
        tls = ssl.create_default_context(cafile=tls_ca_file) if self.tls else None
        return aiomqtt.Client(
            self.host,
            self.port,
            username=self.username,
            password=self.password,
            identifier=identifier,
            keepalive=keepalive_s,
            tls_context=tls,
            timeout=timeout_s,
            socket_options=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),),
            **options,
        )


@dataclass(frozen=True, slots=True)
class MqttSettings:
    """How the bridge reaches an external broker and where its UDP audio listens."""

    broker_url: str = field(default="mqtt://127.0.0.1:1883", repr=False)  # may hold a password
    client_id: str = "esp32-mcp-bridge"
    topic_prefix: str = DEFAULT_PREFIX
    shards: int = 1  # `mqtt_shards`: 1 = topics without a shard level
    keepalive_s: int = 60
    # UDP audio: where to bind, and the address devices are told in the hello.
    udp_host: str = "0.0.0.0"
    udp_port: int = 8884
    udp_public_host: str | None = None
    max_udp_payload: int = DEFAULT_MAX_PAYLOAD
    # Stock firmware sets no last will: without presence events, a device that sent nothing for
    # this long is considered gone (1.5 × its 240 s keepalive).
    silence_timeout_s: float = 360.0
    silence_check_s: float = 5.0
    # After `offline`, uplink messages of that device that arrive late (a broker may deliver a
    # device's last messages after its presence event) are dropped instead of reopening a link.
    offline_grace_s: float = 5.0
    inbound_queue: int = 64  # per device
    broker_queue: int = 4096  # the client's own incoming queue
    outbound_queue: int = 1024  # publishes waiting for the broker; beyond it send_text fails
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 5.0
    publish_timeout_s: float = 10.0
    tls_ca_file: str | None = None
    # The largest message a device is sent, as on WebSocket (`Settings.max_message_bytes`).
    max_message_bytes: int = 65536

    def address(self) -> BrokerAddress:
        """The parsed broker URL; raises MqttConfigError."""
        return BrokerAddress.parse(self.broker_url)

    def announced_udp_host(self) -> str:
        """The UDP host devices are told; raises MqttConfigError when a wildcard bind gives none."""
        if self.udp_public_host:
            return self.udp_public_host
        if self.udp_host in WILDCARD_HOSTS:
            raise MqttConfigError(
                "udp_public_host must be set when the UDP socket binds to all interfaces "
                "(devices are told this address in the hello)"
            )
        return self.udp_host


class MqttLink:
    """One online device as the session sees it. Texts go out on its downlink topic (QoS 1),
    audio on its current UDP session."""

    conversation_scoped = False

    def __init__(self, transport: "MqttTransport", identity: DeviceIdentity, key: str) -> None:
        self._transport = transport
        self._identity = identity
        self.device_key = key
        self.down_topic = transport.scheme.down(key)
        self.handler: LinkHandler | None = None
        self.audio = LinkAudio(
            transport.udp, transport.udp_public_host, identity.device_id, self._on_audio
        )
        self.closed = False
        self.closed_reason = "closed"
        self.log = log.bind(device_id=identity.device_id)

    @property
    def identity(self) -> DeviceIdentity:
        """Who the device is, as established when the link opened."""
        return self._identity

    async def send_text(self, text: str) -> None:
        """Publish on the downlink topic; MessageTooLarge (nothing sent) past the device's limit,
        the same rule and error as on WebSocket."""
        if self.closed:
            raise LinkClosed("link closed")
        data = text.encode()
        limit = self._transport.settings.max_message_bytes
        if len(data) > limit:
            raise MessageTooLarge(len(data), limit)
        await self._transport.publish(self.down_topic, data)

    async def send_audio(self, frame: AudioFrame) -> None:
        """Send one frame over the conversation's UDP session; counted and dropped without one."""
        if self.closed:
            raise LinkClosed("link closed")
        if not self.audio.send(frame):
            self._transport.count("udp_no_session")

    def hello_fields(self, session_id: str) -> dict[str, object]:
        """Open a fresh UDP session (replacing any earlier one) and describe it for the hello."""
        if self.closed:
            raise LinkClosed("link closed")
        return self.audio.open(session_id)

    def conversation_ended(self, session_id: str) -> None:
        """Release the UDP session of that conversation."""
        self.audio.ended(session_id)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Forget the device until it shows up again; on a policy close (revoked, cut off for
        flooding) its next link waits like a WebSocket device's (the broker's files decide
        whether it may stay connected to the broker)."""
        self._transport.close_link(self, reason or f"closed by the bridge ({code})")
        if code == POLICY_VIOLATION:
            self._transport.admission.cut_off(self._identity.device_id)

    def _on_audio(self, frame: AudioFrame) -> None:
        handler = self.handler
        if handler is not None and not self.closed:
            handler.on_audio(frame)


class _Device:
    """Per-device state: the link, its handler, the bounded inbound queue and its worker."""

    __slots__ = ("busy", "closing", "key", "last_seen", "link", "presence", "queue", "worker")

    def __init__(self, key: str, link: MqttLink, queue_size: int, presence: bool) -> None:
        self.key = key
        self.link = link
        self.queue: asyncio.Queue[str | object] = asyncio.Queue(queue_size)
        self.worker: asyncio.Task[None] | None = None
        self.last_seen = time.monotonic()
        self.presence = presence
        self.closing = False
        self.busy = False


class MqttTransport:
    """Devices over MQTT (control, MCP) and UDP (audio), one link per online device."""

    name = TRANSPORT

    def __init__(
        self,
        settings: MqttSettings,
        admission: Admission,
        *,
        udp: UdpAudioChannel | None = None,
    ) -> None:
        self.settings = settings
        self.admission = admission
        self.address = settings.address()
        self.scheme = TopicScheme(settings.topic_prefix, settings.shards)
        self.udp = udp or UdpAudioChannel(
            settings.udp_host, settings.udp_port, max_payload=settings.max_udp_payload
        )
        self.udp_public_host = settings.announced_udp_host()
        self.counters: dict[str, int] = {}
        self._acceptor: LinkAcceptor | None = None
        self._devices: dict[str, _Device] = {}
        self._client: aiomqtt.Client | None = None
        self._runner: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        # Done when the current broker connection is lost: a publish waiting for its PUBACK then
        # fails at once (aiomqtt would wait out its timeout), and so does the call behind it.
        self._connection_gone: asyncio.Future[None] | None = None
        self._stopping = False
        self._draining: set[_Device] = set()
        self._workers: set[asyncio.Task[None]] = set()
        self._offline_at: dict[str, float] = {}  # device key -> when `offline` came (bounded)
        self._drops = EventBudget(log, "mqtt message dropped")
        self._owned: frozenset[int] | None = None  # None: every shard
        self._subscribed: list[str] = []  # filters of the current broker connection
        self._subscriptions = asyncio.Lock()  # one change of filters at a time

    # ---- Transport ------------------------------------------------------------------------------

    async def start(self, acceptor: LinkAcceptor) -> None:
        """Bind UDP and start the broker connection loop (it keeps retrying in the background)."""
        self._acceptor = acceptor
        self._stopping = False
        if not self.udp.running:
            await self.udp.start()
        self._runner = asyncio.create_task(self._run(), name="mqtt-transport")
        self._sweeper = asyncio.create_task(self._sweep_silent(), name="mqtt-silence")

    async def stop(self) -> None:
        """Close every link, disconnect from the broker, release the UDP socket."""
        self._stopping = True
        for task in (self._runner, self._sweeper):
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(task for task in (self._runner, self._sweeper) if task is not None),
            return_exceptions=True,
        )
        self._runner = self._sweeper = None
        self._close_all(SHUTDOWN)
        if self._workers:  # idle ones are cancelled; a busy one ends when its call returns
            await asyncio.wait(set(self._workers), timeout=self.settings.publish_timeout_s)
        await self.udp.stop()

    def endpoints(self) -> dict[str, str]:
        """The broker (password redacted) and the announced UDP address."""
        return {
            "mqtt": self.address.redacted(),
            "udp": f"{self.udp_public_host}:{self.udp.port}",
        }

    # ---- state for the bridge and tests ---------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the bridge is connected to the broker now."""
        return self._connected.is_set()

    async def wait_connected(self, timeout_s: float = 10.0) -> None:
        """Until the broker connection is up and subscribed (TimeoutError otherwise)."""
        async with asyncio.timeout(timeout_s):
            await self._connected.wait()

    def links(self) -> dict[str, MqttLink]:
        """Live links by device id."""
        return {device.link.identity.device_id: device.link for device in self._devices.values()}

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a named counter of the transport's stats."""
        self.counters[name] = self.counters.get(name, 0) + amount

    def stats(self) -> dict[str, int]:
        """The transport's counters, its link count and its UDP channel's counters."""
        udp = {f"udp_{name}": value for name, value in self.udp.stats().items()}
        return {**self.counters, "links": len(self._devices), **udp}

    # ---- outgoing -------------------------------------------------------------------------------

    async def publish(self, topic: str, data: str | bytes) -> None:
        """Publish one message (text as UTF-8) at QoS 1; LinkClosed if the broker is not
        reachable. No size check here: `MqttLink.send_text` applies the device's limit."""
        client = self._client
        if client is None or not self._connected.is_set():
            raise LinkClosed(BROKER_LOST)
        gone = self._connection_gone
        publishing = asyncio.ensure_future(
            client.publish(topic, data, qos=1, timeout=self.settings.publish_timeout_s)
        )
        if gone is not None:
            try:
                await asyncio.wait((publishing, gone), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                publishing.cancel()
                raise
            if not publishing.done():
                publishing.cancel()
                raise LinkClosed(BROKER_LOST)
        try:
            await publishing
        except aiomqtt.MqttError as exc:
            raise LinkClosed(f"publish failed: {exc}") from None
        self.count("published")

    # ---- broker connection ----------------------------------------------------------------------

    def _client_for(self) -> aiomqtt.Client:
        return self.address.client(
            self.settings.client_id,
            keepalive_s=self.settings.keepalive_s,
            timeout_s=self.settings.publish_timeout_s,
            tls_ca_file=self.settings.tls_ca_file,
            clean_session=True,
            max_queued_incoming_messages=self.settings.broker_queue,
            max_queued_outgoing_messages=self.settings.outbound_queue,
        )

    async def _run(self) -> None:
        backoff = Backoff(self.settings.reconnect_min_s, self.settings.reconnect_max_s)
        while not self._stopping:
            try:
                async with self._client_for() as client:
                    async with self._subscriptions:  # no set_shards halfway through
                        self._subscribed = []
                        await self._subscribe(client, self._wanted_filters())
                        self._client = client
                    self._connection_gone = asyncio.get_running_loop().create_future()
                    self._connected.set()
                    backoff.reset()
                    self.count("broker_connects")
                    log.info("connected to mqtt broker", broker=self.address.redacted())
                    async for message in client.messages:
                        self._dispatch(message)
            except aiomqtt.MqttError as exc:
                self._lost(str(exc))
            except asyncio.CancelledError:
                self._lost(None)
                raise
            if self._stopping:
                return
            delay = backoff.next_wait()
            log.info(
                "reconnecting to mqtt broker", attempt=backoff.attempts, delay_s=round(delay, 2)
            )
            await asyncio.sleep(delay)

    # ---- shards ---------------------------------------------------------------------------------

    @property
    def owned_shards(self) -> frozenset[int] | None:
        """The shards this instance serves; None = all of them (the default)."""
        return self._owned

    def owns(self, shard: int) -> bool:
        """Whether this instance serves the devices of `shard`."""
        return self._owned is None or shard in self._owned

    async def set_shards(self, shards: Iterable[int] | None) -> None:
        """Serve exactly these shards (None: all). Links of devices in shards lost close at once
        (locally: the device stays connected to the broker, and the new owner's subscription
        gets its retained `online`); subscriptions follow while connected, and a reconnect
        subscribes to the current set. Works before `start`. MqttConfigError for a shard that
        is not in 0..shards-1."""
        owned = None if shards is None else frozenset(shards)
        for shard in owned or ():
            if isinstance(shard, bool) or not isinstance(shard, int):
                raise MqttConfigError(f"shard {shard!r} is not an integer")
            if not 0 <= shard < self.scheme.shards:
                raise MqttConfigError(f"shard {shard} is not in 0..{self.scheme.shards - 1}")
        log.info("mqtt shards set", shards=None if owned is None else sorted(owned))
        async with self._subscriptions:
            self._owned = owned
            self._close_unowned()
            client = self._client
            if client is None:  # not connected: the connection loop subscribes to these
                return
            try:
                await self._resubscribe(client)
            except aiomqtt.MqttError as exc:  # the connection loop will resubscribe
                self.count("shard_subscribe_failures")
                log.warning("mqtt shard subscription failed", error=str(exc))

    def _wanted_filters(self) -> list[str]:
        shards = range(self.scheme.shards) if self._owned is None else sorted(self._owned)
        return [topic for shard in shards for topic in self.scheme.shard_filters(shard)]

    async def _resubscribe(self, client: aiomqtt.Client) -> None:
        """Unsubscribe the filters no longer wanted first (their messages are dropped from now
        on anyway), then subscribe the new ones: no filter overlaps another, so nothing arrives
        twice."""
        wanted = self._wanted_filters()
        lost = [topic for topic in self._subscribed if topic not in wanted]
        for batch in _batches(lost):
            await client.unsubscribe(batch, timeout=self.settings.publish_timeout_s)
            self._subscribed = [topic for topic in self._subscribed if topic not in batch]
        await self._subscribe(client, [t for t in wanted if t not in self._subscribed])

    async def _subscribe(self, client: aiomqtt.Client, filters: list[str]) -> None:
        for batch in _batches(filters):
            await client.subscribe(
                [(topic, 1) for topic in batch], timeout=self.settings.publish_timeout_s
            )
            self._subscribed.extend(batch)

    def _close_unowned(self) -> None:
        for device in list(self._devices.values()):
            if not self.owns(self.scheme.shard_of(device.key)):
                self.count("shard_moved_links")
                self._close_device(device, SHARD_MOVED, drain=False)

    def _lost(self, error: str | None) -> None:
        was_connected = self._connected.is_set()
        self._client = None
        self._connected.clear()
        gone, self._connection_gone = self._connection_gone, None
        if gone is not None and not gone.done():
            gone.set_result(None)
        if error is not None:
            if was_connected:
                self.count("broker_losses")
                log.warning("mqtt broker connection lost", error=error, links=len(self._devices))
            else:
                self.count("broker_connect_failures")
                log.warning("mqtt broker unreachable", broker=self.address.redacted(), error=error)
        if not self._stopping:
            self._close_all(BROKER_LOST)

    # ---- incoming -------------------------------------------------------------------------------

    def _dispatch(self, message: aiomqtt.Message) -> None:
        self.count("received")
        topic = message.topic.value
        try:
            parsed = self.scheme.parse(topic)
        except WrongShard as exc:  # a device's own key, under another shard: never served
            self._drop("wrong_shard", topic=topic[:120], detail=str(exc))
            return
        except TopicError as exc:
            self._drop("bad_topic", topic=topic[:120], detail=str(exc))
            return
        if not self.owns(parsed.shard):  # arrived before the unsubscription took effect
            self._drop("unowned_shard", device_key=parsed.device_key, shard=parsed.shard)
            return
        payload = message.payload
        if not isinstance(payload, bytes | bytearray):
            self._drop("bad_payload", device_key=parsed.device_key)
            return
        if parsed.kind is TopicKind.STATUS:
            self._on_presence(parsed.device_key, bytes(payload))
        elif parsed.kind is TopicKind.UP:
            if message.retain:
                # A retained uplink is an old message the broker replays at every subscription
                # (the bridge's reconnect): never a request the device is making now.
                self._drop("retained_uplink", device_key=parsed.device_key)
                return
            self._on_uplink(parsed.device_key, bytes(payload))

    def _on_presence(self, key: str, payload: bytes) -> None:
        if not payload:
            return  # a cleared retained status
        try:
            presence = parse_presence(payload)
        except TopicError as exc:
            self._drop("bad_presence", device_key=key, detail=str(exc))
            self._discarded(self._devices.get(key), len(payload))
            return
        device = self._devices.get(key)
        if presence.online:
            self._offline_at.pop(key, None)
            if device is None:
                self._open(key, presence=True, client_id=presence.client_id)
            else:
                device.presence = True
                device.last_seen = time.monotonic()
                self._discarded(device, len(payload))  # a repeat: it costs like any message
            return
        self._note_offline(key)
        if device is not None:
            self._close_device(device, "device offline", drain=True)

    def _note_offline(self, key: str) -> None:
        now = time.monotonic()
        self._offline_at.pop(key, None)
        self._offline_at[key] = now  # insertion order = age order
        grace = self.settings.offline_grace_s
        while self._offline_at:
            oldest, at = next(iter(self._offline_at.items()))
            if now - at <= grace and len(self._offline_at) <= _MAX_OFFLINE_NOTES:
                break
            del self._offline_at[oldest]

    def _just_went_offline(self, key: str) -> bool:
        at = self._offline_at.get(key)
        return at is not None and time.monotonic() - at <= self.settings.offline_grace_s

    def _on_uplink(self, key: str, payload: bytes) -> None:
        """Every uplink message is its device's (the topic says whose) and costs it, delivered
        or not: one the session gets is charged there (`on_text`), and one dropped here (not
        UTF-8, claiming another device, past the full queue) through `on_discarded`."""
        device = self._devices.get(key)
        if device is None:
            if self._just_went_offline(key):
                self._drop("after_offline", device_key=key)
                return
            device = self._open(key, presence=False, client_id=None)
            if device is None:
                return
        device.last_seen = time.monotonic()
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            self._drop("not_utf8", device_key=key)
            self._discarded(device, len(payload))
            return
        if claims_another_device(text, device.link.identity.device_id):
            claimed = claimed_device_id(text)
            self._drop("claims_other_device", device_key=key, claimed=str(claimed)[:64])
            self._discarded(device, len(payload))
            return
        try:
            device.queue.put_nowait(text)
        except asyncio.QueueFull:
            self._drop("queue_full", device_key=key, queued=device.queue.qsize())
            self._discarded(device, len(payload))

    def _discarded(self, device: _Device | None, size: int) -> None:
        """Charge a message the session never gets to the device's inbound limit (the handler's
        `on_discarded`); past it the session closes the link."""
        if device is None or device.closing or device.link.handler is None:
            return
        try:
            device.link.handler.on_discarded(size)
        except Exception as exc:  # the session's bug must not stop the dispatcher
            self._drop("handler_error", device_key=device.key, detail=f"{exc!r}"[:200])

    def _drop(self, reason: str, **fields: object) -> None:
        self.count(f"dropped_{reason}")
        self._drops.hit(reason, **fields)

    # ---- links ----------------------------------------------------------------------------------

    def _open(self, key: str, *, presence: bool, client_id: str | None) -> _Device | None:
        acceptor = self._acceptor
        if acceptor is None or self._stopping:
            return None
        request = HandshakeRequest(
            transport=TRANSPORT,
            credential=BROKER_CREDENTIAL,
            device_id=device_id_from_key(key),
            client_id=client_id,
            protocol_version="1",
        )
        try:
            identity = self.admission.admit(request)
        except HandshakeRefused as exc:
            self._drop("refused", device_key=key, detail=exc.reason)
            return None
        link = MqttLink(self, identity, key)
        device = _Device(key, link, self.settings.inbound_queue, presence)
        self._devices[key] = device
        try:
            link.handler = acceptor.open_link(link)
        except Exception as exc:
            del self._devices[key]
            link.closed = True
            self._drop("open_failed", device_key=key, detail=f"{type(exc).__name__}: {exc}")
            return None
        device.worker = asyncio.create_task(self._work(device), name=f"mqtt-device-{key}")
        self._workers.add(device.worker)
        device.worker.add_done_callback(self._workers.discard)
        self.count("links_opened")
        link.log.info("mqtt device online", presence=presence)
        return device

    async def _work(self, device: _Device) -> None:
        """Feed one device's messages to its handler, in order, until the link closes."""
        handler = device.link.handler
        assert handler is not None
        try:
            while not device.link.closed:
                item = await device.queue.get()
                if item is _CLOSE:
                    break
                if not isinstance(item, str):
                    continue
                device.busy = True
                try:
                    await handler.on_text(item)
                except Exception as exc:  # the session's bug must not stop this device's queue
                    self._drop("handler_error", device_key=device.key, detail=f"{exc!r}"[:200])
                finally:
                    device.busy = False
        finally:
            self._draining.discard(device)
        self._finish(device)

    def close_link(self, link: MqttLink, reason: str) -> None:
        """Close at once (the core's `link.close`): queued messages are dropped."""
        device = self._devices.get(link.device_key)
        if device is not None and device.link is link:
            self._close_device(device, reason, drain=False)
        elif not link.closed:
            link.closed = True
            link.audio.release()

    def _close_device(self, device: _Device, reason: str, *, drain: bool) -> None:
        """Forget the device; `on_closed` after its queued messages (drain) or right now.

        A message the handler is processing is never interrupted: the link is marked closed
        (sends raise LinkClosed) and the worker ends when that call returns.
        """
        if device.closing:
            return
        device.closing = True
        if self._devices.get(device.key) is device:
            del self._devices[device.key]
        device.link.audio.release()
        device.link.closed_reason = reason
        worker = device.worker
        if drain and worker is not None and not worker.done():
            try:
                device.queue.put_nowait(_CLOSE)
                self._draining.add(device)
                return
            except asyncio.QueueFull:
                pass
        if worker is not None and not device.busy and worker is not asyncio.current_task():
            worker.cancel()
        self._finish(device)

    def _finish(self, device: _Device) -> None:
        link = device.link
        if link.closed:
            return
        link.closed = True
        self.count("links_closed")
        link.log.info("mqtt device link closed", reason=link.closed_reason)
        handler = link.handler
        if handler is not None:
            try:
                handler.on_closed(link.closed_reason)
            except Exception as exc:
                self._drop("handler_error", device_key=device.key, detail=f"{exc!r}"[:200])

    def _close_all(self, reason: str) -> None:
        for device in list(self._devices.values()):
            self._close_device(device, reason, drain=False)
        for device in list(self._draining):  # still working through their last messages
            self._draining.discard(device)
            device.closing = False
            device.link.closed_reason = reason
            self._close_device(device, reason, drain=False)

    async def _sweep_silent(self) -> None:
        """Close presence-less links that sent nothing for silence_timeout_s."""
        timeout = self.settings.silence_timeout_s
        while True:
            await asyncio.sleep(min(self.settings.silence_check_s, timeout / 2))
            now = time.monotonic()
            for device in list(self._devices.values()):
                if not device.presence and now - device.last_seen > timeout:
                    self.count("silence_timeouts")
                    self._close_device(device, f"no message for {timeout:g} s", drain=True)


def _batches(filters: list[str]) -> list[list[str]]:
    return [
        filters[start : start + _FILTERS_PER_PACKET]
        for start in range(0, len(filters), _FILTERS_PER_PACKET)
    ]


if TYPE_CHECKING:  # the seam, checked by mypy: these classes satisfy the core's protocols

    def _conforms(link: MqttLink, transport: MqttTransport) -> tuple[DeviceLink, Transport]:
        return link, transport
