"""A cluster through a database outage and a broker cut (docs/cluster.md, "Failure model").

- An instance cut off from PostgreSQL that still hears the broker keeps its devices and serves
  calls; its leases are written back when the database returns; no device is ever live on two
  instances (sampled every 10 ms).
- Cut off from both, it cannot tell whether it still owns its devices: it fences, they move.
- The database away for every instance: no device is disconnected, calls keep succeeding, a new
  device is refused until it returns and then comes in.
- Leases purged during a long outage are written back by their owner (the store, directly).
- A broker that stops answering fails forwarded calls in flight at once with a clear error, and
  the remote devices stop being listed as ready until it answers again.

Real instances in this process on a real PostgreSQL and Mosquitto; the cuts are TCP proxies
(tests/cluster_helpers.py `Partition`)."""

import asyncio
import time

import pytest

from backend.cluster import CLUSTER_MIGRATIONS, LeaseTable
from backend.devices.state import DeviceEvent, EventKind
from backend.server import Bridge
from backend.storage import Database
from simulator import SimulatedDevice
from testkit.cluster import DEFAULT_LEASES, Cluster, Partition, until
from testkit.settings import DEVICE_TOKEN
from tests.cluster_helpers import cluster, database_proxy, devices, start_device

# Fixtures shared by the cluster tests (tests/cluster_helpers.py).
__all__ = ["cluster", "database_proxy", "devices"]

VOLUME = "self.audio_speaker.set_volume"


def state_on(bridge: Bridge, device_id: str) -> str | None:
    found = bridge.registry._live.get(device_id) or bridge.registry._remote.get(device_id)
    return None if found is None else found.state.value


def claimed(*bridges: Bridge) -> set[str]:
    """The devices whose lease an instance holds (a connect is live before it is claimed)."""
    return {i for bridge in bridges for i in bridge.cluster._epochs}  # type: ignore[union-attr]


def through(proxy: Partition, postgres_url: str) -> str:
    database = postgres_url.split("@/", 1)[1].split("?", 1)[0]
    return f"postgresql://bridge@127.0.0.1:{proxy.port}/{database}"


class Watch:
    """Samples every 10 ms: devices live on two instances at once; and counts the local
    disconnects of the devices watched."""

    def __init__(self, bridges: list[Bridge], watched: list[str]) -> None:
        self.bridges = bridges
        self.watched = set(watched)
        self.overlaps: list[set[str]] = []
        self.disconnects = 0
        self._unsubscribe = [bridge.registry.subscribe(self._on_event) for bridge in bridges]
        self._task = asyncio.create_task(self._sample())

    def _on_event(self, event: DeviceEvent) -> None:
        if (
            event.origin is None
            and event.kind is EventKind.DISCONNECTED
            and event.device_id in self.watched
        ):
            self.disconnects += 1

    async def _sample(self) -> None:
        while True:
            seen: set[str] = set()
            for bridge in self.bridges:
                live = set(bridge.registry._live)
                self.overlaps.append(seen & live)
                seen |= live
            await asyncio.sleep(0.01)

    def stop(self) -> None:
        self._task.cancel()
        for unsubscribe in self._unsubscribe:
            unsubscribe()

    @property
    def owned_twice(self) -> set[str]:
        return set().union(*self.overlaps)


async def call(cluster: Cluster, via: str, device_id: str, volume: int) -> int:
    async with cluster.api(via) as api:
        reply = await api.post(
            f"/api/devices/{device_id}/tools/call",
            json={"name": VOLUME, "arguments": {"volume": volume}},
        )
    return reply.status_code


async def leases_match_links(cluster: Cluster, ids: list[str]) -> bool:
    """Every device has one lease, held by the instance it is live on."""
    leases = await next(iter(cluster.bridges.values())).cluster.leases.leases()  # type: ignore[union-attr]
    held = {lease.device_id: lease.instance_id for lease in leases}
    live = {
        device_id: name
        for name, bridge in cluster.bridges.items()
        for device_id in bridge.registry._live
    }
    return sorted(held) == sorted(ids) and held == {i: live.get(i) for i in ids}


