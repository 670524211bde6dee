"""The bridge's own MQTT endpoint under attack: real sockets on loopback, raw MQTT clients as
devices and attackers, a recording acceptor in place of the core (issue #16: identity is the
login, wills cannot speak for another device, nothing is routed, retained or kept, and every
bound of the WebSocket side holds here too)."""

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from backend.devices.conversation import ConversationHub
from backend.devices.gateway import DeviceGateway
from backend.devices.registry import DeviceRegistry
from backend.protocol import mqtt_packets as mp
from backend.transports.admission import Admission
from backend.transports.base import LinkAcceptor
from backend.transports.errors import LinkClosed
from backend.transports.mqtt_endpoint import DeviceLogin, EndpointSettings, MqttEndpoint
from backend.transports.throttle import ConnectionGuard, ExemptNetworks, KeyedLimiter
from backend.transports.udp import UdpAudioChannel
from testkit.settings import make_settings
from tests.mqtt_helpers import (
    DEVICE_A,
    DEVICE_B,
    ID_A,
    ID_B,
    PASSWORDS,
    SCHEME,
    RecordingAcceptor,
    device_table,
    eventually,
)
from tests.mqtt_wire import PUBLISH, MqttRefused, RawMqttClient, packet

STOCK_A = f"GID_test@@@{DEVICE_A}@@@0b1c2d3e-uuid"
PUBREC, PUBREL, PUBCOMP, PINGRESP = 5, 6, 7, 13


@contextlib.asynccontextmanager
async def endpoint(
    acceptor: LinkAcceptor,
    *,
    exempt: tuple[str, ...] = ("127.0.0.1/32",),
    guard_cap: int = 1000,
    per_address: int = 64,
    **settings: Any,
) -> AsyncIterator[MqttEndpoint]:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,  # the kernel's pick, bound at once (a probed port may be taken meanwhile)
        "topic_prefix": SCHEME.prefix,
        "connect_timeout_s": 2.0,
        "keepalive_check_s": 0.1,
    }
    values.update(settings)
    running = MqttEndpoint(
        EndpointSettings(**values),
        Admission(DeviceLogin(device_table())),
        ConnectionGuard(
            guard_cap,
            KeyedLimiter(1000, 1000),
            exempt=ExemptNetworks(exempt),
            max_pending_per_address=per_address,
        ),
        udp=UdpAudioChannel("127.0.0.1", 0),
    )
    await running.start(acceptor)
    try:
        yield running
    finally:
        await running.stop()


@contextlib.asynccontextmanager
async def connected(
    port: int, key: str, *, client_id: str | None = None, **options: Any
) -> AsyncIterator[RawMqttClient]:
    local_host = options.pop("local_host", None)
    auto_ack = options.pop("auto_ack", True)
    client = RawMqttClient("127.0.0.1", port, local_host=local_host, auto_ack=auto_ack)
    await client.connect(client_id or key, key, PASSWORDS[key], **options)
    try:
        yield client
    finally:
        await client.abort()


async def refused_code(port: int, key: str, **options: Any) -> int:
    client = RawMqttClient("127.0.0.1", port)
    password = options.pop("password", PASSWORDS.get(key, "x"))
    client_id = options.pop("client_id", key)
    try:
        await client.connect(client_id, key, password, **options)
    except MqttRefused as refused:
        return refused.code
    finally:
        await client.abort()
    raise AssertionError("the CONNECT was accepted")


# ---- identity is the login; a will cannot speak for another device ------------------------------


async def test_a_device_is_who_it_logged_in_as_and_its_downlink_reaches_it() -> None:
    acceptor = RecordingAcceptor()
    async with endpoint(acceptor) as server, connected(server.port, DEVICE_A) as device:
        await eventually(lambda: acceptor.of(ID_A) != [], what="link opened")
        link = acceptor.latest(ID_A).link
        assert link.identity.transport == "mqtt" and link.identity.device_id == ID_A
        await device.publish(SCHEME.up(DEVICE_A), '{"type":"mcp","payload":{}}', qos=1)
        await eventually(lambda: acceptor.latest(ID_A).texts != [], what="uplink delivered")
        # No subscription at all (stock firmware): the downlink still arrives, at QoS 1.
        await link.send_text('{"type":"mcp","n":1}')
        got = await device.next_publish(5)
        assert (got.topic, got.payload, got.qos) == (
            SCHEME.down(DEVICE_A),
            b'{"type":"mcp","n":1}',
            1,
        )
        await eventually(lambda: not server.links[DEVICE_A].unacked, what="PUBACK consumed")


