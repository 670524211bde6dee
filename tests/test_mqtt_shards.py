"""MQTT shards (issue #21): several bridge instances on one broker, each serving the devices of
the shards it owns. The hash and the topic scheme on their own; then real Mosquitto brokers with
two bridge transports (recording acceptors) and two whole bridges with simulated devices that
run the firmware's own MQTT code."""

import contextlib
import json
import string
import uuid
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from backend.auth import Tokens
from backend.cli.mqtt import credentials_record
from backend.provisioning.ota import MqttAccess, mqtt_section
from backend.server import Bridge
from backend.transports.admission import Admission
from backend.transports.errors import MqttConfigError, TopicError, WrongShard
from backend.transports.mqtt import SHARD_MOVED, BrokerVouched, MqttTransport
from backend.transports.mqtt_credentials import (
    BridgeAccount,
    emqx_acl,
    emqx_auto_subscribe,
    mosquitto_acl,
    write_mosquitto_password_file,
)
from backend.transports.mqtt_topics import DeviceTopic, TopicKind, TopicScheme, device_key, shard_of
from simulator import MqttOptions, SimulatedDevice
from simulator.firmware import firmware_module
from simulator.fleet import device_id_for, mqtt_firmware_module
from testkit.mosquitto import Mosquitto, mosquitto_available
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN, make_settings
from tests.mqtt_helpers import RecordingAcceptor, eventually, transport_settings
from tests.mqtt_wire import Publish, RawMqttClient

PREFIX = "xiaozhi"
SHARDS = 4
SCHEME = TopicScheme(PREFIX, SHARDS)
# Fleet devices by shard (of 4): index 2 -> 0, 4 -> 1, 1 -> 2, 5 -> 3.
INDEX_OF_SHARD = {0: 2, 1: 4, 2: 1, 3: 5}
SECRET = "mqtt-secret-for-the-shard-tests-0123456789"
WAIT_S = 10.0

needs_mosquitto = pytest.mark.skipif(not mosquitto_available(), reason="mosquitto not installed")


def key_of(index: int) -> str:
    return device_key(device_id_for(index))


# ---- the hash -----------------------------------------------------------------------------------


def test_the_shard_of_a_key_is_pinned() -> None:
    # CRC-32 (IEEE) of the key's ASCII bytes: these numbers must never change, or every
    # deployed device would move to another shard.
    assert [shard_of("a4_cf_12_34_56_78", n) for n in (1, 2, 4, 16, 1024)] == [0, 0, 0, 8, 792]
    assert [shard_of("dev-7", n) for n in (2, 4, 16, 1024)] == [1, 3, 3, 675]
    assert shard_of("dev-7", 1024) == zlib.crc32(b"dev-7") % 1024
    assert {i: SCHEME.shard_of(key_of(i)) for i in INDEX_OF_SHARD.values()} == {
        index: shard for shard, index in INDEX_OF_SHARD.items()
    }


def test_mac_keys_hash_the_same_in_any_case() -> None:
    # Both spellings are one device (`device_id_from_key`): they must be in one shard.
    assert shard_of("A4_CF_12_34_56_78", 1024) == shard_of("a4_cf_12_34_56_78", 1024)
    assert SCHEME.device_prefix("A4_CF_12_34_56_78") == SCHEME.device_prefix("a4_cf_12_34_56_78")


@pytest.mark.parametrize("shards", [2, 4, 16, 64, 1024])
def test_shards_are_evenly_used(shards: int) -> None:
    macs = [
        device_key(f"a4:cf:12:{i >> 16:02x}:{(i >> 8) & 255:02x}:{i & 255:02x}")
        for i in range(8192)
    ]
    names = [f"sensor-{uuid.uuid5(uuid.NAMESPACE_DNS, str(i))}" for i in range(8192)]
    for keys in (macs, names):
        counts = Counter(shard_of(key, shards) for key in keys)
        mean = len(keys) / shards
        spread = 5 * mean**0.5  # five standard deviations of a fair random assignment
        assert len(counts) == shards
        assert all(abs(count - mean) < spread for count in counts.values()), counts


# ---- the topic scheme ---------------------------------------------------------------------------

KEYS = st.text(string.ascii_letters + string.digits + "_.-", min_size=1, max_size=64)


