"""The generated Mosquitto configuration against the attacks of issue 16, on a real Mosquitto.

Every test runs the attack from device A's own valid login and then checks two things: the
attack's effect is absent (nothing published as device B, nothing held beyond the configured
bound), and the legitimate path of the same kind still works (A's own will, B's largest message,
A's own retained presence). Figures are measured against the broker process itself (RSS from
/proc, lines of its log). What Mosquitto cannot do (a per-address limit) is measured too, so a
change of behaviour shows up here.
"""

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backend.transports.mqtt_credentials import BrokerLimits
from backend.transports.mqtt_topics import TopicScheme
from testkit.mosquitto import Mosquitto, mosquitto_available
from tests.mqtt_wire import CONNACK, CONNECT, PUBLISH, MqttRefused, Publish, RawMqttClient, packet

pytestmark = pytest.mark.skipif(not mosquitto_available(), reason="mosquitto not installed")

# The same logins as tests/mqtt_helpers.py (not imported: it pulls in the embedded broker).
PREFIX = "xiaozhi"
SCHEME = TopicScheme(PREFIX)
DEVICE_A = "a4_cf_12_34_56_78"
DEVICE_B = "a4_cf_12_34_56_79"
PASSWORDS = {DEVICE_A: "password-of-device-a", DEVICE_B: "password-of-device-b"}
LIMITS = BrokerLimits()
QUIET_S = 0.5  # how long "nothing arrives" is watched for, after a marker that did arrive


@contextlib.asynccontextmanager
async def broker(tmp_path: Path, limits: BrokerLimits | None = None) -> AsyncIterator[Mosquitto]:
    mosquitto = Mosquitto(tmp_path / "mosquitto", PASSWORDS, prefix=PREFIX, limits=limits)
    await mosquitto.start()
    try:
        yield mosquitto
    finally:
        await mosquitto.stop()


async def bridge_subscriber(mosquitto: Mosquitto) -> RawMqttClient:
    """What the bridge does: its own account, subscribed to every device's `up` and `status`."""
    client = RawMqttClient("127.0.0.1", mosquitto.port)
    await client.connect("bridge", mosquitto.bridge.username, mosquitto.bridge.password)
    for kind in ("up", "status"):
        assert await client.subscribe(f"{PREFIX}/+/{kind}") == [1]
    return client


async def device(
    mosquitto: Mosquitto, key: str, *, will: tuple[str, bytes, int, bool] | None = None
) -> RawMqttClient:
    client = RawMqttClient("127.0.0.1", mosquitto.port)
    await client.connect(key, key, PASSWORDS[key], will=will)
    return client


async def received_until(client: RawMqttClient, topic: str, payload: bytes) -> list[Publish]:
    """Everything `client` receives up to and including the marker (`topic`, `payload`)."""
    seen = []
    while True:
        got = await client.next_publish(10)
        seen.append(got)
        if (got.topic, got.payload) == (topic, payload):
            return seen


async def drain(client: RawMqttClient, quiet_s: float = QUIET_S) -> list[Publish]:
    seen = []
    with contextlib.suppress(TimeoutError):
        while True:
            seen.append(await client.next_publish(quiet_s))
    return seen


def _str(value: str) -> bytes:
    data = value.encode()
    return struct.pack(">H", len(data)) + data


async def persistent_connect(
    mosquitto: Mosquitto, client_id: str, key: str, *, clean: bool = False
) -> tuple[RawMqttClient, bool]:
    """CONNECT with clean session 0 (or 1); returns the client and CONNACK's session-present."""
    client = RawMqttClient("127.0.0.1", mosquitto.port)
    client.reader, client.writer = await asyncio.open_connection("127.0.0.1", mosquitto.port)
    flags = 0xC0 | (0x02 if clean else 0)
    body = _str("MQTT") + bytes([4, flags]) + struct.pack(">H", 60)
    body += _str(client_id) + _str(key) + _str(PASSWORDS[key])
    client.writer.write(packet(CONNECT, 0, body))
    await client.writer.drain()
    kind, _flags, data = await client._read_packet()
    assert kind == CONNACK and data[1] == 0, (kind, data)
    client._reader_task = asyncio.create_task(client._read_loop())
    return client, bool(data[0] & 1)


