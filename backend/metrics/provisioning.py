"""Provisioning: OTA requests, activations, approvals."""

from prometheus_client import Counter

from backend.metrics.core import OTHER, REGISTRY, SWITCH, pick

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
    if not SWITCH.on:
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
    if SWITCH.on:
        pick(_approval_children, by).inc()
