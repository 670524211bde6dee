"""An embedded MQTT 3.1.1 broker (amqtt 0.12) in the bridge's own event loop.

It exists for stock firmware, which subscribes to nothing (reference §2.1): when a device
connects, the broker subscribes it to its own downlink topic on the server side, so whatever the
bridge publishes there reaches it. Its plugins also:

- authenticate every CONNECT: the bridge's own account (any client id), or a device whose
  username is its device key, whose client id is that key or a stock one naming it
  (`GID_x@@@<key>@@@<uuid>`), and whose password the pluggable `CredentialProvider` accepts;
- confine each device to its own topics: publish only to `<prefix>/<key>/up` and `/status`,
  subscribe to and receive only `<prefix>/<key>/down` (the bridge may do anything);
- publish presence on behalf of devices (stock firmware sets no last will):
  `{"state":"online","client_id":…}` on `<prefix>/<key>/status` when a device's first connection
  comes up, `offline` when its last one goes, and every online device again when the bridge
  subscribes to the status topics (so a reconnecting bridge learns who is there);
- enforce MQTT keepalive, which amqtt itself does not: a client silent for 1.5 × its keepalive is
  disconnected (its will, if any, is published and it goes offline).

Three amqtt 0.12.1 defects are worked around here, all covered by tests:
- `Broker._initialize_client_session` deletes the existing session of a clean-session CONNECT's
  client id (with its subscriptions, the server-side downlink one too), or hands a persistent
  CONNECT the existing session with its login overwritten, *before* `_handle_client_session`
  authenticates it; the refused session then replaces the live one in amqtt's table. Anyone
  knowing a device's client id could cut it off its downlink while it stayed connected. So the
  accept layer (`EmbeddedBroker._admit`) reads and decides every CONNECT itself, before amqtt
  sees a byte: a refused one gets its CONNACK there and is closed, an accepted one is replayed
  to amqtt, whose auth plugin makes the same decision (`_Policy.decide`) again;
- a client that connects is sent every retained message matching *any* client's subscription,
  without the topic ACL (`Broker._handle_client_session`): retained messages would leak other
  devices' presence. This broker therefore stores no retained message: the retain flag of every
  incoming PUBLISH and will is cleared before amqtt sees it (messages are still delivered live),
  and presence comes from the plugin instead;
- `Broker._run_broadcast` iterates the subscription table while awaiting the ACL plugin, so a
  subscription added or removed meanwhile (a device connecting) raises "dictionary changed size
  during iteration" and loses that message. The table is replaced by a dict whose iteration is a
  snapshot.

The listening socket is ours (amqtt's "external" listener), so the port may be 0 (ephemeral)
and the number of connections is bounded.
"""

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self
from urllib.parse import quote

import structlog
from amqtt.adapters import ReaderAdapter, StreamReaderAdapter, StreamWriterAdapter
from amqtt.broker import Broker, BrokerContext, RetainedApplicationMessage
from amqtt.contexts import Action, BaseContext, BrokerConfig, ListenerConfig, ListenerType
from amqtt.errors import AMQTTError, CodecError, MQTTError, NoDataError
from amqtt.mqtt.connack import ConnackPacket
from amqtt.mqtt.connect import ConnectPacket
from amqtt.mqtt.packet import CONNECT
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.mqtt.publish import PublishPacket
from amqtt.plugins.base import BaseAuthPlugin, BasePlugin, BaseTopicPlugin
from amqtt.session import Session

from backend.errors import BridgeError
from backend.logs import EventBudget
from backend.transports.mqtt_credentials import BridgeAccount, CredentialProvider
from backend.transports.mqtt_topics import (
    DEFAULT_PREFIX,
    Presence,
    TopicError,
    TopicKind,
    TopicScheme,
    is_stock_client_id,
    parse_client_id,
    validate_device_key,
)

log = structlog.get_logger("transport.mqtt_broker")

_ROLE = "esp32bridge.role"
_KEY = "esp32bridge.device_key"
_CLIENT = "esp32bridge.client_uuid"
_SEEN = "esp32bridge.last_seen"
_BRIDGE = "bridge"
_DEVICE = "device"


