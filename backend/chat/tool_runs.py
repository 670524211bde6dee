"""Device calls in a turn: every one, whoever asks for it (the model, the offline rules, a
confirmed question), goes through `run_tool`; and the refusal said when the key may not call
the device (`denied_event`)."""

import time
from collections.abc import AsyncIterator
from typing import Any

from backend.chat.events import ChatEvent, ToolFailed, ToolStarted
from backend.chat.offline import IntentDetector
from backend.chat.turn import ToolRun, Turn, log
from backend.metrics import record_chat_stage


async def run_tool(
    turn: Turn, llm_name: str, arguments: dict[str, Any], *, confirmed: bool = False
) -> AsyncIterator[ChatEvent | ToolRun]:
    """The one way a turn calls a tool, for the model, the offline rules and a confirmed
    question alike: `tool_started`, the call, its log line, `tool_failed` or
    `tool_completed`; the last item is the `ToolRun`."""
    tool = turn.toolbox.device_tool_name(llm_name)
    yield ToolStarted(tool=tool, llm_name=llm_name, arguments=arguments)
    began = time.perf_counter()
    outcome = await turn.toolbox.call(llm_name, arguments, confirmed=confirmed)
    seconds = time.perf_counter() - began
    run = ToolRun(tool, llm_name, arguments, outcome, round(seconds * 1000, 3))
    log.info(
        "chat tool call",
        step="tool",
        tool=tool,
        duration_ms=run.duration_ms,
        failed=outcome.failed,
        is_error=outcome.is_error,
        offline=turn.log.offline_reason is not None,
        conversation_id=turn.log.conversation_id,
        device_id=turn.log.device_id,
    )
    if not run.needs_confirmation or confirmed:
        turn.log.tools_used += 1
    turn.log.tool_seconds += seconds
    yield run.event()
    yield run


def denied_event(turn: Turn, detector: IntentDetector) -> ToolFailed | None:
    """The refusal of the first device call the request asks for, when the key may not call
    the device (the model is offered no device tools; offline mode calls none)."""
    reason = turn.toolbox.unavailable_reason
    if reason is None:
        return None
    for intent in detector.plan(turn.reading.text, turn.functions).intents:
        tool = turn.toolbox.device_tool_name(intent.llm_name)
        return ToolFailed(tool=tool, llm_name=intent.llm_name, error=reason)
    return None


def record_tool_time(turn: Turn) -> None:
    """The turn's time in device calls, one observation a turn (none without a call)."""
    if turn.log.tool_seconds:
        record_chat_stage("tools", turn.log.tool_seconds)