@given(key=KEYS, shards=st.integers(1, 1024), kind=st.sampled_from(list(TopicKind)))
def test_sharded_topics_round_trip(key: str, shards: int, kind: TopicKind) -> None:
    scheme = TopicScheme("site/xiaozhi", shards)
    topic = scheme.topic(key, kind)
    parsed = scheme.parse(topic)
    assert parsed == DeviceTopic(key, kind, shard_of(key, shards))
    assert scheme.is_own(key, topic, kind)
    levels = topic.split("/")
    if shards == 1:
        assert topic == f"site/xiaozhi/{key}/{kind.value}"
    else:
        assert levels[2] == f"s{parsed.shard}" and levels[3] == key and len(levels) == 5
        assert scheme.device_prefix(key) == "/".join(levels[:3])


def test_sharded_topics_of_a_device() -> None:
    key = key_of(INDEX_OF_SHARD[3])
    assert SCHEME.up(key) == f"xiaozhi/s3/{key}/up"
    assert SCHEME.down(key) == f"xiaozhi/s3/{key}/down"
    assert SCHEME.status(key) == f"xiaozhi/s3/{key}/status"
    assert SCHEME.device_prefix(key) == "xiaozhi/s3"
    assert TopicScheme(PREFIX).device_prefix(key) == "xiaozhi"
    assert SCHEME.all_topics == "xiaozhi/#"


def test_a_topic_in_another_shard_is_refused() -> None:
    key = key_of(INDEX_OF_SHARD[1])
    for shard in (0, 2, 3):
        for kind in TopicKind:
            topic = f"xiaozhi/s{shard}/{key}/{kind.value}"
            with pytest.raises(WrongShard):
                SCHEME.parse(topic)
            assert not SCHEME.is_own(key, topic, kind)


@pytest.mark.parametrize(
    "topic",
    [
        "xiaozhi/{key}/up",  # the unsharded form
        "xiaozhi/s01/{key}/up",
        "xiaozhi/S1/{key}/up",
        "xiaozhi/1/{key}/up",
        "xiaozhi/s/{key}/up",
        "xiaozhi/s-1/{key}/up",
        "xiaozhi/s12345/{key}/up",
        "xiaozhi/+/{key}/up",
        "xiaozhi/s1/+/up",
        "xiaozhi/s1/{key}/up/more",
        "xiaozhi/s1/s1/{key}/up",
        "other/s1/{key}/up",
        "xiaozhi/s1/{key}/sideways",
    ],
)
def test_malformed_sharded_topics_are_refused(topic: str) -> None:
    with pytest.raises(TopicError):
        SCHEME.parse(topic.format(key=key_of(INDEX_OF_SHARD[1])))


def test_an_unsharded_scheme_refuses_sharded_topics() -> None:
    key = key_of(1)
    with pytest.raises(TopicError):
        TopicScheme(PREFIX).parse(SCHEME.up(key))


def test_filters() -> None:
    assert SCHEME.filter(TopicKind.UP) == "xiaozhi/+/+/up"
    assert SCHEME.filter(TopicKind.STATUS, 3) == "xiaozhi/s3/+/status"
    assert SCHEME.shard_filters(0) == ["xiaozhi/s0/+/up", "xiaozhi/s0/+/status"]
    unsharded = TopicScheme(PREFIX)
    assert unsharded.filter(TopicKind.UP) == unsharded.filter(TopicKind.UP, 0) == "xiaozhi/+/up"
    for bad in (-1, 4, True):
        with pytest.raises(TopicError):
            SCHEME.filter(TopicKind.UP, bad)
    with pytest.raises(TopicError):
        unsharded.filter(TopicKind.UP, 1)


@pytest.mark.parametrize("shards", [0, 1025, -1])
def test_shard_counts_out_of_range(shards: int, tmp_path: Path) -> None:
    with pytest.raises(TopicError):
        TopicScheme(PREFIX, shards)
    with pytest.raises(ValidationError):
        make_settings(tmp_path, mqtt_shards=shards)


def test_the_embedded_endpoint_has_no_shards(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="external broker"):
        make_settings(tmp_path, mqtt_url="embedded", mqtt_shards=4, udp_host="127.0.0.1")
    assert make_settings(tmp_path, mqtt_url="mqtt://127.0.0.1:1883", mqtt_shards=4).mqtt_shards == 4
    assert make_settings(tmp_path).mqtt_shards == 1


# ---- what devices and brokers are told ----------------------------------------------------------


