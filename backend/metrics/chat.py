"""The chat pipeline's turns and stages (backend/chat/service.py)."""

from prometheus_client import Counter, Histogram

from backend.metrics.core import OTHER, REGISTRY, STAGE_BUCKETS, SWITCH, pick

CHAT_PATHS = ("llm", "offline", "refused", "confirmation")
CHAT_STAGES = ("guardrail", "memory", "search", "llm_first_token", "tools", "store")
# Seconds: a guardrail or store step takes milliseconds, a model's first token up to a minute.

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
    if SWITCH.on:
        pick(_chat_turn_by_path, path).inc()


def record_chat_stage(stage: str, seconds: float) -> None:
    """Time one stage of a chat turn took: "guardrail", "memory", "search",
    "llm_first_token", "tools" or "store"."""
    if SWITCH.on:
        pick(_chat_stage_by_name, stage).observe(seconds)
