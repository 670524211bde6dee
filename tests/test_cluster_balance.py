"""Moving devices between instances (backend/cluster/balance.py): the fair-share and shard-target
arithmetic, a hitless drain under calls every 20 ms, a joining instance taking its share."""

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from backend.cluster.balance import (
    fair_share,
    rebalance_excess,
    serving_instances,
    shard_target,
)
from backend.devices.state import DeviceState
from backend.server import Bridge
from backend.transports.mqtt_credentials import BridgeAccount
from simulator import SimulatedDevice
from testkit.cluster import DEFAULT_LEASES, FAST_LEASES, Cluster, running_cluster, until
from testkit.haproxy import ADMIN_PORT, OTA_PORT, WS_PORT, HAProxy, InstancePorts, haproxy_binary
from testkit.mosquitto import Mosquitto
from testkit.ports import reserve_port
from testkit.settings import DEVICE_TOKEN, make_settings
from tests.cluster_helpers import devices, start_device

# Fixtures shared by the cluster tests (tests/cluster_helpers.py).
__all__ = ["devices"]

VOLUME = "self.audio_speaker.set_volume"
FLEET = int(os.environ.get("BALANCE_TEST_FLEET", "12"))  # the HAProxy drain test's devices


# ---- the arithmetic ---------------------------------------------------------------------------


def test_fair_share() -> None:
    assert fair_share(10, 2) == 5
    assert fair_share(10, 3) == pytest.approx(3.333, abs=1e-3)
    assert fair_share(7, 0) == 7  # no instance counted: all of it


@pytest.mark.parametrize(
    ("mine", "total", "instances", "excess"),
    [
        (10, 10, 2, 5),  # a joiner next to 10 devices: half of them move
        (300, 300, 3, 200),
        (6, 10, 2, 0),  # 6 of 10: over the share by 1 only (hysteresis)
        (5, 10, 2, 0),  # at the share
        (4, 10, 2, 0),  # under it: never shed
        (10, 10, 1, 0),  # alone: nowhere to go
        (0, 0, 3, 0),
        (110, 200, 2, 0),  # within the 10 % tolerance
        (111, 200, 2, 11),  # just over it: down to the share, not below
        (4, 10, 3, 0),  # 4 vs 3.33: not 3 devices over
        (7, 10, 3, 3),  # 7 vs 3.33: down to ceil(3.33) = 4
    ],
)
def test_rebalance_excess(mine: int, total: int, instances: int, excess: int) -> None:
    assert rebalance_excess(mine, total, instances) == excess
    if excess:  # never below the fair share
        assert mine - excess >= fair_share(total, instances)


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5, 8, 16, 1024])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_shard_targets_sum_to_the_shard_count_and_differ_by_at_most_one(
    shards: int, count: int
) -> None:
    ids = [f"bridge-{i}" for i in range(count)]
    targets = [shard_target(shards, ids, me) for me in ids]
    assert sum(targets) == shards
    assert max(targets) - min(targets) <= 1


def test_four_shards_over_three_instances_leave_none_without() -> None:
    ids = ["a", "b", "c"]
    assert [shard_target(4, ids, me) for me in ids] == [2, 1, 1]
    # A joiner not yet in the rows counts itself.
    assert shard_target(4, ["a", "b"], "c") == 1


@dataclass
class Row:
    instance_id: str
    heartbeat_at: float
    draining: bool = False


def test_serving_instances_are_alive_and_not_draining() -> None:
    now = 1000.0
    rows = [
        Row("a", now - 1),
        Row("b", now - 1, draining=True),
        Row("c", now - 10),  # silent past the TTL
        Row("d", now - 0.5),
    ]
    assert serving_instances(rows, "a", now, 6.0) == ["a", "d"]
    assert serving_instances(rows, "a", now, 6.0, me_serving=False) == ["d"]
    assert serving_instances(rows, "e", now, 6.0) == ["a", "d", "e"]


# ---- in-process clusters ----------------------------------------------------------------------


@pytest.fixture
async def cluster(tmp_path: Path, postgres_url: str) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path, postgres_url) as running:
        running.balancer.leastconn = True  # like deploy/haproxy.cfg
        yield running


