"""Storage: the write-behind queues and their flushes."""

import weakref
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import Histogram, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from backend.metrics.core import OTHER, REGISTRY, STAGE_BUCKETS, SWITCH, pick

WRITERS = ("device-catalog", "audit-log", "provisioning-writer")  # depth: the first two only


class WriteQueue(Protocol):
    """A write-behind writer as the gauge reads it."""

    @property
    def name(self) -> str:
        """The writer's name (its `writer` label)."""

    def depth(self) -> int:
        """How many changes wait for the next flush."""


class _QueueCollector(Collector):
    """`bridge_db_write_queue_depth{writer}`: rows waiting for the next flush, read at scrape."""

    def __init__(self) -> None:
        self.queues: weakref.WeakSet[WriteQueue] = weakref.WeakSet()

    def collect(self) -> Iterator[Metric]:
        depths: dict[str, int] = {}
        for queue in list(self.queues):
            writer = queue.name if queue.name in WRITERS else OTHER
            depths[writer] = depths.get(writer, 0) + queue.depth()
        family = GaugeMetricFamily(
            "bridge_db_write_queue_depth",
            "Changes held in memory, waiting for the writer's next database flush.",
            labels=["writer"],
        )
        for writer, depth in depths.items():
            family.add_metric([writer], depth)
        yield family


_queues = _QueueCollector()
REGISTRY.register(_queues)
_flush_seconds = Histogram(
    "bridge_db_flush_seconds",
    "Time one write-behind flush (one transaction) took.",
    ["writer"],
    buckets=STAGE_BUCKETS,
    registry=REGISTRY,
)
_flush_children = {writer: _flush_seconds.labels(writer) for writer in (*WRITERS, OTHER)}


def watch_write_queue(queue: WriteQueue) -> None:
    """Report `queue`'s depth in `bridge_db_write_queue_depth` (held weakly)."""
    _queues.queues.add(queue)


def unwatch_write_queue(queue: WriteQueue) -> None:
    """Stop reporting `queue`'s depth."""
    _queues.queues.discard(queue)


def record_flush(writer: str, seconds: float) -> None:
    """Observe one flush of `writer` in `bridge_db_flush_seconds`."""
    if SWITCH.on:
        pick(_flush_children, writer).observe(seconds)
