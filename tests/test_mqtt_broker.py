"""The embedded broker's CONNECT gate: every login is decided on our accept layer, before amqtt
sees a byte, and a device may use only its own client id.

amqtt 0.12.1 deletes (clean session) or takes over (no clean session) the existing session of a
client id before it authenticates the CONNECT: without the gate, anyone who knows a device's
client id would cut it off from its downlink while it stays TCP-connected and looks online.
Real sockets against the embedded broker, started as the other MQTT tests start it."""

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest

from backend.logs import EventBudget
from backend.transports.mqtt_broker import BrokerSettings, EmbeddedBroker
from backend.transports.mqtt_credentials import BridgeAccount
from backend.transports.mqtt_topics import TopicKind
from tests.mosquitto import free_port
from tests.mqtt_helpers import (
    DEVICE_A,
    DEVICE_B,
    PASSWORDS,
    PREFIX,
    SCHEME,
    device,
    device_table,
    eventually,
)
from tests.mqtt_wire import CONNACK, CONNECT, MqttRefused, RawMqttClient, packet

NOT_AUTHORIZED, BAD_LOGIN = 5, 4
STOCK_A = f"GID_test@@@{DEVICE_A}@@@0b1c2d3e-uuid"
STOCK_B = f"GID_test@@@{DEVICE_B}@@@0b1c2d3e-uuid"


@pytest.fixture
async def broker() -> AsyncIterator[EmbeddedBroker]:
    running = EmbeddedBroker(
        BrokerSettings(
            host="127.0.0.1", port=free_port(), topic_prefix=PREFIX, connect_timeout_s=0.5
        ),
        device_table(),
        BridgeAccount(),
    )
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture
async def bridge_side(broker: EmbeddedBroker) -> AsyncIterator[RawMqttClient]:
    client = RawMqttClient("127.0.0.1", broker.port)
    await client.connect("bridge-under-test", broker.bridge.username, broker.bridge.password)
    try:
        yield client
    finally:
        await client.disconnect()


_markers = iter(range(1_000_000))


async def still_receives(bridge_side: RawMqttClient, key: str, *victims: RawMqttClient) -> None:
    """The bridge's QoS 1 downlink reaches each of the device's connections (through whatever
    subscription it has: its own or the broker's server-side one)."""
    marker = f'{{"type":"mcp","to":"{key}","n":{next(_markers)}}}'.encode()
    await bridge_side.publish(SCHEME.down(key), marker, qos=1)
    for victim in victims:
        got = await victim.next_publish(5)
        assert (got.topic, got.payload) == (SCHEME.down(key), marker)
        assert victim.publishes.empty() and not victim.closed.is_set()


async def refused(
    port: int,
    client_id: str,
    username: str | None,
    password: str | None,
    *,
    clean_session: bool,
) -> int:
    """CONNECT, expect a refusal; the broker then closes the connection. The return code."""
    attacker = RawMqttClient("127.0.0.1", port)
    with pytest.raises(MqttRefused) as caught:
        await attacker.connect(client_id, username, password, clean_session=clean_session)
    assert attacker.reader is not None
    assert await asyncio.wait_for(attacker.reader.read(), 5) == b""  # closed after the CONNACK
    await attacker.abort()
    return caught.value.code


# ---- (a) nobody can cut a device off without its login -----------------------------------------


@pytest.mark.parametrize("clean_session", [True, False], ids=["clean", "persistent"])
@pytest.mark.parametrize("stock", [True, False], ids=["stock", "ours"])
async def test_an_unauthenticated_connect_with_a_live_client_id_changes_nothing(
    broker: EmbeddedBroker, bridge_side: RawMqttClient, clean_session: bool, stock: bool
) -> None:
    # Stock firmware relies on the broker's server-side subscription, ours on its own: amqtt's
    # session deletion (clean) or take-over (persistent) used to drop either.
    client_id = STOCK_A if stock else DEVICE_A
    async with device(
        broker.port,
        DEVICE_A,
        client_id=client_id,
        will=not stock,
        online=False,
        subscribe=not stock,
    ) as victim:
        await still_receives(bridge_side, DEVICE_A, victim)
        attempts = [
            (None, None),  # no login at all
            (DEVICE_A, "not the password"),
            (DEVICE_A, None),
            (broker.bridge.username, "not the bridge password"),
        ]
        codes = [
            await refused(broker.port, client_id, user, pw, clean_session=clean_session)
            for user, pw in attempts
        ]
        assert codes == [NOT_AUTHORIZED, BAD_LOGIN, BAD_LOGIN, BAD_LOGIN]
        await still_receives(bridge_side, DEVICE_A, victim)
        assert broker.online_devices() == [DEVICE_A]
    stats = broker.stats()
    assert stats["logins_refused"] == len(attempts)
    assert stats["device_logins"] == 1 and stats["bridge_logins"] == 1