def test_broker_files_for_sharded_topics() -> None:
    acl = mosquitto_acl(PREFIX, "bridge", more_bridge_usernames=["bridge-2"], shards=SHARDS)
    lines = acl.splitlines()
    for line in (
        "user bridge",
        "user bridge-2",
        "topic readwrite xiaozhi/#",
        "pattern write xiaozhi/+/%u/up",
        "pattern write xiaozhi/+/%u/status",
        "pattern read xiaozhi/+/%u/down",
    ):
        assert line in lines
    assert "pattern write xiaozhi/%u/up" in mosquitto_acl(PREFIX).splitlines()  # unchanged
    emqx = emqx_acl(PREFIX, shards=SHARDS)
    assert (
        '{allow, all, publish, ["xiaozhi/+/${username}/up", "xiaozhi/+/${username}/status"]}.'
        in emqx
    )
    assert '{allow, all, subscribe, ["xiaozhi/+/${username}/down"]}.' in emqx
    assert 'topic = "xiaozhi/+/${username}/down"' in emqx_auto_subscribe(PREFIX, shards=SHARDS)


def test_the_ota_answer_hands_out_sharded_topics_and_the_firmware_follows_them() -> None:
    device_id = device_id_for(INDEX_OF_SHARD[2])
    key = device_key(device_id)
    section = mqtt_section(MqttAccess("broker:1883", PREFIX, shards=SHARDS), device_id, "c1", "t")
    assert section["publish_topic"] == f"xiaozhi/s2/{key}/up"
    assert section["subscribe_topic"] == f"xiaozhi/s2/{key}/down"
    unsharded = mqtt_section(MqttAccess("broker:1883", PREFIX), device_id, "c1", "t")
    assert unsharded["publish_topic"] == f"xiaozhi/{key}/up"
    # The firmware's own reading of the answer: its status topic is the uplink's sibling.
    ota = firmware_module("ota")
    settings = ota.mqtt_settings({"mqtt": section}, {})
    transport_mqtt = mqtt_firmware_module("transport_mqtt")
    assert transport_mqtt.topics(settings, device_id) == (
        SCHEME.up(key),
        SCHEME.down(key),
        SCHEME.status(key),
    )
    # And from a config.json that has only the device's topic prefix.
    by_prefix = {"topic_prefix": SCHEME.device_prefix(key)}
    assert transport_mqtt.topics(by_prefix, device_id) == transport_mqtt.topics(settings, device_id)


def test_mqtt_credentials_prints_sharded_topics(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path, mqtt_url="mqtt://127.0.0.1:1883", mqtt_shards=SHARDS, mqtt_secret=SECRET
    )
    device_id = device_id_for(INDEX_OF_SHARD[3])
    record = credentials_record(settings, device_id, [])
    key = device_key(device_id)
    assert record["publish_topic"] == f"xiaozhi/s3/{key}/up"
    assert record["status_topic"] == f"xiaozhi/s3/{key}/status"
    assert record["subscribe_topic"] == f"xiaozhi/s3/{key}/down"
    assert (record["topic_prefix"], record["device_topic_prefix"], record["shard"]) == (
        "xiaozhi",
        "xiaozhi/s3",
        3,
    )


# ---- a real Mosquitto with two bridge accounts --------------------------------------------------


class ShardedBroker:
    """Mosquitto with the sharded ACL and two bridge accounts (one per bridge instance)."""

    def __init__(self, workdir: Path, devices: dict[str, str]) -> None:
        self.broker = Mosquitto(workdir, devices, prefix=PREFIX)
        self.second = BridgeAccount("bridge-2")
        accounts = [self.broker.bridge, self.second]
        write_mosquitto_password_file(
            workdir / "passwords",
            [*((a.username, a.password) for a in accounts), *devices.items()],
            use_tool=True,
        )
        (workdir / "acl").write_text(
            mosquitto_acl(
                PREFIX,
                self.broker.bridge.username,
                more_bridge_usernames=["bridge-2"],
                shards=SHARDS,
            )
        )

    @property
    def port(self) -> int:
        return self.broker.port

    def url(self, which: int) -> str:
        account = self.broker.bridge if which == 0 else self.second
        return f"mqtt://{account.username}:{account.password}@127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def sharded_broker(workdir: Path, devices: dict[str, str]) -> AsyncIterator[ShardedBroker]:
    if not mosquitto_available():
        pytest.skip("mosquitto not installed")
    broker = ShardedBroker(workdir, devices)
    await broker.broker.start()
    try:
        yield broker
    finally:
        await broker.broker.stop()