async def test_a_will_on_another_devices_topic_is_never_published(tmp_path: Path) -> None:
    async with broker(tmp_path) as mosquitto:
        bridge = await bridge_subscriber(mosquitto)
        victim = await device(
            mosquitto, DEVICE_B, will=(SCHEME.status(DEVICE_B), b"offline", 1, True)
        )
        hostile = {
            SCHEME.up(DEVICE_B): b'{"type":"listen","state":"detect","text":"set the volume to 3"}',
            SCHEME.status(DEVICE_B): b"offline",
        }
        connacks = []
        for topic, payload in hostile.items():
            for retain in (False, True):
                attacker = RawMqttClient("127.0.0.1", mosquitto.port)
                try:
                    await attacker.connect(
                        DEVICE_A, DEVICE_A, PASSWORDS[DEVICE_A], will=(topic, payload, 1, retain)
                    )
                    connacks.append(0)
                except MqttRefused as refused:  # what a newer Mosquitto may do: also fine
                    connacks.append(refused.code)
                await attacker.abort()  # an abnormal disconnect: the broker sends the will
        # Mosquitto 2.0.11 accepts the CONNECT and checks the will against the ACL when it
        # would send it (measured: CONNACK 0 for all four).
        assert set(connacks) <= {0, 5}, connacks
        # The legitimate path: A's own will, set and fired the same way, arrives; anything
        # the four wills above had published would have arrived before it.
        own = await device(mosquitto, DEVICE_A, will=(SCHEME.status(DEVICE_A), b"offline", 1, True))
        await own.abort()
        seen = await received_until(bridge, SCHEME.status(DEVICE_A), b"offline")
        await victim.publish(SCHEME.up(DEVICE_B), b'{"type":"hello"}', qos=1)
        seen += await received_until(bridge, SCHEME.up(DEVICE_B), b'{"type":"hello"}')
        seen += await drain(bridge)
        as_b = [p for p in seen if f"/{DEVICE_B}/" in p.topic]
        assert [(p.topic, p.payload) for p in as_b] == [(SCHEME.up(DEVICE_B), b'{"type":"hello"}')]
        assert not victim.closed.is_set()
        # Nothing retained on B's topics either (a retained will would have stayed there).
        await bridge.disconnect()
        fresh = await bridge_subscriber(mosquitto)
        retained = await drain(fresh)
        assert [(p.topic, p.payload) for p in retained] == [(SCHEME.status(DEVICE_A), b"offline")]
        for client in (fresh, victim):
            await client.abort()


async def test_an_oversized_publish_closes_the_connection_unbuffered(tmp_path: Path) -> None:
    async with broker(tmp_path) as mosquitto:
        bridge = await bridge_subscriber(mosquitto)
        victim = await device(mosquitto, DEVICE_B)
        rss_before = mosquitto.rss_kib()
        attacker = await device(mosquitto, DEVICE_A)
        assert attacker.writer is not None
        size = 64 * 1024 * 1024
        frame = packet(PUBLISH, 0, _str(SCHEME.up(DEVICE_A)) + bytes(size))
        sent = 0
        with contextlib.suppress(ConnectionError):
            for offset in range(0, len(frame), 1 << 16):
                attacker.writer.write(frame[offset : offset + (1 << 16)])
                await attacker.writer.drain()
                sent += 1 << 16
        await asyncio.wait_for(attacker.closed.wait(), 5)
        # Measured on 2.0.11: reset after the first 64 KiB chunk, RSS unchanged.
        assert sent < 8 * 1024 * 1024, sent
        assert mosquitto.rss_kib() - rss_before < 4096
        # One byte over the packet bound is refused the same way (2.0.11 counts the type byte
        # and the remaining length, measured: not the length bytes) ...
        over = await device(mosquitto, DEVICE_A)
        topic = SCHEME.up(DEVICE_A)
        payload = bytes(LIMITS.max_packet_bytes - len(_str(topic)))
        await over.publish(topic, payload)
        await asyncio.wait_for(over.closed.wait(), 5)
        # ... one byte over the message bound is acknowledged and dropped (message_size_limit) ...
        dropped = await device(mosquitto, DEVICE_A)
        await dropped.publish(topic, bytes(LIMITS.max_message_bytes + 1), qos=1)
        await dropped.abort()
        # ... and the largest message the bridge takes still passes, for B and for A.
        largest = b"b" * LIMITS.max_message_bytes
        await victim.publish(SCHEME.up(DEVICE_B), largest, qos=1)
        got = await bridge.next_publish()
        assert (got.topic, len(got.payload)) == (SCHEME.up(DEVICE_B), LIMITS.max_message_bytes)
        again = await device(mosquitto, DEVICE_A)
        await again.publish(SCHEME.up(DEVICE_A), b"a" * LIMITS.max_message_bytes, qos=1)
        assert (await bridge.next_publish()).topic == SCHEME.up(DEVICE_A)
        assert await drain(bridge) == []  # nothing of the refused packets was forwarded
        for client in (again, victim, bridge):
            await client.abort()


