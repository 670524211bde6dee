"""What every metrics module shares: the process's registry, the on/off switch, the "other"
label value, and the text a scrape answers."""

from collections.abc import Mapping
from typing import TypeVar

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest

# No `_created` series beside every counter and histogram: they double a scrape and no dashboard
# here reads them (a process-wide switch of prometheus_client; the bridge is its only user).
disable_created_metrics()  # type: ignore[no-untyped-call]
REGISTRY = CollectorRegistry(auto_describe=True)
OTHER = "other"
# Label values and buckets several families share.
TRANSPORTS = ("websocket", "mqtt", "browser")
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _Switch:
    """Recording on or off; `SWITCH.on` is what a hot path reads (one attribute lookup)."""

    on = True


SWITCH = _Switch()


def set_enabled(enabled: bool) -> None:
    """Recording on or off for the whole process (the setting `metrics_enabled`)."""
    SWITCH.on = enabled


def enabled() -> bool:
    """Whether recording is on (the setting `metrics_enabled`)."""
    return SWITCH.on


_Child = TypeVar("_Child")


def pick(children: Mapping[str, _Child], value: str) -> _Child:
    """The child bound for `value`, or the "other" one for a value outside the closed set."""
    child = children.get(value)
    return child if child is not None else children[OTHER]


def pair(transport: str, reason: str, known: tuple[str, ...]) -> tuple[str, str]:
    """(transport, reason) with a value outside its closed set counted as "other"."""
    return (
        transport if transport in TRANSPORTS else OTHER,
        reason if reason in known else OTHER,
    )


def generate_text() -> str:
    """Every family in Prometheus' text format (what `GET /metrics` answers)."""
    return generate_latest(REGISTRY).decode()