@pytest.mark.parametrize("kind", ["up", "status"])
async def test_a_last_will_on_another_devices_topic_is_refused_at_connect(kind: str) -> None:
    acceptor = RecordingAcceptor()
    victim_topic = getattr(SCHEME, kind)(DEVICE_B)
    forged = b'{"type":"listen","state":"detect","text":"set the volume to 3"}'
    async with endpoint(acceptor) as server, connected(server.port, DEVICE_B) as victim:
        await eventually(lambda: acceptor.of(ID_B) != [], what="victim online")
        code = await refused_code(server.port, DEVICE_A, will=(victim_topic, forged, 1, False))
        assert code == mp.NOT_AUTHORIZED
        assert acceptor.of(ID_A) == [] and acceptor.latest(ID_B).texts == []
        assert not victim.closed.is_set() and server.counters["logins_refused"] == 1
        # Its own status topic is fine, and an abnormal end publishes nothing anywhere.
        async with connected(
            server.port, DEVICE_A, will=(SCHEME.status(DEVICE_A), b"offline", 1, True)
        ) as attacker:
            await eventually(lambda: acceptor.of(ID_A) != [], what="own will accepted")
            await attacker.abort()
        await eventually(lambda: acceptor.latest(ID_A).closed != [], what="attacker gone")
        assert acceptor.latest(ID_B).texts == [] and acceptor.latest(ID_B).closed == []


async def test_publishing_on_another_devices_topics_reaches_nobody_and_costs_the_sender() -> None:
    acceptor = RecordingAcceptor()
    async with (
        endpoint(acceptor) as server,
        connected(server.port, DEVICE_B) as victim,
        connected(server.port, DEVICE_A) as attacker,
    ):
        await eventually(lambda: len(acceptor.handlers) == 2, what="both online")
        forged = '{"type":"listen","state":"detect","text":"yes"}'
        await attacker.publish(SCHEME.up(DEVICE_B), forged, qos=1)
        await attacker.publish(SCHEME.status(DEVICE_B), b"offline", qos=1)
        await attacker.publish("$SYS/broker/anything", b"x", qos=1)
        assert await attacker.subscribe(SCHEME.down(DEVICE_B)) == [mp.SUBSCRIBE_FAILURE]
        assert await attacker.subscribe("#") == [mp.SUBSCRIBE_FAILURE]
        await acceptor.latest(ID_B).link.send_text('{"for":"B"}')
        assert (await victim.next_publish(5)).payload == b'{"for":"B"}'
        assert acceptor.latest(ID_B).texts == [] and acceptor.latest(ID_B).closed == []
        assert not victim.closed.is_set() and attacker.publishes.empty()
        assert acceptor.latest(ID_A).texts == []
        assert len(acceptor.latest(ID_A).discarded) >= 3  # charged to the one who sent them
        assert server.counters["dropped_foreign_topic"] == 3


async def test_a_message_claiming_another_device_id_is_dropped() -> None:
    acceptor = RecordingAcceptor()
    async with endpoint(acceptor) as server, connected(server.port, DEVICE_A) as device:
        await eventually(lambda: acceptor.of(ID_A) != [], what="online")
        await device.publish(SCHEME.up(DEVICE_A), f'{{"device_id":"{ID_B}","type":"hello"}}', qos=1)
        await device.publish(SCHEME.up(DEVICE_A), f'{{"device_id":"{ID_A}","type":"hello"}}', qos=1)
        await eventually(lambda: len(acceptor.latest(ID_A).texts) == 1, what="own claim passes")
        assert ID_B not in acceptor.latest(ID_A).texts[0]


