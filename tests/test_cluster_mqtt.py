"""MQTT devices in a cluster: instances share the shards by lease (a fair share each), a shard
moves when an instance joins or leaves, and its devices come up on the new owner without
reconnecting to the broker; calls reach them from any instance. Real Mosquitto, PostgreSQL,
the firmware's MQTT code."""

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backend.server import Bridge
from backend.transports.mqtt_credentials import BridgeAccount, DerivedCredentials
from backend.transports.mqtt_topics import TopicScheme, device_key
from simulator import MqttOptions, SimulatedDevice
from simulator.fleet import device_id_for
from testkit.cluster import FAST_LEASES, until
from testkit.mosquitto import Mosquitto
from testkit.settings import make_settings

SHARDS = 4
SCHEME = TopicScheme("xiaozhi", SHARDS)
SECRET = "mqtt-secret-for-the-cluster-tests-0123456789"


def _password(device_id: str) -> str:
    return DerivedCredentials(SECRET.encode()).issue(device_id).password


def one_index_per_shard() -> dict[int, int]:
    found: dict[int, int] = {}
    index = 1
    while len(found) < SHARDS:
        found.setdefault(SCHEME.shard_of(device_key(device_id_for(index))), index)
        index += 1
    return found


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[tuple[Mosquitto, dict[str, BridgeAccount]]]:
    indexes = one_index_per_shard().values()
    logins = {device_key(device_id_for(i)): _password(device_id_for(i)) for i in indexes}
    # Two accounts per instance: its MQTT transport's and its cluster channel's (with
    # use_username_as_clientid, two clients of one account would replace each other).
    accounts = {f"{kind}-{name}": BridgeAccount(f"{kind}-{name}")
                for kind in ("transport", "cluster") for name in "ab"}  # fmt: skip
    mosquitto = Mosquitto(
        tmp_path / "broker", logins, more_bridges=tuple(accounts.values()), shards=SHARDS
    )
    await mosquitto.start()
    try:
        yield mosquitto, accounts
    finally:
        await mosquitto.stop()


async def test_instances_share_the_mqtt_shards_and_hand_them_over(
    tmp_path: Path,
    postgres_url: str,
    broker: tuple[Mosquitto, dict[str, BridgeAccount]],
) -> None:
    mosquitto, accounts = broker
    bridges: dict[str, Bridge] = {}
    devices: list[SimulatedDevice] = []

    async def start(name: str) -> Bridge:
        settings = make_settings(
            tmp_path / name,
            database_url=postgres_url,
            cluster_url=mosquitto.url_of(accounts[f"cluster-{name}"]),
            instance_id=name,
            mqtt_url=mosquitto.url_of(accounts[f"transport-{name}"]),
            mqtt_client_id=f"transport-{name}",
            mqtt_shards=SHARDS,
            mqtt_secret=SECRET,
            udp_host="127.0.0.1",
            udp_port=0,
            **FAST_LEASES,
        )
        bridge = Bridge(settings)
        await bridge.start()
        bridges[name] = bridge
        return bridge

    def owner_of(device_id: str) -> str | None:
        live = [n for n, b in bridges.items() if b.registry.get(device_id) is not None]
        ready = [n for n in live if bridges[n].registry.require(device_id).state.value == "ready"]
        return ready[0] if len(live) == 1 and ready else None

    try:
        a = await start("a")
        await until(lambda: a.cluster is not None and len(a.cluster.shards) == SHARDS,
                    what="a alone owns every shard")  # fmt: skip
        url = f"mqtt://127.0.0.1:{mosquitto.port}"
        by_shard = {}
        for shard, index in one_index_per_shard().items():
            device_id = device_id_for(index)
            prefix = SCHEME.device_prefix(device_key(device_id))
            device = SimulatedDevice(
                url, None, index, reconnect_min_s=0.1,
                mqtt=MqttOptions(_password, topic_prefix=prefix),
            )  # fmt: skip
            device.start()
            devices.append(device)
            by_shard[shard] = device
        ids = [d.device_id for d in devices]
        await until(lambda: all(owner_of(i) == "a" for i in ids), what="all ready on a")
        connections = {d.device_id: d.app.connections for d in devices}

        b = await start("b")
        assert a.cluster is not None and b.cluster is not None
        await until(
            lambda: len(a.cluster.shards) == 2 and len(b.cluster.shards) == 2,  # type: ignore[union-attr]
            timeout_s=15, what="two shards each",
        )  # fmt: skip
        assert a.cluster.shards.isdisjoint(b.cluster.shards)
        for shard, device in by_shard.items():
            expected = "a" if shard in a.cluster.shards else "b"
            await until(lambda d=device, e=expected: owner_of(d.device_id) == e, timeout_s=15,
                        what=f"shard {shard}'s device ready on {expected}")  # fmt: skip
        # No device reconnected to the broker: only the bridges' subscriptions moved.
        assert {d.device_id: d.app.connections for d in devices} == connections

        # Any instance reaches any device: a call through a to a device of b's shards.
        on_b = next(d for s, d in by_shard.items() if s in b.cluster.shards)
        await until(
            lambda: any(d.device_id == on_b.device_id and d.state.value == "ready"
                        for d in a.registry.remote_devices()),
            what="b's device ready in a's fleet view",
        )  # fmt: skip
        result = await a.registry.require(on_b.device_id).call_tool(
            "self.audio_speaker.set_volume", {"volume": 44}
        )
        assert not result.is_error and on_b.hal.volume == 44

        # b leaves: a takes its shards back and serves every device again.
        await bridges.pop("b").stop()
        await until(lambda: len(a.cluster.shards) == SHARDS, timeout_s=15,  # type: ignore[union-attr]
                    what="a owns every shard again")  # fmt: skip
        await until(lambda: all(owner_of(i) == "a" for i in ids), timeout_s=15,
                    what="all ready on a again")  # fmt: skip
    finally:
        for device in devices:
            with contextlib.suppress(Exception):
                await device.stop()
        for bridge in bridges.values():
            await bridge.stop()