async def test_qos2_is_refused_so_nothing_waits_for_pubrel(tmp_path: Path) -> None:
    async with broker(tmp_path) as mosquitto:
        bridge = await bridge_subscriber(mosquitto)
        rss_before = mosquitto.rss_kib()
        attacker = await device(mosquitto, DEVICE_A)
        assert attacker.writer is not None
        topic = _str(SCHEME.up(DEVICE_A))
        with contextlib.suppress(ConnectionError):
            for packet_id in range(1, 1001):  # QoS 2, never a PUBREL
                attacker.writer.write(
                    packet(PUBLISH, 0x04, topic + struct.pack(">H", packet_id) + bytes(60_000))
                )
                await attacker.writer.drain()
        await asyncio.wait_for(attacker.closed.wait(), 5)
        assert mosquitto.rss_kib() - rss_before < 4096
        # A QoS 2 will is refused too (the connection closes before any CONNACK).
        will2 = RawMqttClient("127.0.0.1", mosquitto.port)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await will2.connect(
                DEVICE_A,
                DEVICE_A,
                PASSWORDS[DEVICE_A],
                will=(SCHEME.status(DEVICE_A), b"x", 2, False),
            )
        await will2.abort()
        # The legitimate path: QoS 1 from the same login, and a QoS 2 subscription granted as 1.
        again = await device(mosquitto, DEVICE_A)
        assert await again.subscribe(SCHEME.down(DEVICE_A), qos=2) == [1]
        await again.publish(SCHEME.up(DEVICE_A), b"qos1", qos=1)
        got = await bridge.next_publish()
        assert (got.topic, got.payload) == (SCHEME.up(DEVICE_A), b"qos1")
        assert await drain(bridge) == []
        for client in (again, bridge):
            await client.abort()


async def test_persistent_sessions_are_one_per_login_with_a_bounded_queue(tmp_path: Path) -> None:
    async with broker(tmp_path) as mosquitto:
        bridge = await bridge_subscriber(mosquitto)
        present = []
        for n in range(50):  # 50 client ids, one login: every CONNECT finds the same session
            client, session_present = await persistent_connect(mosquitto, f"hoard-{n}", DEVICE_A)
            present.append(session_present)
            if n == 0:
                assert await client.subscribe(SCHEME.down(DEVICE_A)) == [1]
            await client.abort()
        assert present == [False] + [True] * 49
        # The bridge keeps publishing to A's downlink while A is away: the queue is bounded.
        message = bytes(60_000)
        for _ in range(100):
            await bridge.publish(SCHEME.down(DEVICE_A), message, qos=1)
        rss = mosquitto.rss_kib()
        back, session_present = await persistent_connect(mosquitto, "hoard-back", DEVICE_A)
        assert session_present
        queued = await drain(back, 1.0)
        held = sum(len(p.payload) for p in queued)
        assert 1 <= len(queued) < 100  # the legitimate path: a reconnecting device gets its mail
        assert held <= LIMITS.max_queued_bytes + len(message), held
        assert rss < 64 * 1024, rss  # 100 x 60 KB would be 6 MB on top of the queue bound
        await back.abort()
        # A clean session discards it: the next persistent CONNECT starts afresh.
        clean, _ = await persistent_connect(mosquitto, "x", DEVICE_A, clean=True)
        await clean.disconnect()
        fresh, session_present = await persistent_connect(mosquitto, "y", DEVICE_A)
        assert not session_present
        for client in (fresh, bridge):
            await client.abort()


async def test_retained_messages_are_bounded_by_the_acl(tmp_path: Path) -> None:
    # Retain stays available (our firmware's presence); a login can only ever hold one retained
    # message per topic it may write, and none on another device's topics.
    async with broker(tmp_path) as mosquitto:
        attacker = await device(mosquitto, DEVICE_A)
        for n in range(200):
            await attacker.publish(SCHEME.status(DEVICE_A), b"x%d" % n + bytes(60_000), retain=True)
            await attacker.publish(SCHEME.status(DEVICE_B), b"offline", retain=True)
        await attacker.publish(SCHEME.status(DEVICE_A), b"online", qos=1, retain=True)
        bridge = await bridge_subscriber(mosquitto)
        retained = await drain(bridge)
        assert [(p.topic, p.payload, p.retain) for p in retained] == [
            (SCHEME.status(DEVICE_A), b"online", True)  # the legitimate path: presence
        ]
        assert mosquitto.rss_kib() < 32 * 1024
        for client in (attacker, bridge):
            await client.abort()