RAW_KEYS = {shard: key_of(index) for shard, index in INDEX_OF_SHARD.items()}
RAW_PASSWORDS = {key: f"password-of-{key}" for key in RAW_KEYS.values()}


@contextlib.asynccontextmanager
async def raw_device(port: int, key: str) -> AsyncIterator[RawMqttClient]:
    """Our firmware's behaviour on sharded topics: will, own subscription, retained online."""
    client = RawMqttClient("127.0.0.1", port)
    await client.connect(
        key, key, RAW_PASSWORDS[key], will=(SCHEME.status(key), b"offline", 1, True)
    )
    assert await client.subscribe(SCHEME.down(key)) == [1]
    await client.publish(SCHEME.status(key), b"online", qos=1, retain=True)
    try:
        yield client
    finally:
        await client.abort()


@contextlib.asynccontextmanager
async def two_transports(
    broker: ShardedBroker, shards_a: set[int] | None, shards_b: set[int] | None
) -> AsyncIterator[tuple[tuple[MqttTransport, RecordingAcceptor], ...]]:
    """Two bridge transports with shards set before they start."""
    pairs = []
    for which, shards in ((0, shards_a), (1, shards_b)):
        settings = transport_settings(
            broker.url(which), client_id=f"bridge-{which}", shards=SHARDS, topic_prefix=PREFIX
        )
        transport = MqttTransport(settings, Admission(BrokerVouched()))
        await transport.set_shards(shards)
        pairs.append((transport, RecordingAcceptor()))
    try:
        for transport, acceptor in pairs:
            await transport.start(acceptor)
            await transport.wait_connected(10)
        yield tuple(pairs)
    finally:
        for transport, _ in pairs:
            await transport.stop()


@needs_mosquitto
async def test_mosquitto_confines_a_device_to_its_own_key_on_any_shard_level(
    tmp_path: Path,
) -> None:
    mine, other = RAW_KEYS[0], RAW_KEYS[1]
    async with sharded_broker(tmp_path, RAW_PASSWORDS) as broker:
        bridge = RawMqttClient("127.0.0.1", broker.port)
        account = broker.broker.bridge
        await bridge.connect("b", account.username, account.password)
        assert await bridge.subscribe("xiaozhi/#") == [1]
        dev = RawMqttClient("127.0.0.1", broker.port)
        await dev.connect(mine, mine, RAW_PASSWORDS[mine])
        refused = [
            SCHEME.up(other),  # another device's uplink
            SCHEME.status(other),
            f"xiaozhi/s0/{other}/up",  # another key in my shard
            f"xiaozhi/{mine}/up",  # the unsharded form
            f"xiaozhi/s0/x/{mine}/up",
            SCHEME.down(mine),  # my downlink is the bridge's to write
        ]
        allowed = [SCHEME.up(mine), f"xiaozhi/s3/{mine}/up", SCHEME.status(mine)]
        for topic in refused + allowed:
            await dev.publish(topic, b"{}", qos=1)
        await dev.publish(SCHEME.up(mine), b"end", qos=1)
        seen: list[Publish] = []
        while not seen or seen[-1].payload != b"end":
            seen.append(await bridge.next_publish(5))
        assert [p.topic for p in seen[:-1]] == allowed
        # Reading: its own downlink only.
        assert await dev.subscribe("xiaozhi/+/+/down") == [1]
        await bridge.publish(SCHEME.down(other), b"not for you", qos=1)
        await bridge.publish(SCHEME.down(mine), b"for you", qos=1)
        assert (await dev.next_publish(5)).payload == b"for you"
        for client in (bridge, dev):
            await client.abort()