@pytest.mark.parametrize("mode", ["refuse", "blackhole"])
async def test_an_instance_cut_off_from_postgres_keeps_its_devices_while_it_hears_the_broker(
    cluster: Cluster,
    devices: list[SimulatedDevice],
    database_proxy: Partition,
    postgres_url: str,
    mode: str,
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b", database_url=through(database_proxy, postgres_url))
    ids = [start_device(devices, cluster.balancer.url, i).device_id for i in range(30, 38)]
    await until(lambda: all(state_on(a, i) == "ready" for i in ids), what="ready")
    on_b = sorted(b.registry._live)
    assert on_b, "the balancer gave b its share"
    watch = Watch([a, b], ids)
    database_proxy.cut(mode)
    await until(lambda: b.cluster.riding_through, what="b riding through")  # type: ignore[union-attr]
    await asyncio.sleep(cluster.bridges["b"].settings.lease_ttl_s * 2)  # well past the lease
    assert b.cluster is not None and not b.cluster.fenced
    assert sorted(b.registry._live) == on_b and watch.disconnects == 0
    statuses = [await call(cluster, via, on_b[0], 20 + n) for n, via in enumerate("ab")]
    assert statuses == [200, 200]  # served by b, and forwarded to b from a
    async with cluster.api("b") as api:
        assert (await api.get("/readyz")).status_code == 200
    database_proxy.heal()
    await until(lambda: not b.cluster.riding_through, timeout_s=15, what="b reconciled")  # type: ignore[union-attr]
    await until(lambda: a.cluster._renewed_at > b.cluster._renewed_at, what="a renewed after b")  # type: ignore[union-attr]
    watch.stop()
    assert not watch.owned_twice, "a device was live on both instances"
    assert watch.disconnects == 0
    assert await leases_match_links(cluster, ids)


async def test_an_instance_cut_off_from_postgres_and_the_broker_fences_and_none_is_owned_twice(
    cluster: Cluster,
    devices: list[SimulatedDevice],
    database_proxy: Partition,
    postgres_url: str,
) -> None:
    broker_proxy = Partition(port=cluster.broker.port)
    await broker_proxy.start()
    try:
        a = await cluster.start("a")
        account = cluster.accounts["b"]
        b = await cluster.start(
            "b",
            database_url=through(database_proxy, postgres_url),
            cluster_url=f"mqtt://{account.username}:{account.password}@127.0.0.1:{broker_proxy.port}",
        )
        ids = [start_device(devices, cluster.balancer.url, i).device_id for i in range(40, 48)]
        await until(lambda: claimed(a, b) == set(ids), what="every device claimed")
        assert len(b.registry) > 0
        watch = Watch([a, b], ids)
        database_proxy.cut("refuse")
        broker_proxy.cut("refuse")
        await until(lambda: len(a.registry._live) == len(ids), timeout_s=30, what="all on a")
        watch.stop()
        assert b.cluster is not None and b.cluster.fenced and len(b.registry) == 0
        assert not watch.owned_twice, "a device was live on both instances"
        async with cluster.api("b") as api:
            ready = await api.get("/readyz")
        assert ready.status_code == 503 and "database" in ready.json()["error"]["message"]
        database_proxy.heal()
        broker_proxy.heal()
        await until(lambda: not b.cluster.fenced, timeout_s=15, what="b unfenced")  # type: ignore[union-attr]
        assert await leases_match_links(cluster, ids)
    finally:
        broker_proxy.heal()
        await broker_proxy.stop()


async def test_the_database_away_for_every_instance_disconnects_no_device(
    cluster: Cluster,
    devices: list[SimulatedDevice],
    database_proxy: Partition,
    postgres_url: str,
) -> None:
    url = through(database_proxy, postgres_url)
    # Every call must succeed: a broker link dropped by a loaded machine would fail some.
    a = await cluster.start("a", database_url=url, **DEFAULT_LEASES)
    b = await cluster.start("b", database_url=url, **DEFAULT_LEASES)
    ids = [start_device(devices, cluster.balancer.url, i).device_id for i in range(50, 56)]
    await until(lambda: claimed(a, b) == set(ids), what="every device claimed")
    await until(lambda: all(state_on(x, i) == "ready" for x in (a, b) for i in ids), what="ready")
    on_b = next(iter(b.registry._live))
    on_a = next(iter(a.registry._live))
    watch = Watch([a, b], ids)
    database_proxy.cut("blackhole")
    statuses: list[int] = []
    deadline = time.monotonic() + a.settings.lease_ttl_s * 2.5
    n = 0
    while time.monotonic() < deadline:
        for via, device_id in (("a", on_b), ("a", on_a), ("b", on_a)):
            statuses.append(await call(cluster, via, device_id, n % 100))
            n += 1
        await asyncio.sleep(0.1)
    assert a.cluster is not None and b.cluster is not None
    assert a.cluster.riding_through and b.cluster.riding_through
    assert watch.disconnects == 0 and set(statuses) == {200}, statuses
    late = start_device(devices, cluster.balancer.url, 57)  # refused until the database is back
    await asyncio.sleep(1.0)
    assert not any(late.device_id in x.registry._live for x in (a, b))
    database_proxy.heal()
    await until(lambda: any(late.device_id in x.registry._live for x in (a, b)),
                timeout_s=20, what="the late device in")  # fmt: skip
    await until(lambda: not a.cluster.riding_through and not b.cluster.riding_through,  # type: ignore[union-attr]
                what="both reconciled")  # fmt: skip
    watch.stop()
    assert watch.disconnects == 0 and not watch.owned_twice
    await until(lambda: claimed(a, b) == {*ids, late.device_id}, what="the late one claimed")
    assert await leases_match_links(cluster, [*ids, late.device_id])


async def test_leases_purged_in_a_long_outage_are_written_back_by_their_owner(
    postgres_url: str,
) -> None:
    database = Database(postgres_url, CLUSTER_MIGRATIONS)
    await database.open()
    try:
        a = LeaseTable(database, "a", ttl_s=3.0)
        b = LeaseTable(database, "b", ttl_s=3.0)
        start = 1000.0
        await a.join(None, start)
        await b.join(None, start)
        epochs = await a.claim([("dev-1", "websocket"), ("dev-2", "mqtt")], start)
        await b.claim([("dev-3", "websocket")], start)
        await a.release("dev-2", epochs["dev-2"])  # ... as if: a release that failed
        back = start + 90  # both away for 90 s: b renews first and purges a's expired leases
        await b.renew(back, 0, None)
        assert {lease.device_id for lease in await a.leases()} == {"dev-3"}
        held = {"dev-1": (epochs["dev-1"], "websocket"), "dev-4": (7, "websocket")}
        renewal = await a.renew(back + 0.1, 0, None, held=held)
        assert renewal.devices == {"dev-1": epochs["dev-1"], "dev-4": 7}
        rows = {lease.device_id: lease for lease in await a.leases()}
        assert {i: (r.instance_id, r.expires_at) for i, r in rows.items()} == {
            "dev-1": ("a", back + 0.1 + 3.0),
            "dev-3": ("b", back + 3.0),
            "dev-4": ("a", back + 0.1 + 3.0),
        }
        # A lease another instance took meanwhile is not written over.
        await b.claim([("dev-1", "websocket")], back + 1)
        renewal = await a.renew(back + 2, 0, None, held=held)
        assert "dev-1" not in renewal.devices
        # Nor is a lease of a device a no longer serves kept.
        await a.claim([("dev-5", "websocket")], back + 2)
        renewal = await a.renew(back + 3, 0, None, held={"dev-4": (7, "websocket")})
        assert set(renewal.devices) == {"dev-4"}
    finally:
        await database.close()


async def test_a_broker_that_stops_answering_fails_forwarded_calls_at_once(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    broker_proxy = Partition(port=cluster.broker.port)
    await broker_proxy.start()
    try:
        account = cluster.accounts["a"]
        a = await cluster.start(
            "a",
            cluster_url=f"mqtt://{account.username}:{account.password}@127.0.0.1:{broker_proxy.port}",
        )
        b = await cluster.start("b")
        device = SimulatedDevice(b.ws_url, DEVICE_TOKEN, index=60, extra_tools=1)
        devices.append(device)
        device.start()
        await until(lambda: state_on(a, device.device_id) == "ready")

        async def slow_call() -> tuple[int, dict[str, object]]:
            async with cluster.api("a") as api:
                reply = await api.post(
                    f"/api/devices/{device.device_id}/tools/call",
                    json={"name": "sim.synthetic_000",
                          "arguments": {"value": 1, "delay_ms": 8000}},
                )  # fmt: skip
            return reply.status_code, reply.json()

        pending = asyncio.create_task(slow_call())
        await until(lambda: a.cluster._pending, what="the call forwarded")  # type: ignore[union-attr]
        broker_proxy.cut("blackhole")
        status, body = await pending
        # Not the device's deadline (504 after 8 s): the broker probe failed it, or,
        # on a loaded machine where the cut lands before the publish is acknowledged,
        # the publish itself timed out; either way the call fails on the broker.
        assert status == 503, body
        assert "cluster broker" in str(body["error"]), body
        # The keepalive then drops the link: b's device is no longer listed ready on a.
        await until(lambda: state_on(a, device.device_id) != "ready", timeout_s=15,
                    what="the remote device not ready on a")  # fmt: skip
        broker_proxy.heal()
        await until(lambda: state_on(a, device.device_id) == "ready", timeout_s=15,
                    what="ready on a again")  # fmt: skip
    finally:
        broker_proxy.heal()
        await broker_proxy.stop()
