"""OpenAI-compatible chat completions: `POST {base}/v1/chat/completions`.

Works with OpenAI, Groq, vLLM, LM Studio, llama.cpp server and Ollama's `/v1`. Tool-call
`arguments` arrive as a JSON *string*; streamed calls come as SSE deltas joined by `index`.
Streams ask for `stream_options.include_usage`: the token counts arrive in a last chunk with no
choices. A stream is complete only with `data: [DONE]`; one cut before it is a failure.
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
    ToolCallBuilder,
    tool_call_from_text,
)
from backend.chat.llm.http import HttpProvider, model_names


class _Function(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    arguments: str | None = None


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    index: int | None = None
    id: str | None = None
    function: _Function | None = None


class _ReplyMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    content: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Choice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    message: _ReplyMessage | None = None
    delta: _ReplyMessage | None = None
    finish_reason: str | None = None


class _Usage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def count(self) -> TokenCount:
        return TokenCount(self.prompt_tokens, self.completion_tokens)


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")
    choices: list[_Choice] = []
    usage: _Usage | None = None


_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "frequency_penalty",
    "presence_penalty",
)


class OpenAiProvider(HttpProvider):
    """An OpenAI-compatible `/v1/chat/completions` server."""

    name = "openai"

    @property
    def url(self) -> str:
        """The chat completions URL under the base URL (with or without its `/v1`)."""
        base = self.base_url
        return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"

    @property
    def models_url(self) -> str:
        """The models URL under the base URL (with or without its `/v1`)."""
        base = self.base_url
        return f"{base}/models" if base.endswith("/v1") else f"{base}/v1/models"

    async def list_models(self) -> list[str]:
        """`GET /v1/models`: `{"data": [{"id": ...}, ...]}`."""
        data = await self.get_json(self.models_url)
        return model_names(data.get("data") if isinstance(data, dict) else None, "id")

    def add_options(self, body: dict[str, Any], tools: bool, sampling: Sampling) -> None:
        """`tool_choice: auto` with tools, usage in streams, the sampling fields that are set."""
        if tools:
            body["tool_choice"] = "auto"
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        for name in _SAMPLING_FIELDS:
            value = getattr(sampling, name)
            if value is not None:
                body[name] = value
        if sampling.stop:
            body["stop"] = list(sampling.stop)

    @staticmethod
    def wire_message(message: Message) -> dict[str, Any]:
        """A message in OpenAI's shape (tool results by `tool_call_id`)."""
        if message.role == "tool":
            return {
                "role": "tool",
                "tool_call_id": message.tool_call_id,
                "content": message.content,
            }
        wire: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            # "" rather than null: some OpenAI-compatible servers answer null with HTTP 500.
            wire["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.raw_arguments},
                }
                for call in message.tool_calls
            ]
        return wire

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        tools: Sequence[FunctionSpec] = (),
        sampling: Sampling = ANY_SAMPLING,
    ) -> Completion:
        """One whole answer; raises LlmError, also when the reply has no message."""
        data = await self.post_json(self.url, self.body(messages, model, tools, sampling, False))
        reply = _parse(data)
        if not reply.choices or reply.choices[0].message is None:
            raise LlmError("openai: the reply has no choices[0].message")
        choice = reply.choices[0]
        assert choice.message is not None
        calls = tuple(
            tool_call_from_text(
                call.id or f"call_{index}",
                (call.function.name if call.function else None) or "",
                (call.function.arguments if call.function else None) or "",
            )
            for index, call in enumerate(choice.message.tool_calls or ())
        )
        usage = reply.usage.count() if reply.usage is not None else None
        return Completion(choice.message.content or "", calls, choice.finish_reason, usage)

    async def stream(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        tools: Sequence[FunctionSpec] = (),
        sampling: Sampling = ANY_SAMPLING,
    ) -> AsyncIterator[StreamItem]:
        """Stream: text deltas, tool calls assembled from fragments, the end; raises LlmError."""
        builders: dict[int, ToolCallBuilder] = {}
        body = self.body(messages, model, tools, sampling, True)
        done = said = False
        finish: str | None = None
        usage: TokenCount | None = None
        async with self.post_lines(self.url, body) as lines:
            async for line in lines:
                if not line.startswith("data:"):
                    continue  # SSE comments, event names, keep-alives
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    chunk = _parse(json.loads(payload))
                except ValueError:
                    raise LlmError("openai: a stream chunk is not JSON") from None
                if chunk.usage is not None:
                    usage = chunk.usage.count()
                if not chunk.choices:
                    continue
                finish = chunk.choices[0].finish_reason or finish
                delta = chunk.choices[0].delta
                if delta is None:
                    continue
                if delta.content:
                    said = True
                    yield TextDelta(delta.content)
                for position, piece in enumerate(delta.tool_calls or ()):
                    index = piece.index if piece.index is not None else position
                    builder = builders.setdefault(index, ToolCallBuilder())
                    if piece.id:
                        builder.id = piece.id
                    if piece.function is not None:
                        if piece.function.name:
                            builder.name = piece.function.name
                        if piece.function.arguments:
                            builder.fragments.append(piece.function.arguments)
        if not done:
            raise LlmUnavailable("openai: the stream ended before [DONE] (the answer was cut)")
        if not said and not builders:
            raise LlmUnavailable("openai: the model answered nothing (no text, no tool call)")
        for index in sorted(builders):
            yield builders[index].finish(f"call_{index}")
        yield StreamEnd(finish, usage)


def _parse(data: Any) -> _Reply:
    try:
        return _Reply.model_validate(data)
    except ValidationError as exc:
        raise LlmError(f"openai: unexpected reply shape ({exc.error_count()} errors)") from None