@needs_mosquitto
async def test_two_transports_each_serve_only_their_shards_and_hand_one_over(
    tmp_path: Path,
) -> None:
    async with (
        sharded_broker(tmp_path, RAW_PASSWORDS) as broker,
        two_transports(broker, {0, 1}, {2, 3}) as ((a, seen_a), (b, seen_b)),
        raw_device(broker.port, RAW_KEYS[0]) as dev0,
        raw_device(broker.port, RAW_KEYS[2]) as dev2,
    ):
        id0, id2 = device_id_for(INDEX_OF_SHARD[0]), device_id_for(INDEX_OF_SHARD[2])
        await eventually(lambda: a.links().keys() == {id0} and b.links().keys() == {id2})
        assert (a.owned_shards, b.owned_shards) == (frozenset({0, 1}), frozenset({2, 3}))
        await dev0.publish(SCHEME.up(RAW_KEYS[0]), b'{"type":"mcp","n":0}', qos=1)
        await dev2.publish(SCHEME.up(RAW_KEYS[2]), b'{"type":"mcp","n":2}', qos=1)
        await eventually(lambda: bool(seen_a.latest(id0).texts and seen_b.latest(id2).texts))
        assert seen_a.of(id2) == [] and seen_b.of(id0) == []
        assert seen_a.latest(id0).texts == ['{"type":"mcp","n":0}']

        # Shard 2 moves from B to A: B lets go first, then A takes it.
        handler_b = seen_b.latest(id2)
        await b.set_shards({3})
        assert handler_b.closed == [SHARD_MOVED] and b.links() == {}
        await a.set_shards({0, 1, 2})
        await eventually(lambda: id2 in a.links(), what="A opens shard 2's device")
        assert not dev2.closed.is_set()  # the device never left the broker
        await a.links()[id2].send_text('{"type":"mcp","from":"a"}')
        got = await dev2.next_publish(5)
        assert (got.topic, json.loads(got.payload)) == (
            SCHEME.down(RAW_KEYS[2]),
            {"type": "mcp", "from": "a"},
        )
        await dev2.publish(SCHEME.up(RAW_KEYS[2]), b'{"type":"mcp","n":"after"}', qos=1)
        await eventually(lambda: seen_a.latest(id2).texts == ['{"type":"mcp","n":"after"}'])
        assert len(seen_b.of(id2)) == 1 and b.links() == {}
        assert b.counters["shard_moved_links"] == 1


@needs_mosquitto
async def test_a_device_on_another_shards_topic_is_dropped_and_never_appears(
    tmp_path: Path,
) -> None:
    key = RAW_KEYS[0]  # shard 0, owned by A; it also tries B's shard 2
    device_id = device_id_for(INDEX_OF_SHARD[0])
    async with (
        sharded_broker(tmp_path, RAW_PASSWORDS) as broker,
        two_transports(broker, {0, 1}, {2, 3}) as ((a, seen_a), (b, seen_b)),
    ):
        dev = RawMqttClient("127.0.0.1", broker.port)
        await dev.connect(key, key, RAW_PASSWORDS[key])
        wrong = f"xiaozhi/s2/{key}"
        await dev.publish(f"{wrong}/status", b"online", qos=1, retain=True)
        await dev.publish(f"{wrong}/up", b'{"type":"mcp"}', qos=1)
        await eventually(lambda: b.counters.get("dropped_wrong_shard", 0) == 2, what="both dropped")
        assert seen_b.of(device_id) == [] and b.links() == {}
        # Its own shard's topic works, on A only.
        await dev.publish(SCHEME.up(key), b'{"type":"mcp","right":1}', qos=1)
        await eventually(
            lambda: bool(seen_a.of(device_id)) and bool(seen_a.latest(device_id).texts)
        )
        assert seen_b.of(device_id) == [] and "dropped_wrong_shard" not in a.counters
        # A bridge that later takes shard 2 gets the retained wrong-shard `online`: still dropped.
        await a.set_shards({0, 1, 2})
        await eventually(lambda: a.counters.get("dropped_wrong_shard", 0) == 1)
        assert len(seen_a.of(device_id)) == 1
        await dev.abort()


@needs_mosquitto
async def test_shards_hold_across_a_broker_restart_and_can_be_set_while_down(
    tmp_path: Path,
) -> None:
    async with (
        sharded_broker(tmp_path, RAW_PASSWORDS) as broker,
        two_transports(broker, {1}, None) as ((a, seen_a), (b, _)),
    ):
        assert b.owned_shards is None  # all: the default
        await broker.broker.kill()
        await eventually(lambda: not a.connected)
        await a.set_shards({1, 3})  # while disconnected: taken on reconnect
        await broker.broker.start()
        await a.wait_connected(WAIT_S)
        async with (
            raw_device(broker.port, RAW_KEYS[1]),
            raw_device(broker.port, RAW_KEYS[3]),
            raw_device(broker.port, RAW_KEYS[0]),
        ):
            ids = {device_id_for(INDEX_OF_SHARD[s]) for s in (0, 1, 3)}
            await eventually(lambda: b.links().keys() == ids, what="B serves every shard")
            wanted = {device_id_for(INDEX_OF_SHARD[s]) for s in (1, 3)}
            await eventually(lambda: a.links().keys() == wanted, what="A: shards 1 and 3")
            assert seen_a.of(device_id_for(INDEX_OF_SHARD[0])) == []


