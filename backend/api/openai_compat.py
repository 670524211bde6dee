"""OpenAI's chat completion request and response shapes, and what this bridge does with each
field: honoured (passed to the model), or refused with 400 and a sentence that says why.

Nothing is silently ignored. The fields an OpenAI client may send and what becomes of them:
- `messages`: the context when there is no `chat_id` (backend/chat/context.py);
- `max_tokens`, `max_completion_tokens` (the smaller wins, and never above the bridge's
  `chat_max_answer_tokens`), `stop`, `temperature`, `top_p`, `seed`, `frequency_penalty`,
  `presence_penalty`: to the model; `finish_reason: "length"` when a limit cut the answer;
  `stop` and the token limits cover the whole content: with either, the content is the answer
  alone (no sources section appended after it) and the references are only in `sources`, a
  bridge extension on every completion (and on the stream's finishing chunk);
- `usage` covers the whole content too: the model's counts plus the tokenizer's count of every
  part the bridge wrote (an offline answer, the sources section);
- `stream`, `stream_options.include_usage`: SSE chunks, and a last chunk with `usage`;
- `store`: without `chat_id`, keep this turn as a new stored conversation (its id returned);
- `user`, `metadata`, `parallel_tool_calls`, `tool_choice: "none"|"auto"` without tools,
  `response_format: {"type": "text"}`, `n: 1`, `logprobs: false`, `modalities: ["text"]`:
  accepted, since they ask for nothing this answer does not already do;
- refused: `n > 1`, client `tools`/`functions` (and `tool_choice` that needs them),
  `response_format` JSON modes, `logprobs: true`/`top_logprobs`, `logit_bias`, audio, any field
  OpenAI does not define.
"""

import time
import uuid
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from backend.api.app import ApiError
from backend.chat import InputMessage, ModelName
from backend.chat.events import SourceItem, TurnUsage
from backend.chat.llm.base import Sampling

