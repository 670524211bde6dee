"""Prometheus metrics of the bridge (docs/metrics.md).

One `CollectorRegistry` per process, `REGISTRY`, never prometheus_client's global default one
(which a library imported alongside could also fill). A bridge is one process in production; tests
that start several bridges in one process read differences of counters (they only grow), so no
reset is needed. Recording goes through the `record_*` functions: label values come from small
closed sets (an unknown one is counted as "other", never as a new series) and the labelled
children are bound once at import, so a hot path pays one dict lookup and one locked add.
`set_enabled(False)` (the setting `metrics_enabled`) turns every recording into a no-op.
"""

import asyncio
import weakref
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from itertools import accumulate
from typing import Protocol, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Metric,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

# No `_created` series beside every counter and histogram: they double a scrape and no dashboard
# here reads them (a process-wide switch of prometheus_client; the bridge is its only user).
disable_created_metrics()  # type: ignore[no-untyped-call]
REGISTRY = CollectorRegistry(auto_describe=True)
OTHER = "other"

_enabled = True


def set_enabled(enabled: bool) -> None:
    """Recording on or off for the whole process (the setting `metrics_enabled`)."""
    global _enabled
    _enabled = enabled


def enabled() -> bool:
    """Whether recording is on (the setting `metrics_enabled`)."""
    return _enabled


_Child = TypeVar("_Child")


def _pick(children: Mapping[str, _Child], value: str) -> _Child:
    """The child bound for `value`, or the "other" one for a value outside the closed set."""
    child = children.get(value)
    return child if child is not None else children[OTHER]


# ---- chat pipeline (backend/chat/service.py) ---------------------------------------------------

CHAT_PATHS = ("llm", "offline", "refused", "confirmation")
CHAT_STAGES = ("guardrail", "memory", "search", "llm_first_token", "tools", "store")
# Seconds: a guardrail or store step takes milliseconds, a model's first token up to a minute.
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

_chat_turns = Counter(
    "bridge_chat_turns",
    "Chat turns answered, by the path that answered them.",
    ["path"],
    registry=REGISTRY,
)
_chat_turn_by_path = {path: _chat_turns.labels(path) for path in (*CHAT_PATHS, OTHER)}
_chat_stage_seconds = Histogram(
    "bridge_chat_stage_seconds",
    "Time spent in each stage of a chat turn.",
    ["stage"],
    buckets=STAGE_BUCKETS,
    registry=REGISTRY,
)
_chat_stage_by_name = {stage: _chat_stage_seconds.labels(stage) for stage in (*CHAT_STAGES, OTHER)}


def record_chat_turn(path: str) -> None:
    """One chat turn answered; `path` is "llm", "offline", "refused" or "confirmation" (a yes or no
    to a risky tool)."""
    if _enabled:
        _pick(_chat_turn_by_path, path).inc()


def record_chat_stage(stage: str, seconds: float) -> None:
    """Time one stage of a chat turn took: "guardrail", "memory", "search",
    "llm_first_token", "tools" or "store"."""
    if _enabled:
        _pick(_chat_stage_by_name, stage).observe(seconds)


# ---- devices: state gauge computed at scrape from the registry --------------------------------

TRANSPORTS = ("websocket", "mqtt", "browser")
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


# ---- cluster: this instance's membership, read at scrape (backend/cluster) --------------------


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


# ---- handshakes and connections refused --------------------------------------------------------

CONNECTION_REFUSALS = ("penalty_box", "address_rate", "pending_cap", "address_pending")
HANDSHAKE_REFUSALS = (
    "not_found",  # wrong WebSocket path
    "address_rate",  # too many handshakes from one address (429)
    "malformed",  # missing or bad Device-Id, Protocol-Version, Client-Id (400)
    "credential",  # missing or wrong token (401)
    "device_rate",  # too many handshakes of one device (429)
    "ticket",  # the talk page's ticket: unknown, used, expired, its key revoked
    "origin",  # the talk page's cross-origin WebSocket
    "unavailable",  # the listener is stopping
)

_connections_refused = Counter(
    "bridge_connections_refused",
    "Device TCP connections dropped at accept, before a byte is parsed.",
    ["transport", "reason"],
    registry=REGISTRY,
)
_handshakes_refused = Counter(
    "bridge_handshakes_refused",
    "Device handshakes refused, by reason.",
    ["transport", "reason"],
    registry=REGISTRY,
)
_connection_refusal = {
    (t, r): _connections_refused.labels(t, r)
    for t in (*TRANSPORTS, OTHER)
    for r in (*CONNECTION_REFUSALS, OTHER)
}
_handshake_refusal = {
    (t, r): _handshakes_refused.labels(t, r)
    for t in (*TRANSPORTS, OTHER)
    for r in (*HANDSHAKE_REFUSALS, OTHER)
}


def _pair(transport: str, reason: str, known: tuple[str, ...]) -> tuple[str, str]:
    return (
        transport if transport in TRANSPORTS else OTHER,
        reason if reason in known else OTHER,
    )


def record_connection_refused(transport: str, reason: str) -> None:
    """Count a TCP connection dropped at accept time, by transport and reason."""
    if _enabled:
        _connection_refusal[_pair(transport, reason, CONNECTION_REFUSALS)].inc()


def record_handshake_refused(transport: str, reason: str) -> None:
    """Count a device handshake refused, by transport and reason."""
    if _enabled:
        _handshake_refusal[_pair(transport, reason, HANDSHAKE_REFUSALS)].inc()