class BrokerStartError(BridgeError):
    """The embedded broker could not start (port taken, bad settings)."""


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    host: str = "0.0.0.0"
    port: int = 1883
    topic_prefix: str = DEFAULT_PREFIX
    max_connections: int = 10_000
    # Disconnect a client silent for this many times its keepalive (MQTT 3.1.1 §3.1.2.10).
    keepalive_grace: float = 1.5
    keepalive_check_s: float = 1.0
    # The accept gate: a client's first packet must be a CONNECT of at most this many bytes,
    # complete within this many seconds of the TCP connection.
    connect_timeout_s: float = 10.0
    max_connect_bytes: int = 65_536


NOT_AUTHORIZED = 5  # CONNACK return codes (MQTT 3.1.1 §3.2.2.3)
BAD_USERNAME_PASSWORD = 4


@dataclass(frozen=True, slots=True)
class Login:
    """The decision on one CONNECT's login (`_Policy.decide`)."""

    role: str | None  # _BRIDGE or _DEVICE; None: refused
    device_key: str | None = None
    client_uuid: str | None = None  # of a stock client id
    reason: str = ""  # why it was refused
    return_code: int = 0  # the CONNACK return code of a refusal

    @classmethod
    def refused(cls, reason: str, return_code: int) -> "Login":
        return cls(None, reason=reason, return_code=return_code)


@dataclass
class _Policy:
    """What the plugins decide with; shared by the three of them (handed over in their Config)."""

    scheme: TopicScheme
    credentials: CredentialProvider
    bridge: BridgeAccount
    counters: dict[str, int] = field(default_factory=dict)
    # device key -> {MQTT client id: client uuid of the stock convention, if any}
    online: dict[str, dict[str, str | None]] = field(default_factory=dict)
    refusals: EventBudget = field(default_factory=lambda: EventBudget(log, "mqtt client refused"))
    denials: EventBudget = field(
        default_factory=lambda: EventBudget(log, "mqtt topic access denied")
    )

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    # -- authentication --

    def decide(self, username: str | None, password: str | None, client_id: str | None) -> Login:
        """Whether a CONNECT with this login may in: one decision, no side effects (nothing
        counted or logged, no session touched). The accept gate and the auth plugin both ask."""
        if not username:
            return Login.refused("no username", NOT_AUTHORIZED)
        password = password or ""
        if username == self.bridge.username:
            if not hmac.compare_digest(password.encode(), self.bridge.password.encode()):
                return Login.refused("bad bridge password", BAD_USERNAME_PASSWORD)
            return Login(_BRIDGE)  # the bridge's own account may use any client id
        try:
            validate_device_key(username)
        except TopicError:
            return Login.refused("username is not a device key", BAD_USERNAME_PASSWORD)
        # A device uses its key or a stock id naming its key: never another client's id, which
        # would take over (or, for amqtt, even delete) that client's session.
        client_uuid: str | None = None
        client_id = client_id or ""
        if is_stock_client_id(client_id):
            try:
                stock = parse_client_id(client_id)
            except TopicError:
                return Login.refused("malformed GID@@@device@@@uuid client id", NOT_AUTHORIZED)
            if stock.device_key != username:
                return Login.refused("client id names another device", NOT_AUTHORIZED)
            client_uuid = stock.client_id
        elif client_id != username:
            return Login.refused("client id names another device", NOT_AUTHORIZED)
        if not self.credentials.verify(username, password):
            return Login.refused("bad device credentials", BAD_USERNAME_PASSWORD)
        return Login(_DEVICE, username, client_uuid)

    def authenticate(self, session: Session) -> bool:
        """The auth plugin's check of a session amqtt built from an already admitted CONNECT."""
        login = self.decide(session.username, session.password, session.client_id)
        if login.role is None:
            session.attributes.pop(_ROLE, None)
            self.refused(login, session.username, session.remote_address)
            return False
        session.attributes[_ROLE] = login.role
        if login.role == _BRIDGE:
            self.count("bridge_logins")
            return True
        session.will_retain = False  # no retention on this broker (module docstring)
        session.attributes[_KEY] = login.device_key
        session.attributes[_CLIENT] = login.client_uuid
        self.count("device_logins")
        return True

    def refused(self, login: Login, username: str | None, remote: str | None) -> None:
        """Count and log one refused CONNECT (within the `refusals` budget; never a password)."""
        self.count("logins_refused")
        self.refusals.hit(login.reason, username=_clip(username), remote=remote)

    def dropped(self, counter: str, reason: str, remote: str | None) -> None:
        """Count and log a connection dropped before any login (no CONNECT, or a bad one)."""
        self.count(counter)
        self.refusals.hit(reason, username=None, remote=remote)

    # -- topic access --

    def allowed(self, session: Session | None, topic: str | None, action: Action | None) -> bool:
        if session is None or topic is None or action is None:
            return False
        role = session.attributes.get(_ROLE)
        if role == _BRIDGE:
            return True
        key = session.attributes.get(_KEY)
        if role != _DEVICE or not isinstance(key, str):
            return self._deny("unauthenticated", None, topic, action)
        if action == Action.PUBLISH:
            ok = self.scheme.is_own(key, topic, TopicKind.UP, TopicKind.STATUS)
        else:  # SUBSCRIBE (a filter: exact match, no wildcards) or RECEIVE
            ok = topic == self.scheme.down(key)
        return ok or self._deny("not its own topic", key, topic, action)

    def _deny(self, reason: str, key: str | None, topic: str, action: Action) -> bool:
        self.count(f"denied_{action.value}")
        self.denials.hit(f"{key}:{action.value}", device_key=key, why=reason, topic=_clip(topic))
        return False