MODEL_ID = "dental-duckduckgo"
OWNER = "esp32-mcp-bridge"


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI's padding against length side channels; no-op


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`; only `text` is served (the JSON modes are refused with a 400)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]


class RequestModels(BaseModel):
    """The models a client asks for in one request (the console's settings page; the seed's
    config.html sent `ollama_model` and `ollama_guardrail_model`)."""

    chat_model: ModelName | None = Field(
        default=None,
        validation_alias=AliasChoices("chat_model", "ollama_model"),
        description="the model that answers (null: the server's; `ollama_model` as the seed)",
    )
    guardrail_model: ModelName | None = Field(
        default=None,
        validation_alias=AliasChoices("guardrail_model", "ollama_guardrail_model"),
        description="the model that classifies the question (null: the server's)",
    )


class CompletionRequest(RequestModels):
    """OpenAI's chat completion request, every field either honoured or refused (see module)."""

    model_config = ConfigDict(extra="forbid")

    model: str = MODEL_ID
    messages: list[InputMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = Field(default=None, description="without chat_id: keep this turn")
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = Field(default=None, description="up to 4 sequences")
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    n: int | None = Field(default=None, ge=1, le=128)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    user: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None
    chat_id: str | None = Field(default=None, max_length=128, description="conversation id")
    device_id: str | None = Field(default=None, description="use this device's tools")

    def sampling(self) -> Sampling:
        """The request's sampling settings (the smaller token limit wins)."""
        limits = [n for n in (self.max_tokens, self.max_completion_tokens) if n is not None]
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return Sampling(
            max_tokens=min(limits) if limits else None,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
        )


CLIENT_TOOLS = (
    "client-side tools are not supported: this assistant calls its own tools (the device's, "
    "and the bridge's MCP servers); send no tools"
)
LOGPROBS = (
    "log probabilities are not available: the answer may be written by the bridge's offline "
    "mode, which has none"
)


def check_supported(body: CompletionRequest) -> None:
    """400 for a field asking for what this model cannot give, naming the field and why."""
    refuse_first(_refusals(body))


def refuse_first(refusals: list[tuple[str, str]]) -> None:
    """400 `unsupported_parameter` for the first (param, why) found, if any."""
    for param, message in refusals:
        raise ApiError(400, "unsupported_parameter", message, param=param)


def _refusals(body: CompletionRequest) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    if body.n is not None and body.n > 1:
        found.append(
            (
                "n",
                "n > 1 is not supported: the assistant gives one answer per request "
                "(its tool calls act on a real device, once)",
            )
        )
    if body.tools or body.functions:
        param = "tools" if body.tools else "functions"
        found.append((param, CLIENT_TOOLS))
    if body.tool_choice not in (None, "none", "auto") or body.function_call not in (
        None,
        "none",
        "auto",
    ):
        param = "tool_choice" if body.tool_choice not in (None, "none", "auto") else "function_call"
        found.append((param, f"{param} asks for client-side tools, which are not supported"))
    if body.response_format is not None and body.response_format.type != "text":
        found.append(
            (
                "response_format",
                f"response_format {body.response_format.type!r} cannot "
                "be honoured: the dental assistant answers in prose with a sources section",
            )
        )
    if body.logprobs or body.top_logprobs:
        param = "logprobs" if body.logprobs else "top_logprobs"
        found.append((param, LOGPROBS))
    if body.logit_bias:
        found.append(("logit_bias", "logit_bias is not supported"))
    if body.audio is not None or (body.modalities and body.modalities != ["text"]):
        param = "audio" if body.audio is not None else "modalities"
        found.append(
            (param, "this endpoint answers in text only; devices talk to the bridge for speech")
        )
    if body.stream_options is not None and not body.stream:
        found.append(("stream_options", "stream_options is only allowed when stream is true"))
    if isinstance(body.stop, list) and len(body.stop) > 4:
        found.append(("stop", "stop takes at most 4 sequences"))
    for index, message in enumerate(body.messages):
        if isinstance(message.content, list):
            for part in message.content:
                if part.get("type") not in ("text", None):
                    found.append(
                        (
                            f"messages[{index}].content",
                            f"content parts of type "
                            f"{str(part.get('type'))[:40]!r} are not supported; send text",
                        )
                    )
                    break
    return found


def sources_json(sources: list[SourceItem]) -> list[dict[str, str]]:
    """The answer's references (`title`, `link`, `origin`): a bridge extension beside the
    content, the only place they are when `stop` or `max_tokens` left the section out."""
    return [item.model_dump(mode="json") for item in sources]


def usage_json(usage: TurnUsage | None) -> dict[str, int] | None:
    """OpenAI's `usage` object of a turn, or None when the provider gave none."""
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


class CompletionShape:
    """OpenAI's response shapes for one completion. `fingerprint` is the stored conversation's id
    (the data-flow design reads it there), or a fixed `fp_` value for a turn that is not stored."""

    def __init__(self, conversation_id: str | None) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.conversation_id = conversation_id

    def base(self, kind: Literal["chat.completion", "chat.completion.chunk"]) -> dict[str, Any]:
        """The fields every completion object and chunk shares."""
        data: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": MODEL_ID,
            "system_fingerprint": self.conversation_id or "fp_esp32_bridge",
        }
        if self.conversation_id:
            data["conversation_id"] = self.conversation_id
        return data

    def whole(
        self, answer: str, finish: str, usage: TurnUsage | None, sources: list[SourceItem]
    ) -> dict[str, Any]:
        """A whole `chat.completion` (non-streamed), with the answer's `sources` beside it."""
        return {
            **self.base("chat.completion"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer, "refusal": None},
                    "finish_reason": finish,
                    "logprobs": None,
                }
            ],
            "usage": usage_json(usage),
            "sources": sources_json(sources),
        }

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        """One `chat.completion.chunk` with this delta."""
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {**self.base("chat.completion.chunk"), "choices": [choice]}

    def last_chunk(self, finish: str, sources: list[SourceItem]) -> dict[str, Any]:
        """The chunk with the finish reason, and the answer's `sources` beside it."""
        return {**self.chunk({}, finish), "sources": sources_json(sources)}

    def usage_chunk(self, usage: TurnUsage | None) -> dict[str, Any]:
        """The last chunk, with no choice and the turn's usage (`include_usage`)."""
        return {**self.base("chat.completion.chunk"), "choices": [], "usage": usage_json(usage)}
