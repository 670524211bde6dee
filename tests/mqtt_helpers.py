"""Pieces shared by the MQTT transport tests: a recording LinkAcceptor, brokers, devices."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from backend.protocol.audio import AudioFrame
from backend.transports.admission import Admission
from backend.transports.base import DeviceLink
from backend.transports.mqtt import BrokerVouched, MqttSettings, MqttTransport
from backend.transports.mqtt_credentials import CredentialTable
from backend.transports.mqtt_topics import TopicScheme
from testkit.mosquitto import Mosquitto
from tests.mqtt_wire import RawMqttClient

PREFIX = "xiaozhi"
SCHEME = TopicScheme(PREFIX)
DEVICE_A = "a4_cf_12_34_56_78"
DEVICE_B = "a4_cf_12_34_56_79"
ID_A = "a4:cf:12:34:56:78"
ID_B = "a4:cf:12:34:56:79"
PASSWORDS = {DEVICE_A: "password-of-device-a", DEVICE_B: "password-of-device-b"}


@dataclass
class RecordingHandler:
    """What a session would receive for one link."""

    link: DeviceLink
    texts: list[str] = field(default_factory=list)
    audio: list[AudioFrame] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)
    gate: asyncio.Event | None = None  # when set, on_text waits for it (a slow session)

    async def on_text(self, text: str) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.texts.append(text)

    def on_audio(self, frame: AudioFrame) -> None:
        self.audio.append(frame)

    def on_discarded(self, size: int) -> None:
        self.discarded.append(size)

    def on_closed(self, reason: str) -> None:
        self.closed.append(reason)


class RecordingAcceptor:
    """A LinkAcceptor that records every link and what was delivered on it."""

    def __init__(self) -> None:
        self.handlers: list[RecordingHandler] = []
        self.gates: dict[str, asyncio.Event] = {}

    def open_link(self, link: DeviceLink) -> RecordingHandler:
        handler = RecordingHandler(link, gate=self.gates.get(link.identity.device_id))
        self.handlers.append(handler)
        return handler

    def of(self, device_id: str) -> list[RecordingHandler]:
        return [h for h in self.handlers if h.link.identity.device_id == device_id]

    def latest(self, device_id: str) -> RecordingHandler:
        found = self.of(device_id)
        assert found, f"no link for {device_id}"
        return found[-1]

    def open_count(self, device_id: str) -> int:
        return sum(1 for h in self.of(device_id) if not h.closed)


class BrokerUnderTest(Protocol):
    kind: str

    @property
    def port(self) -> int: ...
    @property
    def bridge_url(self) -> str: ...

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def crash(self) -> None: ...


@dataclass
class MosquittoUnderTest:
    broker: Mosquitto
    kind: str = "mosquitto"

    @property
    def port(self) -> int:
        return self.broker.port

    @property
    def bridge_url(self) -> str:
        return self.broker.bridge_url

    async def start(self) -> None:
        await self.broker.start()

    async def stop(self) -> None:
        await self.broker.stop()

    async def crash(self) -> None:
        await self.broker.kill()


def device_table() -> CredentialTable:
    table = CredentialTable()
    for key, password in PASSWORDS.items():
        table.set(key, password)
    return table


@contextlib.asynccontextmanager
async def broker_of_kind(kind: str, workdir: Path) -> AsyncIterator[BrokerUnderTest]:
    """A real broker for the bridge's MQTT client (Mosquitto: the embedded endpoint is not one)."""
    assert kind == "mosquitto", kind
    mosquitto = Mosquitto(workdir, PASSWORDS, prefix=PREFIX)
    await mosquitto.start()
    try:
        yield MosquittoUnderTest(mosquitto)
    finally:
        await mosquitto.stop()


def transport_settings(url: str, **overrides: object) -> MqttSettings:
    values: dict[str, object] = {
        "broker_url": url,
        "client_id": "bridge-under-test",
        "topic_prefix": PREFIX,
        "udp_host": "127.0.0.1",
        "udp_port": 0,
        "reconnect_min_s": 0.1,
        "reconnect_max_s": 1.0,
        "keepalive_s": 5,
    }
    values.update(overrides)
    return MqttSettings(**values)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running_transport(
    url: str, acceptor: RecordingAcceptor, **overrides: object
) -> AsyncIterator[MqttTransport]:
    transport = MqttTransport(transport_settings(url, **overrides), Admission(BrokerVouched()))
    await transport.start(acceptor)
    try:
        await transport.wait_connected(10)
        yield transport
    finally:
        await transport.stop()


@contextlib.asynccontextmanager
async def device(
    port: int,
    key: str,
    *,
    password: str | None = None,
    client_id: str | None = None,
    will: bool = True,
    online: bool = True,
    subscribe: bool = True,
    keepalive: int = 60,
) -> AsyncIterator[RawMqttClient]:
    """A device client: our firmware's behaviour by default (will, retained online, own
    subscription); `will=False, online=False, subscribe=False` is stock firmware."""
    client = RawMqttClient("127.0.0.1", port)
    status = SCHEME.status(key)
    await client.connect(
        client_id or f"GID_test@@@{key}@@@0b1c2d3e-uuid",
        key,
        PASSWORDS[key] if password is None else password,
        keepalive=keepalive,
        will=(status, b"offline", 1, True) if will else None,
    )
    if subscribe:
        codes = await client.subscribe(SCHEME.down(key))
        assert codes == [1], codes
    if online:
        await client.publish(status, b"online", qos=1, retain=True)
    try:
        yield client
    finally:
        await client.abort()


async def eventually(check: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll `check` until it holds (no fixed sleeps); fails with `what` after the deadline."""
    try:
        async with asyncio.timeout(timeout_s):
            while not check():  # noqa: ASYNC110 - nothing to wait on but the condition
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s:g} s: {what}") from None
