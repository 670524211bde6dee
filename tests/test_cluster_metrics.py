"""`bridge_cluster_*` in `/metrics`: fenced, draining, broker connected, lease renew lag,
forwarded and served calls, devices owned, stale links closed, fences; only for a bridge in a
cluster. Scraped from real instances on PostgreSQL and Mosquitto and parsed with
prometheus_client's own parser."""

from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from backend import metrics
from backend.server import Bridge
from simulator import SimulatedDevice
from testkit.cluster import FAST_LEASES, Cluster, fleet_state, until
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from tests.cluster_helpers import cluster, devices

# Fixtures shared by the cluster tests (tests/cluster_helpers.py).
__all__ = ["cluster", "devices"]

GAUGES = {
    "bridge_cluster_fenced",
    "bridge_cluster_draining",
    "bridge_cluster_broker_connected",
    "bridge_cluster_lease_renew_lag_seconds",
    "bridge_cluster_devices_owned",
}
COUNTERS = {
    "bridge_cluster_forwarded_calls",
    "bridge_cluster_served_calls",
    "bridge_cluster_stale_links_closed",
    "bridge_cluster_fences",
}

Samples = dict[tuple[str, str], float]  # (sample name, instance_id) -> value


def cluster_samples(text: str) -> tuple[dict[str, str], Samples]:
    """The `bridge_cluster_*` families (name -> type) and their samples in a scrape."""
    families: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("bridge_cluster_"):
            continue
        families[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, sample.labels["instance_id"])] = sample.value
    return families, samples


async def scrape(bridge: Bridge) -> tuple[dict[str, str], Samples]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as http:
        answer = await http.get("/metrics")
    assert answer.status_code == 200, answer.text
    return cluster_samples(answer.text)


async def test_a_single_bridge_has_no_cluster_metrics(bridge: Bridge) -> None:
    families, samples = await scrape(bridge)
    assert families == {} and samples == {}


async def test_cluster_metrics_of_two_instances_while_calls_are_forwarded_and_one_drains(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    device = SimulatedDevice(b.ws_url, DEVICE_TOKEN, index=80, reconnect_min_s=0.2)
    devices.append(device)
    device.start()
    await b.registry.wait_for_state(device.device_id)
    await until(lambda: fleet_state(a, device.device_id) == "ready", what="on a")
    async with cluster.api("a") as api:
        for volume in (31, 32, 33):
            reply = await api.post(
                f"/api/devices/{device.device_id}/tools/call",
                json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": volume}},
            )
            assert reply.status_code == 200, reply.text

    families, samples = await scrape(a)
    assert families == dict.fromkeys(GAUGES, "gauge") | dict.fromkeys(COUNTERS, "counter")
    for name in ("a", "b"):
        assert samples[("bridge_cluster_fenced", name)] == 0
        assert samples[("bridge_cluster_draining", name)] == 0
        assert samples[("bridge_cluster_broker_connected", name)] == 1
        lag = samples[("bridge_cluster_lease_renew_lag_seconds", name)]
        assert 0 <= lag < FAST_LEASES["lease_ttl_s"], (name, lag)
        assert samples[("bridge_cluster_fences_total", name)] == 0
    assert samples[("bridge_cluster_devices_owned", "a")] == 0
    assert samples[("bridge_cluster_devices_owned", "b")] == 1
    assert samples[("bridge_cluster_forwarded_calls_total", "a")] == 3
    assert samples[("bridge_cluster_served_calls_total", "b")] == 3
    assert samples[("bridge_cluster_forwarded_calls_total", "b")] == 0
    assert samples[("bridge_cluster_served_calls_total", "a")] == 0
    assert b.cluster is not None
    stale = b.cluster.counters["stale_links_closed"]
    assert samples[("bridge_cluster_stale_links_closed_total", "b")] == stale

    async with cluster.api("b") as api:
        assert (await api.post("/api/cluster/drain")).status_code == 200
    _families, samples = await scrape(b)
    assert samples[("bridge_cluster_draining", "b")] == 1
    assert samples[("bridge_cluster_draining", "a")] == 0


async def test_the_broker_gone_shows_and_the_renew_lag_stays_small(cluster: Cluster) -> None:
    a = await cluster.start("a")
    await cluster.broker.stop()
    assert a.cluster is not None
    await until(lambda: not a.cluster.fabric.connected, what="a saw the broker go")  # type: ignore[union-attr]
    _families, samples = await scrape(a)
    assert samples[("bridge_cluster_broker_connected", "a")] == 0
    # The database still answers: renewals go on.
    assert samples[("bridge_cluster_lease_renew_lag_seconds", "a")] < FAST_LEASES["lease_ttl_s"]
    await cluster.stop("a")
    families, _samples = cluster_samples(metrics.generate_text())  # its listener is closed
    assert families == {}  # a stopped instance is no longer reported


# ---- the collector alone: every family from the member's own values ----------------------------


@dataclass
class Member:
    instance_id: str
    fenced: bool = False
    draining: bool = False
    broker_connected: bool = True
    renew_lag_s: float = 0.25
    devices_owned: int = 0
    counters: Mapping[str, int] = field(default_factory=dict)

    def __hash__(self) -> int:
        return id(self)


def test_the_families_read_each_member_at_scrape() -> None:
    member = Member(
        "fenced-one",
        fenced=True,
        broker_connected=False,
        renew_lag_s=7.5,
        devices_owned=0,
        counters={"forwarded": 4, "served": 5, "stale_links_closed": 6, "fenced": 2},
    )
    metrics.watch_cluster(member)
    try:
        _families, samples = cluster_samples(metrics.generate_text())
    finally:
        metrics.unwatch_cluster(member)
    mine = {name: value for (name, who), value in samples.items() if who == "fenced-one"}
    assert mine == {
        "bridge_cluster_fenced": 1,
        "bridge_cluster_draining": 0,
        "bridge_cluster_broker_connected": 0,
        "bridge_cluster_lease_renew_lag_seconds": 7.5,
        "bridge_cluster_devices_owned": 0,
        "bridge_cluster_forwarded_calls_total": 4,
        "bridge_cluster_served_calls_total": 5,
        "bridge_cluster_stale_links_closed_total": 6,
        "bridge_cluster_fences_total": 2,
    }
    assert "fenced-one" not in metrics.generate_text()
