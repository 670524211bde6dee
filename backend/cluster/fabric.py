"""The instances' channel over the deployment's MQTT broker (MQTT 5): presence, fleet events,
forwarded calls and their replies. It knows topics and bytes, not devices.

Topics, under `<prefix>/_cluster` (the bridge accounts' ACL already covers `<prefix>/#`, and a
device's own topics end in `up`, `down` or `status`, never in these):

    instances/<id>   retained presence: `{"state": "online", ...}`; its last will, and a clean
                     leave, clear it (an empty retained message), so the others learn at once
    dialins/<id>     retained: the MCP servers dialed in to that instance (shown fleet-wide
                     while its presence is up; a clean leave clears it)
    events           fleet events from every instance (QoS 1)
    rpc/<id>         requests to one instance: MQTT 5 `ResponseTopic` + `CorrelationData`
    reply/<id>       replies (and join snapshots) to one instance
    sync             "I joined": every instance answers with its devices on `reply/<id>`

The connection is kept up with backoff; `on_connect` runs after each (re)connect, so a node can
announce itself again after the broker was away (its will has cleared its presence meanwhile).
"""

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiomqtt
import structlog
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from backend.common import Backoff
from backend.transports.mqtt import BrokerAddress

log = structlog.get_logger("cluster")

RECONNECT_FIRST_S = 0.4  # the first wait; it doubles up to the cap
RECONNECT_MAX_S = 1.0  # a broker back is used within a second (listings agree again)
PUBLISH_TIMEOUT_S = 5.0


class FabricUnavailable(ConnectionError):
    """The broker is not reachable now."""


@dataclass(frozen=True, slots=True)
class Inbound:
    """One message for the node: which channel, from whom (instance id, when the topic says),
    its payload and the MQTT 5 request/response properties."""

    channel: str  # "presence", "dialins", "events", "rpc", "reply", "sync"
    payload: bytes
    instance: str | None = None
    response_topic: str | None = None
    correlation: bytes | None = None


class Topics:
    """The cluster's topic names for one instance."""

    def __init__(self, prefix: str, instance_id: str) -> None:
        self.base = f"{prefix}/_cluster"
        self.instance_id = instance_id

    def presence(self, instance_id: str | None = None) -> str:
        """The retained presence topic of an instance (this one by default)."""
        return f"{self.base}/instances/{instance_id or self.instance_id}"

    @property
    def events(self) -> str:
        """The fleet events topic."""
        return f"{self.base}/events"

    @property
    def ping(self) -> str:
        """Where this instance's broker probes go (nobody subscribes)."""
        return f"{self.base}/ping/{self.instance_id}"

    def rpc(self, instance_id: str) -> str:
        """The request topic of an instance."""
        return f"{self.base}/rpc/{instance_id}"

    def reply(self, instance_id: str | None = None) -> str:
        """The reply topic of an instance (this one by default)."""
        return f"{self.base}/reply/{instance_id or self.instance_id}"

    @property
    def sync(self) -> str:
        """The join topic."""
        return f"{self.base}/sync"

    def dialins(self, instance_id: str | None = None) -> str:
        """The retained list of the MCP servers dialed in to an instance (this one by default)."""
        return f"{self.base}/dialins/{instance_id or self.instance_id}"

    def subscriptions(self) -> list[tuple[str, int]]:
        """What an instance subscribes to."""
        return [
            (f"{self.base}/instances/+", 1),
            (f"{self.base}/dialins/+", 1),
            (self.events, 1),
            (self.rpc(self.instance_id), 1),
            (self.reply(), 1),
            (self.sync, 1),
        ]

    def classify(self, topic: str) -> tuple[str, str | None] | None:
        """(channel, instance named by the topic) for a topic of ours, else None."""
        if not topic.startswith(self.base + "/"):
            return None
        rest = topic[len(self.base) + 1 :].split("/")
        if rest == ["events"] or rest == ["sync"]:
            return rest[0], None
        if len(rest) == 2 and rest[0] == "instances":
            return "presence", rest[1]
        if len(rest) == 2 and rest[0] == "dialins":
            return "dialins", rest[1]
        if len(rest) == 2 and rest[0] in ("rpc", "reply") and rest[1] == self.instance_id:
            return rest[0], None
        return None


