"""This instance's cluster membership, read at scrape (backend/cluster)."""

import weakref
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from backend.metrics.core import REGISTRY


class ClusterMember(Protocol):
    """A cluster instance (`backend.cluster.ClusterNode`) as the cluster families read it."""

    @property
    def instance_id(self) -> str:
        """The instance's id (the `instance_id` label)."""

    @property
    def fenced(self) -> bool:
        """Whether it stopped serving devices because it cannot tell it still owns them."""

    @property
    def draining(self) -> bool:
        """Whether it is draining (readiness 503, no new devices)."""

    @property
    def broker_connected(self) -> bool:
        """Whether its connection to the cluster broker is up."""

    @property
    def renew_lag_s(self) -> float:
        """Seconds since its last successful lease renewal."""

    @property
    def devices_owned(self) -> int:
        """Devices connected to it (its local devices)."""

    @property
    def counters(self) -> Mapping[str, int]:
        """Its running totals: `forwarded`, `served`, `stale_links_closed`, `fenced`."""


# (name, help, counter key) of the counters read from `ClusterMember.counters`.
CLUSTER_COUNTERS = (
    ("bridge_cluster_forwarded_calls", "Tool calls this instance forwarded to a device's "
     "owner.", "forwarded"),
    ("bridge_cluster_served_calls", "Forwarded tool calls this instance ran for another "
     "instance.", "served"),
    ("bridge_cluster_stale_links_closed", "Device links closed because the device's lease "
     "moved to another instance.", "stale_links_closed"),
    ("bridge_cluster_fences", "Times this instance fenced itself (closed every device link).",
     "fenced"),
)  # fmt: skip


class _ClusterCollector(Collector):
    """`bridge_cluster_*`, one series per watched instance (label `instance_id`; a process
    serves one, tests run several): nothing at all for a bridge outside a cluster."""

    def __init__(self) -> None:
        self.members: weakref.WeakSet[ClusterMember] = weakref.WeakSet()

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the families come and go with the members: no names to reserve

    def collect(self) -> Iterator[Metric]:
        members = sorted(self.members, key=lambda member: member.instance_id)
        if not members:
            return
        labels = ["instance_id"]

        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=labels)

        fenced = gauge(
            "bridge_cluster_fenced",
            "1 while this instance is fenced: it cannot tell it still owns its devices, so it "
            "serves none.",
        )
        draining = gauge("bridge_cluster_draining", "1 while this instance drains.")
        broker = gauge(
            "bridge_cluster_broker_connected", "1 while the cluster broker connection is up."
        )
        lag = gauge(
            "bridge_cluster_lease_renew_lag_seconds",
            "Time since this instance's last successful lease renewal (grows while the "
            "database does not answer).",
        )
        owned = gauge("bridge_cluster_devices_owned", "Devices connected to this instance.")
        counters = [
            (CounterMetricFamily(name, text, labels=labels), key)
            for name, text, key in CLUSTER_COUNTERS
        ]
        for member in members:
            value = [member.instance_id]
            fenced.add_metric(value, float(member.fenced))
            draining.add_metric(value, float(member.draining))
            broker.add_metric(value, float(member.broker_connected))
            lag.add_metric(value, round(member.renew_lag_s, 3))
            owned.add_metric(value, member.devices_owned)
            totals = member.counters
            for family, key in counters:
                family.add_metric(value, totals.get(key, 0))
        yield from (fenced, draining, broker, lag, owned)
        yield from (family for family, _key in counters)


_cluster = _ClusterCollector()
REGISTRY.register(_cluster)


def watch_cluster(member: ClusterMember) -> None:
    """Report `member` in the `bridge_cluster_*` families (a clustered bridge calls it when it
    starts; held weakly)."""
    _cluster.members.add(member)


def unwatch_cluster(member: ClusterMember) -> None:
    """Stop reporting `member` (the bridge stopped)."""
    _cluster.members.discard(member)