def ready_on(cluster: Cluster, name: str, device_id: str) -> bool:
    device = cluster.bridges[name].registry.get(device_id)
    return device is not None and device.state is DeviceState.READY


def seen_ready(bridge: Bridge, device_id: str) -> bool:
    """Ready in this instance's fleet view, connected here or to another instance."""
    device = bridge.registry.get(device_id) or bridge.registry.remote(device_id)
    return device is not None and device.state is DeviceState.READY


async def test_a_drain_under_calls_every_20_ms_fails_none_and_moves_the_device(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    # The default lease (and so a 3 s broker keepalive): on a loaded machine a 2 s keepalive can
    # drop the broker link mid-test, and a call across it fails whatever the drain does.
    a = await cluster.start("a", drain_notice_s=0.5, **DEFAULT_LEASES)
    # The firmware's own reconnect pause (1 s): the device is away that long while it moves.
    device = SimulatedDevice(cluster.balancer.url, DEVICE_TOKEN, index=20, extra_tools=1)
    devices.append(device)
    device.start()
    await a.registry.wait_for_state(device.device_id)
    b = await cluster.start("b", **DEFAULT_LEASES)
    await until(
        lambda: b.registry.remote(device.device_id) is not None, what="the device in b's view"
    )
    outcomes: list[tuple[str, int, str]] = []
    stop = asyncio.Event()
    path = f"/api/devices/{device.device_id}/tools/call"

    async def call(api: httpx.AsyncClient, name: str, body: dict[str, object]) -> None:
        try:
            reply = await api.post(path, json=body)
            outcomes.append((name, reply.status_code, reply.text[:200]))
        except httpx.HTTPError as exc:
            outcomes.append((name, 0, repr(exc)))

    async def caller(name: str) -> None:
        async with cluster.api(name) as api:
            index = 0
            while not stop.is_set():
                index += 1
                body = {"name": VOLUME, "arguments": {"volume": index % 100}}
                await call(api, name, body)
                await asyncio.sleep(0.02)

    # Through the draining instance (its API keeps answering) and through the other one.
    callers = [asyncio.create_task(caller(name)) for name in "ab"]
    await asyncio.sleep(0.3)
    started = time.monotonic()
    assert a.cluster is not None
    a.cluster.start_drain()  # readiness 503 at once
    drain = asyncio.create_task(a.cluster.drain())  # joins it, returns when done
    # In flight when the device is due to move: it finishes first (the move waits for it).
    async with cluster.api("b") as api:
        slow = asyncio.create_task(
            call(api, "slow", {"name": "sim.synthetic_000", "arguments": {"delay_ms": 1500}})
        )
        # The test balancer has no health check: it drops a at once (HAProxy within the notice).
        cluster.balancer.backends.remove(("127.0.0.1", a.websocket.port))
        assert a.cluster.health() == "draining"
        await asyncio.sleep(0.1)
        assert a.registry.get(device.device_id) is not None  # still served during the notice
        told = await drain
        drained_s = time.monotonic() - started
        await slow
    await until(lambda: ready_on(cluster, "b", device.device_id), timeout_s=10, what="on b")
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.gather(*callers)
    failed = [outcome for outcome in outcomes if outcome[1] != 200]
    print(f"drain: {len(outcomes)} calls, {len(failed)} failed, drain {drained_s:.2f} s")
    assert told == 1 and len(a.registry) == 0
    assert failed == [], failed[:5]
    assert drained_s >= 1.5  # the slow call held the move
    # Both instances' APIs took calls all along (how many in the time depends on the load).
    for name in "ab":
        mine = [outcome for outcome in outcomes if outcome[0] == name]
        assert len(mine) >= 10, (name, len(mine))
    progress = (await a.cluster.status())["drain"]
    assert progress["phase"] == "done" and progress["devices_told"] == 1


async def test_a_joining_instance_takes_about_half_of_the_devices(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a", cluster_rebalance=True, rebalance_rate_per_s=20)
    ids = [start_device(devices, cluster.balancer.url, 40 + i).device_id for i in range(10)]
    await until(lambda: all(ready_on(cluster, "a", i) for i in ids), what="10 devices on a")
    b = await cluster.start("b", cluster_rebalance=True, rebalance_rate_per_s=20)
    await until(
        lambda: len(b.registry) >= 4 and len(a.registry) + len(b.registry) == 10,
        timeout_s=20,
        what="b took about half",
    )
    await asyncio.sleep(2)  # a few more renewals: no oscillation
    assert {len(a.registry), len(b.registry)} <= {4, 5, 6}, (len(a.registry), len(b.registry))
    assert len(a.registry) + len(b.registry) == 10
    assert a.cluster is not None and 4 <= a.cluster.rebalancer.moved <= 6


async def test_rebalancing_can_be_turned_off(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a", cluster_rebalance=False)
    ids = [start_device(devices, cluster.balancer.url, 60 + i).device_id for i in range(6)]
    await until(lambda: all(ready_on(cluster, "a", i) for i in ids), what="6 devices on a")
    b = await cluster.start("b", cluster_rebalance=False)
    await asyncio.sleep(2.5)  # several renewals (FAST_LEASES: every 0.5 s)
    assert len(a.registry) == 6 and len(b.registry) == 0


async def test_a_stop_signal_drains_first_then_stops(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a", drain_notice_s=0.2)
    device = start_device(devices, cluster.balancer.url, 80)
    await a.registry.wait_for_state(device.device_id)
    await cluster.start("b")
    cluster.balancer.backends.remove(("127.0.0.1", a.websocket.port))
    stop = asyncio.Event()
    serving = asyncio.create_task(a.serve_forever(stop))  # what `serve` runs until SIGTERM
    stop.set()
    await until(lambda: ready_on(cluster, "b", device.device_id), timeout_s=10, what="on b")
    await asyncio.wait_for(serving, 10)
    assert a.cluster is not None and a.cluster.drain_progress is not None
    assert a.cluster.drain_progress.devices_told == 1  # moved by the drain, not by the stop
    del cluster.bridges["a"]  # stopped already


@pytest.mark.skipif(haproxy_binary() is None, reason="HAProxy is not installed")
async def test_a_drain_behind_the_shipped_haproxy_under_calls_every_20_ms_fails_none(
    cluster: Cluster, tmp_path: Path, devices: list[SimulatedDevice]
) -> None:
    """The shipped deploy/haproxy.cfg (health checks every 2 s, fall 2) and the default
    drain_notice_s: the drained instance's devices reconnect straight to the other one."""
    bridges = {name: await cluster.start(name) for name in "ab"}
    binds = {WS_PORT: reserve_port(cluster), OTA_PORT: reserve_port(cluster)}
    binds[ADMIN_PORT] = reserve_port(cluster)
    ports = {
        f"bridge-{name}": InstancePorts(
            {
                WS_PORT: bridge.websocket.port,
                OTA_PORT: urlsplit(bridge.provisioning.ota_url).port or 0,
                ADMIN_PORT: bridge.http_port,
            }
        )
        for name, bridge in bridges.items()
    }
    haproxy = HAProxy.shipped(tmp_path / "haproxy", ports, binds)
    await haproxy.start(binds[WS_PORT])
    try:
        url = f"ws://127.0.0.1:{binds[WS_PORT]}/xiaozhi/v1/"
        fleet = [SimulatedDevice(url, DEVICE_TOKEN, index=100 + i) for i in range(FLEET)]
        for device in fleet:
            devices.append(device)
            device.start()
        ids = [device.device_id for device in fleet]

        def everywhere_ready() -> bool:
            return all(seen_ready(bridges[n], i) for n in "ab" for i in ids)

        await until(everywhere_ready, timeout_s=20 + FLEET / 10, what="ready in both views")
        drained = max("ab", key=lambda n: len(bridges[n].registry))
        (other,) = set("ab") - {drained}
        outcomes: list[int] = []
        stop = asyncio.Event()

        async def caller(name: str) -> None:
            async with cluster.api(name) as api:
                index = 0
                while not stop.is_set():
                    index += 1
                    device_id = ids[index % len(ids)]
                    try:
                        reply = await api.post(
                            f"/api/devices/{device_id}/tools/call",
                            json={"name": VOLUME, "arguments": {"volume": index % 100}},
                        )
                        outcomes.append(reply.status_code)
                    except httpx.HTTPError:
                        outcomes.append(0)
                    await asyncio.sleep(0.02)

        callers = [asyncio.create_task(caller(name)) for name in "ab"]
        await asyncio.sleep(0.5)
        moving = len(bridges[drained].registry)
        started = time.monotonic()
        node = bridges[drained].cluster
        assert node is not None
        told = await node.drain()
        drained_s = time.monotonic() - started
        await until(
            lambda: all(ready_on(cluster, other, i) for i in ids), timeout_s=15, what="all moved"
        )
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*callers)
        failed = sum(1 for status in outcomes if status != 200)
        print(
            f"haproxy drain: {moving} devices moved in {drained_s:.2f} s,"
            f" {len(outcomes)} calls, {failed} failed"
        )
        assert told == moving > 0
        assert failed == 0
    finally:
        await haproxy.stop()


async def test_four_mqtt_shards_over_three_instances_are_2_1_1_and_a_drain_hands_them_over(
    tmp_path: Path, postgres_url: str
) -> None:
    shards = 4
    accounts = {f"{kind}-{name}": BridgeAccount(f"{kind}-{name}")
                for kind in ("transport", "cluster") for name in "abc"}  # fmt: skip
    mosquitto = Mosquitto(
        tmp_path / "broker", {}, more_bridges=tuple(accounts.values()), shards=shards
    )
    await mosquitto.start()
    bridges: dict[str, Bridge] = {}
    try:
        for name in "abc":
            settings = make_settings(
                tmp_path / name,
                database_url=postgres_url,
                cluster_url=mosquitto.url_of(accounts[f"cluster-{name}"]),
                instance_id=name,
                mqtt_url=mosquitto.url_of(accounts[f"transport-{name}"]),
                mqtt_client_id=f"transport-{name}",
                mqtt_shards=shards,
                mqtt_secret="mqtt-secret-for-the-balance-tests-0123456789",
                udp_host="127.0.0.1",
                udp_port=0,
                drain_notice_s=0.2,
                **FAST_LEASES,
            )
            bridges[name] = Bridge(settings)
            await bridges[name].start()

        def owned() -> dict[str, int]:
            return {n: len(b.cluster.shards) for n, b in bridges.items() if b.cluster}

        await until(
            lambda: owned() == {"a": 2, "b": 1, "c": 1}, timeout_s=15, what="shards 2, 1, 1"
        )
        sets = [b.cluster.shards for b in bridges.values() if b.cluster]
        assert len(frozenset().union(*sets)) == shards
        node = bridges["a"].cluster
        assert node is not None
        await node.drain()
        await until(
            lambda: owned() == {"a": 0, "b": 2, "c": 2}, timeout_s=15, what="a's shards moved"
        )
    finally:
        for bridge in bridges.values():
            with contextlib.suppress(Exception):
                await bridge.stop()
        await mosquitto.stop()


async def test_rebalancing_pauses_when_the_devices_it_moves_come_back(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    # Devices that connect to a directly (no balancer) land on a again: moving more would churn.
    a = await cluster.start("a", cluster_rebalance=True, rebalance_rate_per_s=20)
    ids = [start_device(devices, a.ws_url, 70 + i).device_id for i in range(10)]
    await until(lambda: all(ready_on(cluster, "a", i) for i in ids), what="10 devices on a")
    await cluster.start("b", cluster_rebalance=True, rebalance_rate_per_s=20)
    assert a.cluster is not None
    rebalancer = a.cluster.rebalancer
    await until(lambda: rebalancer.moved > 0, timeout_s=10, what="a first batch moved")
    await until(lambda: rebalancer.paused_until > 0, timeout_s=15, what="rebalancing paused")
    moved = rebalancer.moved
    await asyncio.sleep(3)  # several renewals: nothing more is moved
    assert rebalancer.moved == moved
    await until(lambda: all(ready_on(cluster, "a", i) for i in ids), what="all back on a")