async def test_set_shards_refuses_shards_outside_the_count() -> None:
    transport = MqttTransport(
        transport_settings("mqtt://127.0.0.1:1", shards=SHARDS), Admission(BrokerVouched())
    )
    for bad in ({4}, {-1}, {True}):
        with pytest.raises(MqttConfigError):
            await transport.set_shards(bad)
    await transport.set_shards(set())  # none at all is a valid share
    assert transport.owned_shards == frozenset()


# ---- two whole bridges, simulated firmware devices, tool calls ----------------------------------


def _password(device_id: str) -> str:
    from backend.transports.mqtt_credentials import DerivedCredentials

    return DerivedCredentials(SECRET.encode()).issue(device_id).password


@contextlib.asynccontextmanager
async def running_bridge(data_dir: Path, broker_url: str, client_id: str) -> AsyncIterator[Bridge]:
    settings = make_settings(
        data_dir,
        mqtt_url=broker_url,
        mqtt_client_id=client_id,
        mqtt_shards=SHARDS,
        mqtt_secret=SECRET,
        udp_host="127.0.0.1",
        udp_port=0,
    )
    bridge = Bridge(settings, Tokens(ADMIN_TOKEN, DEVICE_TOKEN))
    await bridge.start()
    try:
        yield bridge
    finally:
        await bridge.stop()


def simulated(url: str, index: int) -> SimulatedDevice:
    """A device running the firmware's MQTT code, configured like `mqtt credentials` says:
    its `topic_prefix` is its shard's."""
    prefix = SCHEME.device_prefix(key_of(index))
    device = SimulatedDevice(
        url, None, index, reconnect_min_s=0.1, mqtt=MqttOptions(_password, topic_prefix=prefix)
    )
    device.app.reconnect_max_s = 1.0
    device.start()
    return device


async def _set_volume(bridge: Bridge, device_id: str, volume: int) -> Any:
    device = await bridge.registry.wait_for_state(device_id, timeout_s=WAIT_S)
    result = await device.call_tool("self.audio_speaker.set_volume", {"volume": volume})
    assert not result.is_error, result
    return result


@needs_mosquitto
async def test_two_bridges_share_the_devices_by_shard(tmp_path: Path) -> None:
    indexes = list(INDEX_OF_SHARD.values())
    logins = {key_of(i): _password(device_id_for(i)) for i in indexes}
    async with (
        sharded_broker(tmp_path / "mosquitto", logins) as broker,
        running_bridge(tmp_path / "a", broker.url(0), "bridge-a") as bridge_a,
        running_bridge(tmp_path / "b", broker.url(1), "bridge-b") as bridge_b,
    ):
        assert bridge_a.mqtt is not None and bridge_b.mqtt is not None
        await bridge_a.mqtt.set_shards({0, 1})
        await bridge_b.mqtt.set_shards({2, 3})
        url = f"mqtt://127.0.0.1:{broker.port}"
        devices = {shard: simulated(url, index) for shard, index in INDEX_OF_SHARD.items()}
        try:
            owner = {0: bridge_a, 1: bridge_a, 2: bridge_b, 3: bridge_b}
            for shard, device in devices.items():
                other = bridge_b if owner[shard] is bridge_a else bridge_a
                await _set_volume(owner[shard], device.device_id, 10 + shard)
                assert device.hal.volume == 10 + shard
                assert other.registry.get(device.device_id) is None

            # Shard 3 moves from B to A at run time.
            moving = devices[3]
            connections = moving.app.connections
            await bridge_b.mqtt.set_shards({2})
            await bridge_a.mqtt.set_shards({0, 1, 3})
            await _set_volume(bridge_a, moving.device_id, 33)
            assert moving.hal.volume == 33
            await eventually(lambda: bridge_b.registry.get(moving.device_id) is None)
            assert moving.app.connections == connections  # no new broker connection
            # The others stayed where they were.
            await _set_volume(bridge_b, devices[2].device_id, 22)
            assert bridge_a.registry.get(devices[2].device_id) is None
        finally:
            for device in devices.values():
                await device.stop()