@pytest.mark.parametrize("clean_session", [True, False], ids=["clean", "persistent"])
async def test_nobody_but_the_bridge_can_use_the_bridges_client_id(
    broker: EmbeddedBroker, bridge_side: RawMqttClient, clean_session: bool
) -> None:
    # amqtt would have dropped the bridge's subscriptions (clean) or taken its session over.
    assert await bridge_side.subscribe(SCHEME.filter(TopicKind.UP)) == [1]
    async with device(broker.port, DEVICE_A) as dev:
        for username, password in [(None, None), (DEVICE_A, PASSWORDS[DEVICE_A])]:
            code = await refused(
                broker.port, "bridge-under-test", username, password, clean_session=clean_session
            )
            assert code == NOT_AUTHORIZED
        await dev.publish(SCHEME.up(DEVICE_A), b'{"type":"mcp"}', qos=1)
        got = await bridge_side.next_publish(5)
        assert (got.topic, got.payload) == (SCHEME.up(DEVICE_A), b'{"type":"mcp"}')


# ---- (b) a device may use only its own client id -----------------------------------------------


@pytest.mark.parametrize("clean_session", [True, False], ids=["clean", "persistent"])
async def test_a_device_with_its_own_login_cannot_use_another_devices_client_id(
    broker: EmbeddedBroker, bridge_side: RawMqttClient, clean_session: bool
) -> None:
    async with (
        device(broker.port, DEVICE_B, client_id=DEVICE_B) as ours_b,
        device(
            broker.port, DEVICE_B, client_id=STOCK_B, will=False, online=False, subscribe=False
        ) as stock_b,
    ):
        await still_receives(bridge_side, DEVICE_B, ours_b, stock_b)
        for client_id in (DEVICE_B, STOCK_B, "any-client-id", "", f"GID_t@@@{DEVICE_A}@@@x@@@y"):
            code = await refused(
                broker.port,
                client_id,
                DEVICE_A,
                PASSWORDS[DEVICE_A],
                clean_session=clean_session,
            )
            assert code == NOT_AUTHORIZED, client_id
        await still_receives(bridge_side, DEVICE_B, ours_b, stock_b)
        assert broker.online_devices() == [DEVICE_B]
    assert broker.stats()["logins_refused"] == 5


async def test_own_client_ids_are_accepted_and_the_bridge_keeps_any(broker: EmbeddedBroker) -> None:
    # What our firmware (the device key), stock firmware and an OTA answer
    # (GID_xiaozhi@@@<key>@@@<uuid>) use; the bridge's own account may name itself freely.
    logins = [
        (DEVICE_A, DEVICE_A, PASSWORDS[DEVICE_A]),
        (STOCK_A, DEVICE_A, PASSWORDS[DEVICE_A]),
        (
            f"GID_xiaozhi@@@{DEVICE_A}@@@6c4a5a2e-2f0e-4a4e-9d59-3b2d1c0e9f11",
            DEVICE_A,
            PASSWORDS[DEVICE_A],
        ),
        ("esp32-mcp-bridge", broker.bridge.username, broker.bridge.password),
        (STOCK_B, broker.bridge.username, broker.bridge.password),
        ("", broker.bridge.username, broker.bridge.password),
    ]
    for client_id, username, password in logins:
        client = RawMqttClient("127.0.0.1", broker.port)
        await client.connect(client_id, username, password)
        await client.disconnect()
    stats = broker.stats()
    assert (stats["device_logins"], stats["bridge_logins"]) == (3, 3)
    assert stats.get("logins_refused", 0) == 0


# ---- (c) counted and logged once per attempt, within the budget --------------------------------


