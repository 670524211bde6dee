"""A turn's context from the client's own `messages` (OpenAI clients without `chat_id`).

The same rule as stored memory: the last N messages go to the model as they are, everything
older becomes a short extractive summary (first sentences of each, no model call, so a long
history costs microseconds). System and developer messages become the client's instructions,
which the prompt places *inside* the dental consultant's rules, never above them. Tool turns
(an assistant's `tool_calls`, a `tool` result) are kept as plain text: the model of this turn
never saw those functions, and OpenAI-compatible servers refuse tool messages without them.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backend.chat.llm.base import Message
from backend.chat.offline import extractive_summary
from backend.chat.prompts import SOURCES_HEADING
from backend.chat.text import Language
from backend.common import clip

MAX_INSTRUCTIONS_CHARS = 4000
_OLD_MESSAGE_CHARS = 160
_TOOL_TEXT_CHARS = 1000
_LABEL = {
    "en": {"user": "User", "assistant": "Assistant"},
    "vi": {"user": "Người dùng", "assistant": "Trợ lý"},
}


@dataclass(frozen=True, slots=True)
class ClientTurn:
    """One earlier message of the client's `messages`, reduced to what the model needs."""

    role: str  # system, developer, user, assistant, tool
    text: str
    tool_calls: tuple[dict[str, Any], ...] = ()
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ClientContext:
    """A turn's context from the client's messages: instructions, recent history, a summary."""

    instructions: str
    history: list[Message]
    summary: str


def client_context(earlier: Sequence[ClientTurn], recent: int, language: Language) -> ClientContext:
    """Instructions, the recent history and a summary of the rest, from the messages that came
    before the question."""
    instructions = "\n\n".join(
        turn.text.strip() for turn in earlier if turn.role in ("system", "developer")
    )
    talk = [_as_message(turn) for turn in earlier if turn.role not in ("system", "developer")]
    talk = [message for message in talk if message.content]
    cut = max(0, len(talk) - recent)
    return ClientContext(
        instructions=clip(instructions, MAX_INSTRUCTIONS_CHARS) if instructions else "",
        history=talk[cut:],
        summary=_summary(talk[:cut], language),
    )


def _as_message(turn: ClientTurn) -> Message:
    if turn.role == "tool":
        label = f"tool {turn.name}" if turn.name else "tool"
        return Message("assistant", f"({label} result: {clip(turn.text, _TOOL_TEXT_CHARS)})")
    if turn.role == "assistant":
        calls = [_call_text(call) for call in turn.tool_calls]
        text = "\n".join(part for part in (without_sources(turn.text), *calls) if part)
        return Message("assistant", text)
    return Message("user", turn.text)


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return ""
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f"(called {function.get('name', '?')} with {clip(arguments, _TOOL_TEXT_CHARS)})"


def _summary(older: Sequence[Message], language: Language) -> str:
    labels = _LABEL[language]
    lines = [
        f"{labels.get(message.role, message.role)}: "
        f"{extractive_summary(message.content, language, _OLD_MESSAGE_CHARS)}"
        for message in older
    ]
    return "\n".join(lines)


def without_sources(content: str) -> str:
    """An answer without the sources section the bridge appended (the model never wrote it)."""
    for heading in SOURCES_HEADING.values():
        cut = content.rfind("\n\n" + heading)
        if cut != -1:
            return content[:cut]
    return content
