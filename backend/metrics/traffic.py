"""Device traffic: frames and bytes per transport, drops and cut-offs."""

from collections.abc import Iterator

from prometheus_client import Counter, Metric
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from backend.metrics.core import OTHER, REGISTRY, SWITCH, TRANSPORTS, pair

DROP_REASONS = (
    "malformed",  # a text that is not a device message
    "outside_conversation",  # audio before a hello or after its goodbye
    "pipeline_busy",  # too many of the device's messages still being handled
    "transport",  # the transport could not hand it over (undecodable audio, not UTF-8, ...)
)
CUT_OFF_REASONS = (
    "inbound_rate",  # more messages or bytes a second than allowed
    "mcp_violation",  # too many JSON-RPC requests in flight from the device
    "message_too_big",  # a frame or packet over max_message_bytes
    "malformed",  # an MQTT packet that does not parse
)

_dropped = Counter(
    "bridge_device_frames_dropped",
    "Device messages dropped without effect, by reason.",
    ["transport", "reason"],
    registry=REGISTRY,
)
_cut_offs = Counter(
    "bridge_device_cutoffs",
    "Device links the bridge closed because the device broke a bound.",
    ["transport", "reason"],
    registry=REGISTRY,
)


class _Flow:
    """One direction and kind of one transport's traffic. Plain integers, not prometheus_client
    children: every device message passes here, and two locked `inc()` calls cost ~0.9 µs
    where two additions cost ~0.1. Only the event loop's thread records (every transport and
    session runs there), so no lock is needed; `_TrafficCollector` reads them at scrape."""

    __slots__ = ("bytes", "labels", "messages")

    def __init__(self, transport: str, direction: str, kind: str) -> None:
        self.labels = [transport, direction, kind]
        self.messages = 0
        self.bytes = 0

    def add(self, size: int) -> None:
        if SWITCH.on:
            self.messages += 1
            self.bytes += size


class LinkMetrics:
    """What one device link records, bound to its transport's children at link setup: the hot
    path (every message) is a flag test and two locked adds, nothing allocated."""

    __slots__ = ("audio_in", "audio_out", "text_in", "text_out", "transport")

    def __init__(self, transport: str) -> None:
        self.transport = transport if transport in TRANSPORTS else OTHER
        self.text_in, self.text_out, self.audio_in, self.audio_out = _flows[self.transport]

    def dropped(self, reason: str) -> None:
        """Count a frame dropped on this transport, by reason."""
        if SWITCH.on:
            _dropped_child[pair(self.transport, reason, DROP_REASONS)].inc()

    def cut_off(self, reason: str) -> None:
        """Count a device cut off on this transport, by reason."""
        if SWITCH.on:
            _cut_off_child[pair(self.transport, reason, CUT_OFF_REASONS)].inc()


_flows = {
    transport: (
        _Flow(transport, "in", "text"),
        _Flow(transport, "out", "text"),
        _Flow(transport, "in", "audio"),
        _Flow(transport, "out", "audio"),
    )
    for transport in (*TRANSPORTS, OTHER)
}
_dropped_child = {
    (t, r): _dropped.labels(t, r) for t in (*TRANSPORTS, OTHER) for r in (*DROP_REASONS, OTHER)
}
_cut_off_child = {
    (t, r): _cut_offs.labels(t, r) for t in (*TRANSPORTS, OTHER) for r in (*CUT_OFF_REASONS, OTHER)
}
_link_metrics = {transport: LinkMetrics(transport) for transport in (*TRANSPORTS, OTHER)}


class _TrafficCollector(Collector):
    """`bridge_device_messages_total` and `bridge_device_bytes_total` from the flows."""

    def collect(self) -> Iterator[Metric]:
        labels = ["transport", "direction", "kind"]
        messages = CounterMetricFamily(
            "bridge_device_messages",
            "Messages between the bridge and devices (text: JSON messages, audio: Opus packets).",
            labels=labels,
        )
        sizes = CounterMetricFamily(
            "bridge_device_bytes",
            "Payload sizes of those messages (a text's characters: its UTF-8 bytes for ASCII "
            "JSON).",
            labels=labels,
        )
        for flows in _flows.values():
            for flow in flows:
                messages.add_metric(flow.labels, flow.messages)
                sizes.add_metric(flow.labels, flow.bytes)
        yield messages
        yield sizes


REGISTRY.register(_TrafficCollector())


def link_metrics(transport: str) -> LinkMetrics:
    """The (shared, stateless) recorder of a link on `transport`."""
    return _link_metrics.get(transport) or _link_metrics[OTHER]


def record_cut_off(transport: str, reason: str) -> None:
    """Count a device cut off on `transport`, by reason."""
    link_metrics(transport).cut_off(reason)
