"""Prometheus metrics of the bridge (docs/metrics.md).

One `CollectorRegistry` per process, `REGISTRY`, never prometheus_client's global default one
(which a library imported alongside could also fill). A bridge is one process in production; tests
that start several bridges in one process read differences of counters (they only grow), so no
reset is needed. Recording goes through the `record_*` functions: label values come from small
closed sets (an unknown one is counted as "other", never as a new series) and the labelled
children are bound once at import, so a hot path pays one dict lookup and one locked add.
`set_enabled(False)` (the setting `metrics_enabled`) turns every recording into a no-op.
"""

from collections.abc import Mapping
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

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
    return _enabled


_Child = TypeVar("_Child")


def _pick(children: Mapping[str, _Child], value: str) -> _Child:
    """The child bound for `value`, or the "other" one for a value outside the closed set."""
    child = children.get(value)
    return child if child is not None else children[OTHER]


# ---- chat pipeline (backend/chat/service.py) ---------------------------------------------------

CHAT_PATHS = ("llm", "offline", "refused")
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
    """One chat turn answered; `path` is "llm", "offline" or "refused"."""
    if _enabled:
        _pick(_chat_turn_by_path, path).inc()


def record_chat_stage(stage: str, seconds: float) -> None:
    """Time one stage of a chat turn took: "guardrail", "memory", "search",
    "llm_first_token", "tools" or "store"."""
    if _enabled:
        _pick(_chat_stage_by_name, stage).observe(seconds)
