"""Ollama's native chat API: `POST {base}/api/chat`.

Differences from OpenAI: `stream` defaults to true (we always send it), streaming is NDJSON,
tool-call `arguments` is a JSON *object*, calls may have no `id`, and a tool result names its
function (`tool_name`) instead of a call id.
"""

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from backend.chat.errors import LlmError, LlmUnavailable
from backend.chat.llm.base import (
    ANY_SAMPLING,
    Completion,
    FunctionSpec,
    Message,
    Sampling,
    StreamEnd,
    StreamItem,
    TextDelta,
    TokenCount,
    ToolCall,
    tool_call_from_value,
)
from backend.chat.llm.http import HttpProvider, model_names


class _Function(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = ""
    arguments: Any = None


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    function: _Function


class _ReplyMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    content: str = ""
    tool_calls: list[_ToolCall] | None = None


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")
    message: _ReplyMessage | None = None
    done: bool = False
    done_reason: str | None = None
    error: str | None = None
    prompt_eval_count: int | None = None
    eval_count: int | None = None

    def usage(self) -> TokenCount | None:
        if self.prompt_eval_count is None and self.eval_count is None:
            return None
        return TokenCount(self.prompt_eval_count or 0, self.eval_count or 0)


class OllamaProvider(HttpProvider):
    """An Ollama server's native `/api/chat`."""

    name = "ollama"

    @property
    def url(self) -> str:
        """The `/api/chat` URL."""
        return f"{self.base_url}/api/chat"

    async def list_models(self) -> list[str]:
        """`GET /api/tags`: `{"models": [{"name": ...}, ...]}` (the models pulled locally)."""
        data = await self.get_json(f"{self.base_url}/api/tags")
        return model_names(data.get("models") if isinstance(data, dict) else None, "name")

    def add_options(self, body: dict[str, Any], tools: bool, sampling: Sampling) -> None:
        """Sampling goes in Ollama's `options` (`num_predict` for max tokens)."""
        options: dict[str, Any] = {}
        if sampling.max_tokens is not None:
            options["num_predict"] = sampling.max_tokens
        for name in ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty"):
            value = getattr(sampling, name)
            if value is not None:
                options[name] = value
        if sampling.stop:
            options["stop"] = list(sampling.stop)
        if options:
            body["options"] = options

    @staticmethod
    def wire_message(message: Message) -> dict[str, Any]:
        """A message as Ollama takes it (a tool result names its function in `tool_name`)."""
        if message.role == "tool":
            wire = {"role": "tool", "content": message.content}
            if message.name:
                wire["tool_name"] = message.name
            return wire
        result: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            result["tool_calls"] = [
                {"function": {"name": call.name, "arguments": call.arguments or {}}}
                for call in message.tool_calls
            ]
        return result

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        tools: Sequence[FunctionSpec] = (),
        sampling: Sampling = ANY_SAMPLING,
    ) -> Completion:
        """One whole answer from `/api/chat`; raises LlmError."""
        data = await self.post_json(self.url, self.body(messages, model, tools, sampling, False))
        reply = _parse(data)
        message = reply.message or _ReplyMessage()
        return Completion(message.content, _calls(message, 0), reply.done_reason, reply.usage())

    async def stream(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        tools: Sequence[FunctionSpec] = (),
        sampling: Sampling = ANY_SAMPLING,
    ) -> AsyncIterator[StreamItem]:
        """Stream from `/api/chat`: text deltas, tool calls, then the end; raises LlmError."""
        calls: list[ToolCall] = []
        body = self.body(messages, model, tools, sampling, True)
        end: StreamEnd | None = None
        said = False
        async with self.post_lines(self.url, body) as lines:
            async for line in lines:
                try:
                    reply = _parse(json.loads(line))
                except ValueError:
                    raise LlmError("ollama: a stream line is not JSON") from None
                if reply.message is not None:
                    if reply.message.content:
                        said = True
                        yield TextDelta(reply.message.content)
                    calls.extend(_calls(reply.message, len(calls)))
                if reply.done:
                    end = StreamEnd(reply.done_reason, reply.usage())
                    break
        if end is None:
            raise LlmUnavailable('ollama: the stream ended before "done" (the answer was cut)')
        if not said and not calls:
            raise LlmUnavailable("ollama: the model answered nothing (no text, no tool call)")
        for call in calls:
            yield call
        yield end


def _parse(data: Any) -> _Reply:
    try:
        reply = _Reply.model_validate(data)
    except ValidationError as exc:
        raise LlmError(f"ollama: unexpected reply shape ({exc.error_count()} errors)") from None
    if reply.error:
        raise LlmError(f"ollama: {reply.error[:160]}")
    return reply


def _calls(message: _ReplyMessage, first: int) -> tuple[ToolCall, ...]:
    return tuple(
        tool_call_from_value(
            call.id or f"call_{first + i}", call.function.name, call.function.arguments
        )
        for i, call in enumerate(message.tool_calls or ())
    )
