"""Prometheus metrics of the bridge (docs/metrics.md).

One `CollectorRegistry` per process, `REGISTRY`, never prometheus_client's global default one
(which a library imported alongside could also fill). A bridge is one process in production; tests
that start several bridges in one process read differences of counters (they only grow), so no
reset is needed. Recording goes through the `record_*` functions: label values come from small
closed sets (an unknown one is counted as "other", never as a new series) and the labelled
children are bound once at import, so a hot path pays one dict lookup and one locked add.
`set_enabled(False)` (the setting `metrics_enabled`) turns every recording into a no-op.

One module per concern (`chat`, `devices`, `cluster`, `connections`, `traffic`, `mcp`, `voice`,
`provisioning`, `storage`, `loop`) on the shared `core`; this package re-exports their API.
"""

from backend.metrics.chat import (
    CHAT_PATHS,
    CHAT_STAGES,
    record_chat_stage,
    record_chat_turn,
)
from backend.metrics.cluster import (
    CLUSTER_COUNTERS,
    ClusterMember,
    unwatch_cluster,
    watch_cluster,
)
from backend.metrics.connections import (
    CONNECTION_REFUSALS,
    HANDSHAKE_REFUSALS,
    record_connection_refused,
    record_handshake_refused,
)
from backend.metrics.core import (
    OTHER,
    REGISTRY,
    STAGE_BUCKETS,
    TRANSPORTS,
    enabled,
    generate_text,
    set_enabled,
)
from backend.metrics.devices import (
    DEVICE_STATES,
    DeviceSource,
    LiveDevice,
    unwatch_devices,
    watch_devices,
)
from backend.metrics.loop import (
    LAG_BUCKETS,
    LAG_INTERVAL_S,
    measure_loop_lag,
)
from backend.metrics.mcp import (
    CALL_BUCKETS,
    MCP_OUTCOMES,
    record_mcp_call,
    record_tool_relist,
)
from backend.metrics.provisioning import (
    APPROVALS,
    OTA_OUTCOMES,
    record_approval,
    record_provisioning,
)
from backend.metrics.storage import (
    WRITERS,
    WriteQueue,
    record_flush,
    unwatch_write_queue,
    watch_write_queue,
)
from backend.metrics.traffic import (
    CUT_OFF_REASONS,
    DROP_REASONS,
    LinkMetrics,
    link_metrics,
    record_cut_off,
)
from backend.metrics.voice import (
    VOICE_STAGES,
    record_voice_turn,
)

__all__ = [
    "APPROVALS",
    "CALL_BUCKETS",
    "CHAT_PATHS",
    "CHAT_STAGES",
    "CLUSTER_COUNTERS",
    "CONNECTION_REFUSALS",
    "CUT_OFF_REASONS",
    "DEVICE_STATES",
    "DROP_REASONS",
    "HANDSHAKE_REFUSALS",
    "LAG_BUCKETS",
    "LAG_INTERVAL_S",
    "MCP_OUTCOMES",
    "OTA_OUTCOMES",
    "OTHER",
    "REGISTRY",
    "STAGE_BUCKETS",
    "TRANSPORTS",
    "VOICE_STAGES",
    "WRITERS",
    "ClusterMember",
    "DeviceSource",
    "LinkMetrics",
    "LiveDevice",
    "WriteQueue",
    "enabled",
    "generate_text",
    "link_metrics",
    "measure_loop_lag",
    "record_approval",
    "record_chat_stage",
    "record_chat_turn",
    "record_connection_refused",
    "record_cut_off",
    "record_flush",
    "record_handshake_refused",
    "record_mcp_call",
    "record_provisioning",
    "record_tool_relist",
    "record_voice_turn",
    "set_enabled",
    "unwatch_cluster",
    "unwatch_devices",
    "unwatch_write_queue",
    "watch_cluster",
    "watch_devices",
    "watch_write_queue",
]