@pytest.mark.parametrize(
    ("client_id", "password", "code"),
    [
        (DEVICE_B, PASSWORDS[DEVICE_A], mp.IDENTIFIER_REJECTED),  # another device's client id
        (f"GID_test@@@{DEVICE_B}@@@0b1c2d3e-uuid", PASSWORDS[DEVICE_A], mp.IDENTIFIER_REJECTED),
        (DEVICE_A, "wrong password", mp.BAD_USERNAME_PASSWORD),
        (DEVICE_A, PASSWORDS[DEVICE_B], mp.BAD_USERNAME_PASSWORD),
    ],
)
async def test_logins_are_checked_before_anything_of_the_device_is_touched(
    client_id: str, password: str, code: int
) -> None:
    acceptor = RecordingAcceptor()
    async with endpoint(acceptor) as server, connected(server.port, DEVICE_B) as victim:
        await eventually(lambda: acceptor.of(ID_B) != [], what="victim online")
        assert (
            await refused_code(server.port, DEVICE_A, client_id=client_id, password=password)
            == code
        )
        await acceptor.latest(ID_B).link.send_text('{"still":"here"}')
        assert (await victim.next_publish(5)).payload == b'{"still":"here"}'
        assert acceptor.of(ID_A) == [] and acceptor.latest(ID_B).closed == []


async def test_a_new_login_replaces_the_old_connection_of_that_device() -> None:
    acceptor = RecordingAcceptor()
    async with endpoint(acceptor) as server, connected(server.port, DEVICE_A) as first:
        await eventually(lambda: acceptor.of(ID_A) != [], what="first online")
        async with connected(server.port, DEVICE_A, client_id=STOCK_A) as second:
            await eventually(lambda: len(acceptor.of(ID_A)) == 2, what="second online")
            await first.closed.wait()
            await eventually(lambda: acceptor.of(ID_A)[0].closed != [], what="first closed")
            assert "replaced" in acceptor.of(ID_A)[0].closed[0]
            assert len(server.links) == 1 and acceptor.latest(ID_A).link.identity.client_id
            await acceptor.latest(ID_A).link.send_text("{}")
            assert (await second.next_publish(5)).payload == b"{}"


# ---- nothing kept: sessions, retained messages, QoS 2 -------------------------------------------


async def test_sessions_are_always_clean_and_retained_messages_are_never_stored() -> None:
    acceptor = RecordingAcceptor()
    async with endpoint(acceptor) as server:
        async with connected(server.port, DEVICE_A, clean_session=False) as device:
            assert device.connack_flags == 0  # session present: never
            await device.publish(SCHEME.status(DEVICE_A), b"online", qos=1, retain=True)
            await device.publish(SCHEME.up(DEVICE_A), '{"retained":true}', qos=1, retain=True)
            await eventually(lambda: acceptor.latest(ID_A).texts != [], what="delivered live")
        await eventually(lambda: not server.links, what="nothing left of the device")
        async with connected(server.port, DEVICE_A, clean_session=False) as again:
            assert again.connack_flags == 0
            await again.ping()
            assert (await asyncio.wait_for(again.others.get(), 5))[0] == PINGRESP
            assert again.publishes.empty()
        assert server.counters["retain_ignored"] == 2


async def test_qos2_is_delivered_once_and_unreleased_messages_are_bounded() -> None:
    acceptor = RecordingAcceptor()
    async with (
        endpoint(acceptor, max_qos2_pending=4) as server,
        connected(server.port, DEVICE_A) as device,
    ):
        await eventually(lambda: acceptor.of(ID_A) != [], what="online")
        topic = SCHEME.up(DEVICE_A)
        body = struct.pack(">H", len(topic)) + topic.encode() + struct.pack(">H", 7) + b'{"n":7}'
        await device.send_raw(packet(PUBLISH, 4, body))
        await device.send_raw(packet(PUBLISH, 4 | 8, body))  # a DUP of the same id: not again
        assert (await asyncio.wait_for(device.others.get(), 5))[0] == PUBREC
        await device.send_raw(packet(PUBREL, 2, struct.pack(">H", 7)))
        kinds = {(await asyncio.wait_for(device.others.get(), 5))[0] for _ in range(2)}
        assert kinds == {PUBREC, PUBCOMP}
        assert acceptor.latest(ID_A).texts == ['{"n":7}']
        # Hoarding: QoS 2 messages never released. The fifth unreleased one cuts it off.
        for packet_id in range(100, 105):
            held = struct.pack(">H", len(topic)) + topic.encode() + struct.pack(">H", packet_id)
            await device.send_raw(packet(PUBLISH, 4, held + b"{}"))
        await asyncio.wait_for(device.closed.wait(), 5)
        await eventually(lambda: acceptor.latest(ID_A).closed != [], what="cut off")
        assert "QoS 2" in acceptor.latest(ID_A).closed[0]
        assert server.counters["cut_off"] == 1