def _policy_of(config: object) -> _Policy:
    policy = getattr(config, "policy", None)
    if not isinstance(policy, _Policy):
        raise BrokerStartError("bridge broker plugin loaded without its policy")
    return policy


class DeviceAuthPlugin(BaseAuthPlugin):
    """amqtt authentication plugin: the bridge account or a device credential."""

    @dataclass
    class Config:
        policy: object = None

    def __init__(self, context: BaseContext) -> None:
        super().__init__(context)
        self._policy = _policy_of(self.context.config)

    async def authenticate(self, *, session: Session) -> bool | None:
        return self._policy.authenticate(session)


class DeviceTopicPlugin(BaseTopicPlugin):
    """amqtt topic plugin: each device only on its own topics."""

    @dataclass
    class Config:
        policy: object = None

    def __init__(self, context: BaseContext) -> None:
        super().__init__(context)
        self._policy = _policy_of(self.context.config)

    async def topic_filtering(
        self,
        *,
        session: Session | None = None,
        topic: str | None = None,
        action: Action | None = None,
    ) -> bool | None:
        return self._policy.allowed(session, topic, action)


class DevicePresencePlugin(BasePlugin[BrokerContext]):
    """Server-side downlink subscription and presence on connect/disconnect; packet times."""

    @dataclass
    class Config:
        policy: object = None

    def __init__(self, context: BrokerContext) -> None:
        super().__init__(context)
        self._policy = _policy_of(self.context.config)

    async def on_broker_client_connected(self, *, client_id: str, client_session: Session) -> None:
        client_session.attributes[_SEEN] = time.monotonic()
        if client_session.attributes.get(_ROLE) != _DEVICE:
            return
        key = client_session.attributes[_KEY]
        # Both steps below run before this task first yields, and it was scheduled before amqtt
        # starts reading the client's packets: the downlink subscription exists before the bridge
        # hears `online`, and `online` is queued before anything the device publishes.
        self._subscribe(client_session, self._policy.scheme.down(key))
        clients = self._policy.online.setdefault(key, {})
        first = not clients
        clients[client_id] = client_session.attributes.get(_CLIENT)
        if first:
            await self._publish_status(key, Presence(True, clients[client_id]))
        log.info("device connected to broker", device_key=key, remote=client_session.remote_address)

    def _subscribe(self, session: Session, topic: str) -> None:
        """Subscribe a session at QoS 1 without yielding (amqtt's own call awaits its ACL)."""
        subscribers = self.context.subscriptions.setdefault(topic, [])
        if all(existing.client_id != session.client_id for existing, _qos in subscribers):
            subscribers.append((session, 1))

    async def on_broker_client_disconnected(
        self, *, client_id: str, client_session: Session
    ) -> None:
        if client_session.attributes.get(_ROLE) != _DEVICE:
            return
        key = client_session.attributes[_KEY]
        current = self.context.get_session(client_id)
        if current is not None and current is not client_session and _connected(current):
            return  # taken over by a newer connection with the same client id
        clients = self._policy.online.get(key, {})
        clients.pop(client_id, None)
        if not clients:
            self._policy.online.pop(key, None)
            await self._publish_status(key, Presence(False))
        log.info("device disconnected from broker", device_key=key)

    async def on_mqtt_packet_received(
        self, *, packet: object, session: Session | None = None
    ) -> None:
        # Runs before amqtt handles the packet (its task is scheduled first), so clearing the
        # retain flag here means the message is delivered live but never stored.
        if isinstance(packet, PublishPacket) and packet.retain_flag:
            packet.retain_flag = False
            self._policy.count("retain_flags_cleared")
        if session is not None:
            session.attributes[_SEEN] = time.monotonic()

    async def on_broker_client_subscribed(self, *, client_id: str, topic: str, qos: int) -> None:
        session = self.context.get_session(client_id)
        if session is None or session.attributes.get(_ROLE) != _BRIDGE:
            return
        if topic not in (
            self._policy.scheme.filter(TopicKind.STATUS),
            self._policy.scheme.all_topics,
        ):
            return
        for key, clients in list(self._policy.online.items()):
            client_uuid = next(iter(clients.values()), None)
            await self._publish_status(key, Presence(True, client_uuid))

    async def on_broker_retained_message(
        self, *, client_id: str | None, retained_message: RetainedApplicationMessage
    ) -> None:
        # No retention on this broker (see the module docstring): drop what was just stored.
        self.context.retained_messages.pop(retained_message.topic, None)

    async def _publish_status(self, key: str, presence: Presence) -> None:
        topic = self._policy.scheme.status(key)
        await self.context.broadcast_message(topic, presence.encode(), 1)
        self._policy.count("presence_online" if presence.online else "presence_offline")