class _Lines:
    """A logger that keeps what it is asked to write (no global structlog state involved)."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})


async def test_each_refusal_is_counted_and_logged_once_within_the_budget(
    broker: EmbeddedBroker,
) -> None:
    logs = _Lines()
    broker._policy.refusals = EventBudget(logs, "mqtt client refused")
    for _ in range(5):
        code = await refused(broker.port, STOCK_A, DEVICE_A, "wrong", clean_session=True)
        assert code == BAD_LOGIN
    code = await refused(broker.port, DEVICE_B, DEVICE_A, PASSWORDS[DEVICE_A], clean_session=True)
    assert code == NOT_AUTHORIZED
    assert broker._policy.refusals.count("bad device credentials") == 5
    lines = [line for line in logs.lines if line["event"] == "mqtt client refused"]
    bad = [line for line in lines if line["reason"] == "bad device credentials"]
    # EventBudget: the first three of one reason are written, the rest go into a summary.
    assert [line["count"] for line in bad] == [1, 2, 3]
    assert all(line["username"] == DEVICE_A and line["remote"] == "127.0.0.1" for line in bad)
    other = [line for line in lines if line["reason"] == "client id names another device"]
    assert len(other) == 1 and len(lines) == 4
    assert "wrong" not in repr(logs.lines) and PASSWORDS[DEVICE_A] not in repr(logs.lines)
    assert broker.stats()["logins_refused"] == 6
    assert broker.stats().get("device_logins", 0) == 0


# ---- the gate itself: what reaches amqtt, and how ----------------------------------------------


def _connect_body(client_id: str, username: str, password: str) -> bytes:
    def string(value: str) -> bytes:
        return struct.pack(">H", len(value.encode())) + value.encode()

    header = string("MQTT") + bytes([4, 0xC2]) + struct.pack(">H", 60)
    return header + string(client_id) + string(username) + string(password)


def _connect_bytes(client_id: str, username: str, password: str) -> bytes:
    return packet(CONNECT, 0, _connect_body(client_id, username, password))


async def _read_packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    first = (await reader.readexactly(1))[0]
    size, shift = 0, 0
    while True:
        byte = (await reader.readexactly(1))[0]
        size |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return first >> 4, await reader.readexactly(size)


async def test_a_connect_split_and_pipelined_with_a_subscribe_reaches_amqtt_intact(
    broker: EmbeddedBroker, bridge_side: RawMqttClient
) -> None:
    # The bytes the gate read are replayed to amqtt, and what follows the CONNECT in the same
    # segment (a SUBSCRIBE here) stays in the stream for it.
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.port)
    connect = _connect_bytes(DEVICE_A, DEVICE_A, PASSWORDS[DEVICE_A])
    topic = SCHEME.down(DEVICE_A).encode()
    subscribe = packet(8, 0x02, struct.pack(">HH", 7, len(topic)) + topic + b"\x01")
    for piece in (connect[:1], connect[1:9], connect[9:] + subscribe):
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.05)
    assert await asyncio.wait_for(_read_packet(reader), 5) == (CONNACK, b"\x00\x00")
    assert await asyncio.wait_for(_read_packet(reader), 5) == (9, b"\x00\x07\x01")  # SUBACK
    await bridge_side.publish(SCHEME.down(DEVICE_A), b"hi", qos=0)
    kind, data = await asyncio.wait_for(_read_packet(reader), 5)
    assert kind == 3 and data.endswith(b"hi")
    writer.close()


@pytest.mark.parametrize(
    "first_bytes",
    [
        packet(12, 0, b""),  # PINGREQ before CONNECT
        packet(CONNECT, 0x01, b"\x00\x04MQTT\x04\x02\x00\x3c\x00\x00"),  # reserved flags set
        b"\x10\xff\xff\xff\x7f",  # a CONNECT of 256 MB
        b"\x10\xff\xff\xff\xff\x01",  # remaining length longer than four bytes
        packet(CONNECT, 0, b"\x00\x04MQTT\x04\xc2\x00\x3c\x00\x01"),  # cut inside the client id
        packet(CONNECT, 0, _connect_body(DEVICE_A, DEVICE_A, PASSWORDS[DEVICE_A]) + b"xx"),
    ],
    ids=["not-connect", "reserved", "oversized", "bad-length", "short-body", "trailing"],
)
async def test_anything_but_a_whole_connect_is_dropped_before_amqtt(
    broker: EmbeddedBroker, first_bytes: bytes
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.port)
    writer.write(first_bytes)
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, no CONNACK
    writer.close()
    stats = broker.stats()
    assert stats["connects_malformed"] == 1
    assert "logins_refused" not in stats and "device_logins" not in stats


@pytest.mark.parametrize("sent", [0, 1, 5, -3], ids=["nothing", "one", "header", "truncated"])
async def test_a_client_that_never_completes_its_connect_is_dropped_after_the_timeout(
    broker: EmbeddedBroker, sent: int
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.port)
    writer.write(_connect_bytes(DEVICE_A, DEVICE_A, PASSWORDS[DEVICE_A])[:sent])
    await eventually(lambda: broker.stats()["connections"] == 1, what="accepted")
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    assert broker.stats()["connect_timeouts"] == 1
    await eventually(lambda: broker.stats()["connections"] == 0, what="released")