# ---- size, malformed packets, keepalive, a device that does not read -----------------------------


async def test_an_oversized_publish_is_refused_from_its_header_and_others_go_on() -> None:
    acceptor = RecordingAcceptor()
    async with (
        endpoint(acceptor, max_message_bytes=4096) as server,
        connected(server.port, DEVICE_A) as attacker,
        connected(server.port, DEVICE_B) as other,
    ):
        await eventually(lambda: len(acceptor.handlers) == 2, what="both online")
        topic = SCHEME.up(DEVICE_A).encode()
        # A 64 MB PUBLISH header, then only a little of its body: the body is never awaited.
        header = bytes([PUBLISH << 4]) + mp.remaining_length(64 * 1024 * 1024)
        await attacker.send_raw(header + struct.pack(">H", len(topic)) + topic + b"x" * 1000)
        await asyncio.wait_for(attacker.closed.wait(), 5)
        await eventually(lambda: acceptor.latest(ID_A).closed != [], what="attacker cut off")
        assert server.counters["cut_off_packet_too_large"] == 1
        await acceptor.latest(ID_B).link.send_text('{"ok":1}')
        assert (await other.next_publish(5)).payload == b'{"ok":1}'


@pytest.mark.parametrize(
    "junk",
    [
        packet(PUBLISH, 6, b"\x00\x01a"),  # QoS 3
        packet(PUBLISH, 0, b"\x00\x03a/#x"),  # a wildcard in a PUBLISH topic
        packet(1, 0, b"\x00\x04MQTT\x04\x02\x00\x3c\x00\x00"),  # a second CONNECT
        packet(15, 0, b""),  # reserved packet type
        bytes([0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x01]),  # remaining length of five bytes
        packet(8, 0, b"\x00\x01\x00\x01a\x01"),  # SUBSCRIBE without its required flags
    ],
)
async def test_malformed_packets_close_only_that_connection(junk: bytes) -> None:
    acceptor = RecordingAcceptor()
    async with (
        endpoint(acceptor) as server,
        connected(server.port, DEVICE_A) as attacker,
        connected(server.port, DEVICE_B) as other,
    ):
        await eventually(lambda: len(acceptor.handlers) == 2, what="both online")
        await attacker.send_raw(junk)
        await asyncio.wait_for(attacker.closed.wait(), 5)
        await eventually(lambda: acceptor.latest(ID_A).closed != [], what="closed")
        await acceptor.latest(ID_B).link.send_text("{}")
        assert (await other.next_publish(5)).payload == b"{}"


async def test_keepalive_is_enforced() -> None:
    acceptor = RecordingAcceptor()
    async with endpoint(acceptor) as server, connected(server.port, DEVICE_A, keepalive=1) as quiet:
        await eventually(lambda: acceptor.of(ID_A) != [], what="online")
        await asyncio.wait_for(quiet.closed.wait(), 10)  # 1.5 s of silence
        await eventually(lambda: acceptor.latest(ID_A).closed != [], what="closed")
        assert "keepalive" in acceptor.latest(ID_A).closed[0]


async def test_a_device_that_never_acknowledges_its_downlink_is_cut_off() -> None:
    acceptor = RecordingAcceptor()
    async with (
        endpoint(acceptor, max_unacked=8) as server,
        connected(server.port, DEVICE_A, auto_ack=False) as mute,
    ):
        await eventually(lambda: acceptor.of(ID_A) != [], what="online")
        link = acceptor.latest(ID_A).link
        for n in range(8):
            await link.send_text(f'{{"n":{n}}}')
        with pytest.raises(LinkClosed):
            await link.send_text('{"n":8}')
        await asyncio.wait_for(mute.closed.wait(), 5)
        await eventually(lambda: acceptor.latest(ID_A).closed != [], what="closed")