class _SnapshotDict(dict[str, list[tuple[Session, int]]]):
    """amqtt's subscription table, iterated over a copy so that it may change meanwhile."""

    def __iter__(self) -> Iterator[str]:
        return iter(list(super().keys()))

    def items(self) -> list[tuple[str, list[tuple[Session, int]]]]:  # type: ignore[override]
        return list(super().items())


def _connected(session: Session) -> bool:
    return bool(session.transitions.state == "connected")


def _clip(value: str | None, limit: int = 64) -> str | None:
    if value is None or len(value) <= limit:
        return value
    return value[:limit] + "…"


class EmbeddedBroker:
    """The amqtt broker with the bridge's plugins, on our own listening socket."""

    def __init__(
        self,
        settings: BrokerSettings,
        credentials: CredentialProvider,
        bridge: BridgeAccount | None = None,
    ) -> None:
        self.settings = settings
        self.bridge = bridge or BridgeAccount()
        self._policy = _Policy(TopicScheme(settings.topic_prefix), credentials, self.bridge)
        self._broker: Broker | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._port = settings.port

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def scheme(self) -> TopicScheme:
        return self._policy.scheme

    def bridge_url(self, host: str | None = None) -> str:
        """`mqtt://user:password@host:port` for the bridge's own client (a secret: never log it)."""
        target = host or _reachable(self.settings.host)
        if ":" in target:
            target = f"[{target}]"
        user, password = quote(self.bridge.username, safe=""), quote(self.bridge.password, safe="")
        return f"mqtt://{user}:{password}@{target}:{self._port}"

    def stats(self) -> dict[str, int]:
        return {
            **self._policy.counters,
            "connections": len(self._connections),
            "devices_online": len(self._policy.online),
        }

    def online_devices(self) -> list[str]:
        """Device keys with at least one live connection."""
        return sorted(self._policy.online)

    async def start(self) -> None:
        if self._server is not None:
            return
        _quiet_amqtt_logs()
        plugin_config = {"policy": self._policy}
        module = __name__
        config = BrokerConfig(
            listeners={"default": ListenerConfig(type=ListenerType.EXTERNAL)},
            plugins={
                f"{module}.DeviceAuthPlugin": plugin_config,
                f"{module}.DeviceTopicPlugin": plugin_config,
                f"{module}.DevicePresencePlugin": plugin_config,
            },
        )
        self._policy.online.clear()
        broker = Broker(config)
        broker._subscriptions = _SnapshotDict()  # see the module docstring
        await broker.start()
        try:
            self._server = await asyncio.start_server(
                self._accept, self.settings.host, self.settings.port, reuse_address=True
            )
        except OSError as exc:
            await broker.shutdown()
            raise BrokerStartError(
                f"cannot listen on {self.settings.host}:{self.settings.port}: {exc}"
            ) from None
        self._broker = broker
        self._port = self._server.sockets[0].getsockname()[1]
        self._watchdog = asyncio.create_task(self._keepalive_watchdog())
        log.info("embedded mqtt broker listening", host=self.settings.host, port=self._port)

    async def stop(self) -> None:
        """Stop listening, drop every client, shut amqtt down."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        broker, self._broker = self._broker, None
        if broker is not None:
            await broker.shutdown()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()
        self._policy.online.clear()
        log.info("embedded mqtt broker stopped", port=self._port)

    async def disconnect_device(self, device_key: str) -> bool:
        """Drop every connection of one device (its will and offline presence follow)."""
        found = False
        for session, handler in self._live():
            if session.attributes.get(_KEY) == device_key:
                await handler.handle_connection_closed()
                found = True
        return found

    # -- internals --

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        broker = self._broker
        if broker is None or len(self._connections) >= self.settings.max_connections:
            self._policy.count("connections_refused_limit")
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            connect = await self._admit(reader, writer)
            if connect is not None:
                await broker.external_connected(
                    _ReplayReader(reader, connect), StreamWriterAdapter(writer), "default"
                )
        except (asyncio.CancelledError, ConnectionError):
            pass
        except Exception as exc:  # amqtt raising on one client must not end the listener
            log.warning("mqtt client handling failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            self._connections.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _admit(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bytes | None:
        """Read and decide the client's CONNECT before amqtt sees anything of the connection.

        amqtt 0.12.1 deletes (clean session) or takes over (no clean session) the existing
        session of the CONNECT's client id before it asks the auth plugin: a refused client
        would still cut the device it names off its downlink. So only a CONNECT whose login
        `_Policy.decide` accepts reaches amqtt, whose plugin then decides the same again.
        Returns the CONNECT's bytes to replay to amqtt, or None when the connection is done.
        """
        peer = writer.get_extra_info("peername")
        remote = str(peer[0]) if isinstance(peer, tuple) and peer else None
        try:
            async with asyncio.timeout(self.settings.connect_timeout_s):
                raw = await _read_connect(reader, self.settings.max_connect_bytes)
        except TimeoutError:
            self._policy.dropped("connect_timeouts", "no CONNECT in time", remote)
            return None
        except asyncio.IncompleteReadError:
            return None  # gone before a whole packet (a port probe): nothing to say
        except _BadConnect as exc:
            self._policy.dropped("connects_malformed", str(exc), remote)
            return None
        try:
            connect = await _parse_connect(raw)
        except _BadConnect as exc:
            self._policy.dropped("connects_malformed", str(exc), remote)
            return None
        payload = connect.payload
        assert payload is not None  # _parse_connect made sure
        client_id = "" if payload.client_id_is_random else payload.client_id
        login = self._policy.decide(payload.username, payload.password, client_id)
        if login.role is None:
            self._policy.refused(login, payload.username, remote)
            writer.write(ConnackPacket.build(0, login.return_code).to_bytes())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.connect_timeout_s):
                    await writer.drain()
            return None
        return raw

    def _live(self) -> Iterator[tuple[Session, BrokerProtocolHandler]]:
        broker = self._broker
        if broker is None:
            return
        for session, handler in list(broker.sessions.values()):
            if _connected(session):
                yield session, handler

    async def _keepalive_watchdog(self) -> None:
        grace = self.settings.keepalive_grace
        while True:
            await asyncio.sleep(self.settings.keepalive_check_s)
            now = time.monotonic()
            for session, handler in self._live():
                seen = session.attributes.get(_SEEN)
                if not session.keep_alive or not isinstance(seen, float):
                    continue
                if now - seen > grace * session.keep_alive:
                    self._policy.count("keepalive_expired")
                    log.info(
                        "mqtt keepalive expired",
                        device_key=session.attributes.get(_KEY),
                        keepalive_s=session.keep_alive,
                    )
                    session.attributes[_SEEN] = now  # once per expiry
                    await handler.handle_connection_closed()


class _BadConnect(Exception):
    """The first packet is not a well-formed CONNECT (the message is the logged reason)."""


async def _read_connect(reader: asyncio.StreamReader, limit: int) -> bytes:
    """The client's first packet, whole: fixed header, then exactly its remaining length."""
    header = bytearray(await reader.readexactly(1))
    if header[0] >> 4 != CONNECT:
        raise _BadConnect("first packet is not CONNECT")
    if header[0] & 0x0F:
        raise _BadConnect("malformed CONNECT (reserved flags)")
    length = 0
    for shift in (0, 7, 14, 21):  # the remaining length takes at most four bytes
        byte = (await reader.readexactly(1))[0]
        header.append(byte)
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
    else:
        raise _BadConnect("malformed CONNECT (remaining length)")
    if len(header) + length > limit:
        raise _BadConnect("CONNECT too large")
    return bytes(header) + await reader.readexactly(length)


