"""Attacks on the cluster's channel. A device's broker account may publish only on its own
topics (the ACL), so it cannot forge calls, fleet events or an instance's departure; and garbage
from a peer instance's account is dropped without hurting the node."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiomqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from backend.cluster import wire
from simulator import SimulatedDevice
from testkit.cluster import Cluster, running_cluster, until
from testkit.settings import DEVICE_TOKEN

EVIL_KEY = "evil-device"
EVIL_PASSWORD = "evil-device-password-0123456789"


@pytest.fixture
async def cluster(tmp_path: Path, postgres_url: str) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path, postgres_url, {EVIL_KEY: EVIL_PASSWORD}) as running:
        yield running


@contextlib.asynccontextmanager
async def client(cluster: Cluster, username: str, password: str) -> AsyncIterator[aiomqtt.Client]:
    async with aiomqtt.Client(
        "127.0.0.1",
        cluster.broker.port,
        username=username,
        password=password,
        identifier=username,
        protocol=aiomqtt.ProtocolVersion.V5,
    ) as connected:
        yield connected


def call_properties(reply_to: str) -> Properties:
    properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    properties.ResponseTopic = reply_to
    properties.CorrelationData = b"forged"
    return properties


async def test_a_device_account_cannot_forge_calls_events_or_departures(
    cluster: Cluster,
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    device = SimulatedDevice(b.ws_url, DEVICE_TOKEN, index=80, reconnect_min_s=0.2)
    device.start()
    try:
        await b.registry.wait_for_state(device.device_id)
        await until(lambda: a.registry.require(device.device_id).state.value == "ready")
        before = device.hal.get_volume()
        topics = a.cluster.topics  # type: ignore[union-attr]
        forged_call = wire.call_request(
            device.device_id, "self.audio_speaker.set_volume", {"volume": 3}, None, "evil"
        )
        forged_report = {
            "v": 1, "kind": "ready", "device_id": "forged-device", "owner": "b", "epoch": 99,
            "state": "ready", "tools": [],
        }  # fmt: skip
        async with client(cluster, EVIL_KEY, EVIL_PASSWORD) as evil:
            await evil.publish(
                topics.rpc("b"), wire.dumps(forged_call), qos=1,
                properties=call_properties(f"xiaozhi/{EVIL_KEY}/down"),
            )  # fmt: skip
            await evil.publish(topics.events, wire.dumps(forged_report), qos=1)
            await evil.publish(topics.presence("b"), b"", qos=1, retain=True)  # "b left"
            await evil.publish(topics.sync, wire.dumps({"from": "a"}), qos=1)
        # A real call after the forged ones: when it is done, the forged ones had their chance.
        result = await a.registry.require(device.device_id).call_tool(
            "self.audio_speaker.set_volume", {"volume": before + 1}
        )
        assert not result.is_error
        await asyncio.sleep(0.3)
        assert device.hal.get_volume() == before + 1  # never 3
        assert b.cluster.counters["served"] == 1  # type: ignore[union-attr]
        assert a.registry.record("forged-device") is None
        assert a.registry.require(device.device_id).state.value == "ready"  # b not "gone"
    finally:
        await device.stop()


async def test_garbage_from_a_peer_account_is_dropped_and_the_node_carries_on(
    cluster: Cluster,
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    device = SimulatedDevice(b.ws_url, DEVICE_TOKEN, index=81, reconnect_min_s=0.2)
    device.start()
    try:
        await b.registry.wait_for_state(device.device_id)
        await until(lambda: a.registry.require(device.device_id).state.value == "ready")
        topics = b.cluster.topics  # type: ignore[union-attr]
        account = cluster.accounts["c"]  # a peer instance's account, not started
        async with client(cluster, account.username, account.password) as peer:
            for payload in (b"", b"\xff", b"[]", b'{"kind": "ready"}', b'{"reports": [1, "x"]}'):
                await peer.publish(topics.events, payload, qos=1)
                await peer.publish(topics.rpc("b"), payload, qos=1)  # no correlation
                await peer.publish(topics.reply("a"), payload, qos=1)
            await peer.publish(
                topics.rpc("b"), b'{"op": "call", "device_id": 5, "tool": null}', qos=1,
                properties=call_properties(topics.reply("c")),
            )  # fmt: skip
        result = await a.registry.require(device.device_id).call_tool(
            "self.audio_speaker.set_volume", {"volume": 42}
        )
        assert not result.is_error and device.hal.get_volume() == 42
    finally:
        await device.stop()
