"""The provider-neutral view of a chat model with function calling.

Messages, tool calls and results are plain frozen dataclasses; each provider module translates
them to and from its wire format (`openai.py`, `ollama.py`). A tool call whose arguments are not
a JSON object is still returned, with `arguments=None` and `error` saying why, so the caller can
send that error back to the model instead of failing.
"""

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """One function offered to the model; `parameters` is the tool's whole inputSchema."""

    llm_name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the model asked for. `raw_arguments` is what it sent, as text."""

    id: str
    name: str
    arguments: dict[str, Any] | None
    raw_arguments: str
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message to a provider, with the tool calls it made or the call it answers."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # role "tool": the call it answers
    name: str | None = None  # role "tool": the function name (Ollama wants it)


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of streamed answer text."""

    text: str


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the model samples: each field, when set, goes to the provider as is."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    frequency_penalty: float | None = None
    presence_penalty: float | None = None


ANY_SAMPLING = Sampling()  # the provider's defaults
# Classification and summaries: the same verdict for the same question on every run.
DETERMINISTIC = Sampling(temperature=0.0, top_p=1.0, seed=0)


@dataclass(frozen=True, slots=True)
class TokenCount:
    """Tokens the provider reported for one call."""

    prompt: int
    completion: int


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole (non-streamed) answer: text, tool calls, finish reason, token usage."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None
    usage: TokenCount | None = None


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The last item of a stream that ended properly (OpenAI's `[DONE]`, Ollama's `done`)."""

    finish_reason: str | None = None
    usage: TokenCount | None = None


StreamItem = TextDelta | ToolCall | StreamEnd


@dataclass(frozen=True, slots=True)
class Usage:
    """Models for each job: the chat model answers, the guardrail model classifies/summarises."""

    chat: str
    guardrail: str


class LlmProvider(Protocol):
    """A chat model service. `model=None` means the provider's chat model."""

    name: str
    models: Usage

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        tools: Sequence[FunctionSpec] = (),
        sampling: Sampling = ANY_SAMPLING,
    ) -> Completion:
        """One reply, not streamed. Raises LlmUnavailable / LlmError."""
        ...

    def stream(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        tools: Sequence[FunctionSpec] = (),
        sampling: Sampling = ANY_SAMPLING,
    ) -> AsyncIterator[StreamItem]:
        """Text deltas as they come, then each finished tool call, then one `StreamEnd`.
        A stream cut before its end, or with neither text nor calls, raises LlmUnavailable;
        otherwise raises like `complete`."""
        ...

    async def list_models(self) -> list[str]:
        """The model names the service offers (sorted). Raises LlmUnavailable / LlmError."""
        ...

    async def aclose(self) -> None:
        """Close the provider's HTTP clients."""


@dataclass(slots=True)
class ToolCallBuilder:
    """Joins streamed tool-call pieces (OpenAI sends id and name once, arguments in fragments)."""

    id: str = ""
    name: str = ""
    fragments: list[str] = field(default_factory=list)

    def finish(self, fallback_id: str) -> ToolCall:
        """The streamed call as a `ToolCall` (`fallback_id` when the stream gave none)."""
        return tool_call_from_text(self.id or fallback_id, self.name, "".join(self.fragments))


def tool_call_from_text(call_id: str, name: str, raw: str) -> ToolCall:
    """A ToolCall from a JSON-string `arguments` (OpenAI); invalid JSON gives `error`."""
    text = raw.strip() or "{}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return ToolCall(call_id, name, None, raw, f"arguments are not valid JSON ({exc.msg})")
    return tool_call_from_value(call_id, name, value, raw)


def tool_call_from_value(call_id: str, name: str, value: Any, raw: str | None = None) -> ToolCall:
    """A ToolCall from already parsed arguments (Ollama sends an object)."""
    if raw is None:
        raw = json.dumps(value, ensure_ascii=False)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        return ToolCall(call_id, name, None, raw, "arguments must be a JSON object")
    if not name:
        return ToolCall(call_id, name, None, raw, "the call has no function name")
    return ToolCall(call_id, name, value, raw)