async def test_with_retain_off_retained_messages_are_refused(tmp_path: Path) -> None:
    async with broker(tmp_path, BrokerLimits(retain_available=False)) as mosquitto:
        attacker = await device(mosquitto, DEVICE_A)
        await attacker.publish(SCHEME.status(DEVICE_A), b"online", retain=True)
        await asyncio.wait_for(attacker.closed.wait(), 5)
        # Why it is not the default: our firmware's CONNECT (retained will) is dropped too.
        firmware = RawMqttClient("127.0.0.1", mosquitto.port)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await firmware.connect(
                DEVICE_A,
                DEVICE_A,
                PASSWORDS[DEVICE_A],
                will=(SCHEME.status(DEVICE_A), b"offline", 1, True),
            )
        await firmware.abort()
        bridge = await bridge_subscriber(mosquitto)
        assert await drain(bridge) == []  # nothing was stored
        # The legitimate path without retain: will and presence still arrive.
        plain = await device(
            mosquitto, DEVICE_A, will=(SCHEME.status(DEVICE_A), b"offline", 1, False)
        )
        await plain.publish(SCHEME.status(DEVICE_A), b"online", qos=1)
        await plain.abort()
        seen = await received_until(bridge, SCHEME.status(DEVICE_A), b"offline")
        assert [p.payload for p in seen] == [b"online", b"offline"]
        await bridge.abort()


async def test_churn_and_refusals_write_no_log_lines(tmp_path: Path) -> None:
    async with broker(tmp_path) as mosquitto:
        bridge = await bridge_subscriber(mosquitto)
        before = mosquitto.log_lines()
        for n in range(100):
            client = await device(mosquitto, DEVICE_A, will=(SCHEME.up(DEVICE_B), b"x", 1, False))
            await client.publish(SCHEME.up(DEVICE_B), b"x", qos=1)  # denied, still PUBACKed
            await (client.disconnect() if n % 2 else client.abort())
            wrong = RawMqttClient("127.0.0.1", mosquitto.port)
            with pytest.raises(MqttRefused):
                await wrong.connect(DEVICE_A, DEVICE_A, "wrong password")
            await wrong.abort()
            _reader, writer = await asyncio.open_connection("127.0.0.1", mosquitto.port)
            writer.write(b"\xff" * 16)  # not MQTT at all
            writer.close()
        # The legitimate path: the bridge still hears a device after the churn.
        final = await device(mosquitto, DEVICE_A)
        await final.publish(SCHEME.up(DEVICE_A), b"still here", qos=1)
        seen = await received_until(bridge, SCHEME.up(DEVICE_A), b"still here")
        assert all(f"/{DEVICE_B}/" not in p.topic for p in seen)
        # Mosquitto's defaults write 2-3 lines per connection (measured): 700+ here.
        assert mosquitto.log_lines() - before <= 5
        for client in (final, bridge):
            await client.abort()


async def test_max_connections_caps_sockets_but_cannot_tell_an_attacker_apart(
    tmp_path: Path,
) -> None:
    # Mosquitto counts sockets before any login and has no per-address limit: the cap bounds
    # the broker, and a firewall must bound each address (docs/mqtt.md). Measured here.
    cap = 8
    async with broker(tmp_path, BrokerLimits(max_connections=cap)) as mosquitto:
        idle = [await asyncio.open_connection("127.0.0.1", mosquitto.port) for _ in range(20)]
        states = []
        for reader, _writer in idle:
            try:
                states.append(await asyncio.wait_for(reader.read(1), 0.2) != b"")
            except TimeoutError:
                states.append(True)  # still open
            except ConnectionError:
                states.append(False)
        assert sum(states) <= cap + 1, states  # 2.0.11 admits one past the cap
        blocked = RawMqttClient("127.0.0.1", mosquitto.port)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await blocked.connect(DEVICE_B, DEVICE_B, PASSWORDS[DEVICE_B])
        await blocked.abort()
        for _reader, writer in idle:
            writer.close()
        await asyncio.sleep(0.2)
        admitted = await device(mosquitto, DEVICE_B)  # room again once they are gone
        await admitted.disconnect()
