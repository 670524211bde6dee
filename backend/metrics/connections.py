"""Handshakes and connections refused, by transport and reason."""

from prometheus_client import Counter

from backend.metrics.core import OTHER, REGISTRY, SWITCH, TRANSPORTS, pair

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


def record_connection_refused(transport: str, reason: str) -> None:
    """Count a TCP connection dropped at accept time, by transport and reason."""
    if SWITCH.on:
        _connection_refusal[pair(transport, reason, CONNECTION_REFUSALS)].inc()


def record_handshake_refused(transport: str, reason: str) -> None:
    """Count a device handshake refused, by transport and reason."""
    if SWITCH.on:
        _handshake_refusal[pair(transport, reason, HANDSHAKE_REFUSALS)].inc()
