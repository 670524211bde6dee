"""MCP calls to devices: outcomes and durations, tool re-listings."""

from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate

from prometheus_client import Counter, Metric
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from backend.metrics.core import OTHER, REGISTRY, SWITCH, pick

MCP_OUTCOMES = (
    "ok",
    "tool_error",  # the tool answered isError: true
    "refused",  # before the device: unknown tool, bad arguments, unconfirmed, busy, not ready
    "timeout",
    "disconnected",
    "device_error",  # a JSON-RPC error from the device
    "protocol_error",  # a reply that breaks the protocol
)
# A tool call on a LAN device takes milliseconds; a camera's photo up to 30 s.
CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _CallStats:
    """One outcome's count, latency buckets and sum: plain numbers, recorded on the event
    loop's thread only (like `_Flow`), read at scrape by `_CallCollector`."""

    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.count = 0
        self.buckets = [0] * (len(CALL_BUCKETS) + 1)  # the last one: over the largest bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect_left(CALL_BUCKETS, seconds)] += 1  # `le` bounds are inclusive
        self.sum += seconds


class _CallCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        calls = CounterMetricFamily(
            "bridge_mcp_calls", "tools/call requests to devices, by outcome.", labels=["outcome"]
        )
        seconds = HistogramMetricFamily(
            "bridge_mcp_call_seconds",
            "Time from asking a device's tool to its answer, by outcome (refused ones not "
            "observed).",
            labels=["outcome"],
        )
        for outcome, stats in _mcp_call_children.items():
            calls.add_metric([outcome], stats.count)
            cumulative = list(accumulate(stats.buckets))
            bounds = [*(str(float(b)) for b in CALL_BUCKETS), "+Inf"]
            seconds.add_metric([outcome], list(zip(bounds, cumulative, strict=True)), stats.sum)
        yield calls
        yield seconds


_mcp_relists = Counter(
    "bridge_mcp_tool_relists",
    "Tool lists read again after notifications/tools/list_changed, by outcome.",
    ["outcome"],
    registry=REGISTRY,
)
_mcp_call_children = {outcome: _CallStats() for outcome in (*MCP_OUTCOMES, OTHER)}
REGISTRY.register(_CallCollector())
_relist_children = {outcome: _mcp_relists.labels(outcome) for outcome in ("ok", "failed")}


def record_mcp_call(outcome: str, seconds: float) -> None:
    """One tools/call ended; a refused one (never sent) counts without a duration."""
    if SWITCH.on:
        stats = pick(_mcp_call_children, outcome)
        stats.count += 1
        if outcome != "refused":
            stats.observe(seconds)


def record_tool_relist(ok: bool) -> None:
    """Count a re-list of a device's tools after `list_changed`, as ok or failed."""
    if SWITCH.on:
        _relist_children["ok" if ok else "failed"].inc()