class _PacketBytes(ReaderAdapter):
    """One packet's bytes for amqtt's parser; remembers a read past their end."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._at = 0
        self.overrun = False

    async def read(self, n: int = -1) -> bytes:
        end = len(self._data) if n < 0 else self._at + n
        chunk = self._data[self._at : end]
        self.overrun |= len(chunk) < end - self._at
        self._at += len(chunk)
        return chunk

    def feed_eof(self) -> None:
        pass

    @property
    def left(self) -> int:
        return len(self._data) - self._at


async def _parse_connect(raw: bytes) -> ConnectPacket:
    """amqtt's own CONNECT parser over exactly these bytes, which it must use up exactly.

    amqtt's parser turns a missing client id, username or password into None instead of
    failing, and it will read the same bytes again from the connection: a CONNECT that
    parsed only with bytes beyond its length (or left some over) is refused, so both parses
    of an admitted CONNECT see the same fields.
    """
    data = _PacketBytes(raw)
    try:
        connect = await ConnectPacket.from_stream(data)
    except (AMQTTError, MQTTError, NoDataError, CodecError, ValueError) as exc:
        raise _BadConnect("malformed CONNECT") from exc
    if data.overrun or data.left or connect.variable_header is None or connect.payload is None:
        raise _BadConnect("malformed CONNECT")
    return connect


class _ReplayReader(StreamReaderAdapter):
    """amqtt's reader adapter for the connection, which first hands back the CONNECT's bytes
    that the gate already read; the bytes after it are still in the stream."""

    def __init__(self, reader: asyncio.StreamReader, replay: bytes) -> None:
        super().__init__(reader)
        self._replay = bytearray(replay)

    async def read(self, n: int = -1) -> bytes:
        if not self._replay:
            return await super().read(n)
        if n < 0:
            head = bytes(self._replay)
            self._replay.clear()
            return head + await super().read(n)
        head = bytes(self._replay[:n])
        del self._replay[:n]
        if len(head) < n:
            head += await super().read(n - len(head))
        return head


def _reachable(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)


def _quiet_amqtt_logs() -> None:
    # amqtt logs every connection at INFO and `transitions` every state change; keep warnings.
    for name in ("amqtt", "transitions"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)