class Fabric:
    """One MQTT 5 connection for one instance."""

    def __init__(
        self,
        url: str,
        topics: Topics,
        *,
        on_message: Callable[[Inbound], None],
        on_connect: Callable[[], Awaitable[None]],
        on_disconnect: Callable[[], None],
        keepalive_s: int = 10,
        presence: bytes = b'{"state":"online"}',
    ) -> None:
        self.address = BrokerAddress.parse(url)
        self.topics = topics
        self._on_message = on_message
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._keepalive_s = keepalive_s
        self.presence = presence
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def connected(self) -> bool:
        """Whether the broker connection is up now."""
        return self._connected.is_set()

    async def wait_connected(self, timeout_s: float) -> None:
        """Until connected (TimeoutError otherwise)."""
        async with asyncio.timeout(timeout_s):
            await self._connected.wait()

    def start(self) -> None:
        """Connect in the background, and keep reconnecting."""
        self._stopping = False
        self._runner = asyncio.create_task(self._run(), name="cluster-fabric")

    async def stop(self) -> None:
        """Clear this instance's presence (a clean leave) and disconnect."""
        self._stopping = True
        if self._client is not None and self._connected.is_set():
            with contextlib.suppress(FabricUnavailable):
                await self.publish(self.topics.dialins(), b"", retain=True)
                await self.publish(self.topics.presence(), b"", retain=True)
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
            self._runner = None

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        retain: bool = False,
        response_topic: str | None = None,
        correlation: bytes | None = None,
        expiry_s: int | None = None,
        timeout_s: float = PUBLISH_TIMEOUT_S,
    ) -> None:
        """Publish at QoS 1; FabricUnavailable when the broker is not connected or does not
        acknowledge within `timeout_s`."""
        client = self._client
        if client is None or not self._connected.is_set():
            raise FabricUnavailable("cluster broker not connected")
        properties = None
        if response_topic is not None or correlation is not None or expiry_s is not None:
            properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            if response_topic is not None:
                properties.ResponseTopic = response_topic
            if correlation is not None:
                properties.CorrelationData = correlation
            if expiry_s is not None:
                properties.MessageExpiryInterval = max(1, expiry_s)
        try:
            await client.publish(
                topic, payload, qos=1, retain=retain, properties=properties,
                timeout=timeout_s,
            )  # fmt: skip
        except aiomqtt.MqttError as exc:
            raise FabricUnavailable(f"cluster broker: {exc}") from None

    async def probe(self, timeout_s: float) -> None:
        """Check that the broker still answers (a QoS 1 acknowledgement of a message nobody
        reads): a broker that stopped, or whose traffic is dropped, keeps the connection up
        until the keepalive runs out. FabricUnavailable otherwise."""
        await self.publish(self.topics.ping, b"", timeout_s=timeout_s)

    def _client_for(self) -> aiomqtt.Client:
        return self.address.client(
            f"bridge-cluster-{self.topics.instance_id}",
            keepalive_s=self._keepalive_s,
            timeout_s=PUBLISH_TIMEOUT_S,
            protocol=aiomqtt.ProtocolVersion.V5,
            will=aiomqtt.Will(self.topics.presence(), b"", qos=1, retain=True),
        )

    async def _run(self) -> None:
        backoff = Backoff(RECONNECT_FIRST_S, RECONNECT_MAX_S)
        while not self._stopping:
            try:
                async with self._client_for() as client:
                    self._client = client
                    await client.subscribe(self.topics.subscriptions())
                    await client.publish(self.topics.presence(), self.presence, qos=1, retain=True)
                    self._connected.set()
                    backoff.reset()
                    log.info("cluster broker connected", broker=self.address.redacted())
                    await self._announce()
                    async for message in client.messages:
                        self._dispatch(message)
            except aiomqtt.MqttError as exc:
                if not self._stopping:
                    log.warning("cluster broker lost", error=str(exc))
            except Exception as exc:  # never let the channel die: reconnect instead
                log.error("cluster channel failed; reconnecting", error=repr(exc))
            finally:
                was_connected = self._connected.is_set()
                self._connected.clear()
                self._client = None
                if was_connected:
                    self._on_disconnect()
            await asyncio.sleep(backoff.next_wait())

    async def _announce(self) -> None:
        try:
            await self._on_connect()
        except FabricUnavailable as exc:  # lost again at once: the next connect announces
            log.warning("cluster announce failed", error=str(exc))

    def _dispatch(self, message: aiomqtt.Message) -> None:
        found = self.topics.classify(message.topic.value)
        payload = message.payload
        if found is None or not isinstance(payload, bytes | bytearray):
            return
        channel, instance = found
        properties = message.properties
        response_topic = getattr(properties, "ResponseTopic", None)
        correlation = getattr(properties, "CorrelationData", None)
        try:
            self._on_message(
                Inbound(channel, bytes(payload), instance, response_topic, correlation)
            )
        except Exception as exc:  # one bad message never stops the channel
            log.error("cluster message handler failed", channel=channel, error=repr(exc))