# ---- device traffic ----------------------------------------------------------------------------

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
        if _enabled:
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
        if _enabled:
            _dropped_child[_pair(self.transport, reason, DROP_REASONS)].inc()

    def cut_off(self, reason: str) -> None:
        """Count a device cut off on this transport, by reason."""
        if _enabled:
            _cut_off_child[_pair(self.transport, reason, CUT_OFF_REASONS)].inc()


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


# ---- MCP ---------------------------------------------------------------------------------------

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
    if _enabled:
        stats = _pick(_mcp_call_children, outcome)
        stats.count += 1
        if outcome != "refused":
            stats.observe(seconds)


def record_tool_relist(ok: bool) -> None:
    """Count a re-list of a device's tools after `list_changed`, as ok or failed."""
    if _enabled:
        _relist_children["ok" if ok else "failed"].inc()


# ---- voice -------------------------------------------------------------------------------------

# From the stamps of a spoken turn (backend/voice/timings.py, milliseconds from the end of
# speech): each stage's own share, and the whole wait the user hears.
VOICE_STAGES = {
    "vad": (None, "silence_wait_ms"),  # the detector's hangover before the turn ends
    "asr": ("end_of_speech_ms", "recognized_ms"),
    "llm": ("recognized_ms", "first_token_ms"),
    "tts": ("first_token_ms", "first_audio_ms"),
    "first_audio_out": ("end_of_speech_ms", "first_frame_sent_ms"),
}
_voice_stage_seconds = Histogram(
    "bridge_voice_stage_seconds",
    "Time each stage of a spoken turn took (first_audio_out: end of speech to the first frame).",
    ["stage"],
    buckets=STAGE_BUCKETS,
    registry=REGISTRY,
)
_voice_stage_children = {stage: _voice_stage_seconds.labels(stage) for stage in VOICE_STAGES}


def record_voice_turn(report: Mapping[str, float]) -> None:
    """A spoken turn ended; `report` is `TurnTimings.report()` (stages it never reached are
    absent and not observed)."""
    if not _enabled:
        return
    for stage, (start, end) in VOICE_STAGES.items():
        end_ms = report.get(end)
        start_ms = 0.0 if start is None else report.get(start)
        if end_ms is not None and start_ms is not None and end_ms >= start_ms:
            _voice_stage_children[stage].observe((end_ms - start_ms) / 1000)


# ---- provisioning ------------------------------------------------------------------------------

OTA_OUTCOMES = (
    "answered",  # 200: server time, credentials, maybe a firmware offer
    "activation",  # 200 with an activation code: nobody approved the device yet
    "pending",  # activate: 202, still waiting for the operator
    "rate_limited",  # 429
    "refused",  # any other 4xx/5xx (bad headers or body, a wrong HMAC, a full table)
)
APPROVALS = ("operator", "enrollment", "mac_prefix")

_ota_checks = Counter(
    "bridge_ota_checks",
    "OTA checks (POST <ota_path>) answered, by outcome.",
    ["outcome"],
    registry=REGISTRY,
)
_activations = Counter(
    "bridge_activations",
    "Activation polls (POST <ota_path>activate) answered, by outcome.",
    ["outcome"],
    registry=REGISTRY,
)
_approvals = Counter(
    "bridge_activation_approvals",
    "Devices approved, by who approved them.",
    ["by"],
    registry=REGISTRY,
)
_provisioning_children = {
    kind: {outcome: family.labels(outcome) for outcome in (*OTA_OUTCOMES, OTHER)}
    for kind, family in (("ota", _ota_checks), ("activate", _activations))
}
_approval_children = {by: _approvals.labels(by) for by in (*APPROVALS, OTHER)}


def record_provisioning(kind: str, status: int, activation_code: bool = False) -> None:
    """One answer of the OTA endpoint: `kind` "ota" or "activate", its HTTP status, and
    whether it hands out an activation code."""
    if not _enabled:
        return
    if status == 200:
        outcome = "activation" if activation_code else "answered"
    elif status == 202:
        outcome = "pending"
    elif status == 429:
        outcome = "rate_limited"
    else:
        outcome = "refused"
    children = _provisioning_children.get(kind)
    if children is not None:
        children[outcome].inc()


def record_approval(by: str) -> None:
    """A device approved: "operator", "enrollment" or "mac_prefix"."""
    if _enabled:
        _pick(_approval_children, by).inc()


# ---- storage: write-behind queues --------------------------------------------------------------

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
    if _enabled:
        _pick(_flush_children, writer).observe(seconds)


# ---- event loop lag ----------------------------------------------------------------------------

LAG_INTERVAL_S = 0.5
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

_loop_lag = Histogram(
    "bridge_event_loop_lag_seconds",
    f"How late a {LAG_INTERVAL_S:g} s sleep on the event loop wakes up (time others held it).",
    buckets=LAG_BUCKETS,
    registry=REGISTRY,
)
_loop_lag_last = Gauge(
    "bridge_event_loop_lag_last_seconds",
    "The lag of the latest such sleep.",
    registry=REGISTRY,
)


async def measure_loop_lag(interval_s: float = LAG_INTERVAL_S) -> None:
    """Run until cancelled: sleep `interval_s` again and again and record the overshoot, which
    is how long something else kept the loop (a slow callback, a blocking call)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        lag = max(0.0, loop.time() - due)
        if _enabled:
            _loop_lag.observe(lag)
            _loop_lag_last.set(lag)


def generate_text() -> str:
    """Every family in Prometheus' text format (what `GET /metrics` answers)."""
    return generate_latest(REGISTRY).decode()
