"""Devices by transport and state, computed at scrape from the registry."""

import weakref
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from backend.metrics.core import OTHER, REGISTRY, TRANSPORTS

DEVICE_STATES = ("connecting", "initializing", "ready", "failed")


class LiveDevice(Protocol):
    """A live device as the gauge reads it."""

    @property
    def transport(self) -> str:
        """The transport's name (`websocket`, `mqtt`, `browser`)."""

    @property
    def state(self) -> str:
        """The device's state value."""


class DeviceSource(Protocol):
    """What the gauge reads: the registry's live devices (a snapshot)."""

    def __iter__(self) -> Iterator[LiveDevice]: ...

    @property
    def known_count(self) -> int:
        """How many devices are remembered, online or not."""


class _DeviceCollector(Collector):
    """`bridge_devices{state, transport}` and `bridge_devices_known`, read at scrape from every
    watched registry (one per bridge in this process): no counter to keep in step."""

    def __init__(self) -> None:
        self.sources: weakref.WeakSet[DeviceSource] = weakref.WeakSet()

    def collect(self) -> Iterator[Metric]:
        counts = dict.fromkeys(
            ((state, transport) for state in DEVICE_STATES for transport in (*TRANSPORTS, OTHER)),
            0,
        )
        known = 0
        for source in list(self.sources):
            known += source.known_count
            for device in source:
                transport = device.transport if device.transport in TRANSPORTS else OTHER
                key = (str(device.state), transport)
                if key in counts:
                    counts[key] += 1
        live = GaugeMetricFamily(
            "bridge_devices",
            "Connected devices by state and transport (offline ones are in bridge_devices_known).",
            labels=["state", "transport"],
        )
        for (state, transport), count in counts.items():
            live.add_metric([state, transport], count)
        yield live
        yield GaugeMetricFamily(
            "bridge_devices_known", "Devices the bridge remembers, online or not.", value=known
        )


_devices = _DeviceCollector()
REGISTRY.register(_devices)


def watch_devices(source: DeviceSource) -> None:
    """Count `source`'s devices in `bridge_devices` (a bridge calls it when it starts)."""
    _devices.sources.add(source)


def unwatch_devices(source: DeviceSource) -> None:
    """Stop counting `source`'s devices (the bridge stopped)."""
    _devices.sources.discard(source)