# ---- the listener: per-address caps, the CONNECT deadline ---------------------------------------


async def test_idle_sockets_from_one_address_cannot_lock_a_device_out() -> None:
    acceptor = RecordingAcceptor()
    async with endpoint(acceptor, exempt=(), per_address=4, guard_cap=10) as server:
        idle = []
        for _ in range(12):  # from 127.0.0.2: only 4 are kept waiting, the rest dropped
            _reader, writer = await asyncio.open_connection(
                "127.0.0.1", server.port, local_addr=("127.0.0.2", 0)
            )
            idle.append(writer)
        await eventually(lambda: len(server.guard.pending) == 4, what="4 idle sockets held")
        async with connected(server.port, DEVICE_A, local_host="127.0.0.3") as device:
            await eventually(lambda: acceptor.of(ID_A) != [], what="device admitted")
            await acceptor.latest(ID_A).link.send_text("{}")
            assert (await device.next_publish(5)).payload == b"{}"
        assert server.guard.refused >= 8
        # And the deadline frees the held ones (connect_timeout_s = 2 here).
        await eventually(lambda: not server.guard.pending, what="idle sockets dropped")
        for writer in idle:
            writer.close()


async def test_mqtt_3_1_and_5_are_answered_unacceptable_protocol() -> None:
    acceptor = RecordingAcceptor()
    async with endpoint(acceptor) as server:
        for name, level in ((b"MQIsdp", 3), (b"MQTT", 5)):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            body = struct.pack(">H", len(name)) + name + bytes([level, 2, 0, 60]) + b"\x00\x00"
            writer.write(packet(1, 0, body))
            answer = await asyncio.wait_for(reader.read(4), 5)
            assert answer == mp.connack(mp.UNACCEPTABLE_PROTOCOL)
            writer.close()
        assert acceptor.handlers == []


# ---- the real session behind the endpoint: a reconnect loop writes a few lines, not thousands ---


async def test_a_reconnect_loop_writes_a_bounded_number_of_log_lines(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "data")
    registry = DeviceRegistry()
    gateway = DeviceGateway(registry, ConversationHub(registry), settings)
    with capture_logs() as logs:
        async with endpoint(gateway) as server:
            for _ in range(40):
                client = RawMqttClient("127.0.0.1", server.port)
                await client.connect(DEVICE_A, DEVICE_A, PASSWORDS[DEVICE_A])
                await client.disconnect()
            await eventually(lambda: server.counters.get("links_closed", 0) == 40)
    assert server.counters["links_opened"] == 40
    lifecycle = [e for e in logs if e["event"] in ("device ready", "device disconnected")]
    disconnected = [e for e in lifecycle if e["event"] == "device disconnected"]
    # 40 connections: the first ten lines in full, the rest only counted (LineRate per device).
    assert len(disconnected) >= 1 and len(lifecycle) <= 12, [e["event"] for e in lifecycle]
    assert len(logs) < 60, sorted({e["event"] for e in logs})


async def test_packets_sent_with_the_connect_are_not_left_waiting() -> None:
    """A client that does not wait for CONNACK: the PUBLISH in the CONNECT's segment is read."""
    acceptor = RecordingAcceptor()
    async with endpoint(acceptor) as server:
        key, password = DEVICE_A.encode(), PASSWORDS[DEVICE_A].encode()
        fields = b"".join(struct.pack(">H", len(v)) + v for v in (key, key, password))
        connect = packet(1, 0, b"\x00\x04MQTT\x04\xc2\x00\x3c" + fields)
        topic = SCHEME.up(DEVICE_A).encode()
        publish = packet(PUBLISH, 0, struct.pack(">H", len(topic)) + topic + b'{"early":1}')
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(connect + publish)
        assert await asyncio.wait_for(reader.readexactly(4), 5) == mp.connack(mp.ACCEPTED)
        await eventually(lambda: acceptor.of(ID_A) != [] and acceptor.latest(ID_A).texts != [])
        assert acceptor.latest(ID_A).texts == ['{"early":1}']
        writer.close()
