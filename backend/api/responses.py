"""OpenAI's Responses API over the chat pipeline (scope `chat:use`, model `dental-duckduckgo`):
`POST /v1/responses` and `GET /v1/responses/{response_id}`.

A minimal, honest subset: text in, text out, every field either honoured or refused (400
`unsupported_parameter` naming it), as `/v1/chat/completions` does (openai_compat.py).
- `input`: a string (the question), or messages (`role` user/assistant/system/developer,
  `content` a string or `input_text`/`output_text` parts); `instructions`: a system message;
- `previous_response_id`: continues the stored conversation the response belongs to (its id is
  `resp_<conversation id>_<turn>`); `conversation` (a bridge conversation id, or `{"id": ...}`):
  continues that conversation; either way its stored messages are the context before `input`;
- `store` (default true): keep the turn in that conversation (a new one without either), so the
  response can be continued and read back; `store: false` answers without keeping anything;
- `stream`: Server-Sent Events `response.created`, `response.in_progress`,
  `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`...,
  `response.output_text.done`, `response.content_part.done`, `response.output_item.done`, then
  `response.completed` (or `response.incomplete` when cut by `max_output_tokens`), each with
  its `sequence_number`; a failure after the headers is an `error` event and `response.failed`;
- `max_output_tokens`, `temperature`, `top_p`: to the model; `max_output_tokens` covers the
  whole text (an offline answer is cut to it, and the text then has no sources section: the
  references are in `sources`, as with chat completions' `max_tokens`); `usage` always, its
  `output_tokens` covering the whole text; `sources` (a bridge extension): the references;
  the links the text holds are also `url_citation` annotations;
- accepted, as they ask for nothing this answer does not do: `metadata`, `user`,
  `safety_identifier`, `prompt_cache_key`, `service_tier` "auto"/"default", `truncation`,
  `parallel_tool_calls`, `tool_choice` "none"/"auto" without tools, `text.format` text,
  `stream_options.include_obfuscation`;
- refused: client `tools` (and a `tool_choice` needing them), `max_tool_calls`, `text.format`
  JSON modes, `reasoning`, `include`, `top_logprobs`, `background`, `prompt`, non-text input
  (images, files, audio) and input items other than messages (function calls and outputs,
  item references), unknown fields. Other models: 404 `model_not_found`.
"""

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from backend.api.app import ApiError
from backend.api.chat import (
    CONVERSATION_HEADER,
    SSE_HEADERS,
    USAGE_HEADER,
    ChatFront,
    Chatter,
    check_models_allowed,
    check_openai_body,
    last_done,
    unless_client_leaves,
)
from backend.api.errors import errors
from backend.api.openai_compat import (
    CLIENT_TOOLS,
    LOGPROBS,
    MODEL_ID,
    RequestModels,
    refuse_first,
    sources_json,
)
from backend.api.openapi import streamed
from backend.chat import ChatEvent, ChatService, Done, InputMessage, Sources, Token
from backend.chat.errors import ConversationNotFound, InvalidConversationId
from backend.chat.events import SourceItem, TurnUsage
from backend.chat.llm.base import Sampling
from backend.chat.memory import Conversation, MemoryStore, check_conversation_id
from backend.devices import DeviceRegistry
from backend.mcp_servers.hub import McpServerHub

PREFIX = "resp_"
_TEXT_PARTS = ("input_text", "output_text", "text")
_MAX_ID = 200

ResponseIdPath = Annotated[
    str, Path(min_length=1, max_length=_MAX_ID, description="`resp_<conversation id>_<turn>`")
]


# ---- the request ------------------------------------------------------------------------------


class InputPart(BaseModel):
    """One part of an input message's content; only text parts are served."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(max_length=64)
    text: str | None = None


class InputItem(BaseModel):
    """One input item: a message (other item types are refused)."""

    model_config = ConfigDict(extra="allow")  # `id`, `status` of an output sent back

    type: str = Field(default="message", max_length=64)
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None

    @property
    def text(self) -> str:
        """The message's text (its text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content or [])


class TextFormat(BaseModel):
    """`text.format`: only `text` is served."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(max_length=64)


class TextConfig(BaseModel):
    """OpenAI's `text`: the output format (only `text` is served) and a verbosity hint."""

    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponseStreamOptions(BaseModel):
    """OpenAI's `stream_options` for responses."""

    model_config = ConfigDict(extra="forbid")

    include_obfuscation: bool = False  # OpenAI's padding against length side channels; no-op


class ConversationRef(BaseModel):
    """`conversation` as an object: the bridge conversation's id."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(max_length=128)


class ResponseRequest(RequestModels):
    """OpenAI's `POST /v1/responses` body, every field honoured or refused (see module)."""

    model_config = ConfigDict(extra="forbid")

    model: str = MODEL_ID
    input: str | list[InputItem] = Field(description="the question, or messages")
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=_MAX_ID)
    conversation: str | ConversationRef | None = Field(
        default=None, description="a bridge conversation id to continue"
    )
    store: bool | None = Field(default=None, description="keep the turn (default true)")
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = Field(default=None, max_length=32)
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    device_id: str | None = Field(default=None, description="use this device's tools")

    @property
    def stored(self) -> bool:
        """Whether the turn is kept (`store` defaults to true)."""
        return self.store is not False

    def sampling(self) -> Sampling:
        """The request's sampling settings, for the model."""
        return Sampling(
            max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p
        )

    def messages(self) -> list[InputMessage]:
        """The instructions and the input as chat messages (checked by `_refusals` first)."""
        found: list[InputMessage] = []
        if self.instructions:
            found.append(InputMessage(role="system", content=self.instructions))
        if isinstance(self.input, str):
            return [*found, InputMessage(role="user", content=self.input)]
        for item in self.input:
            assert item.role is not None
            found.append(InputMessage(role=item.role, content=item.text))
        return found


def _refusals(body: ResponseRequest) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    if body.tools:
        found.append(("tools", CLIENT_TOOLS))
    if body.tool_choice not in (None, "none", "auto"):
        found.append(("tool_choice", "tool_choice asks for client-side tools, not supported"))
    if body.max_tool_calls is not None:
        found.append(("max_tool_calls", "max_tool_calls is not supported: there are no tools"))
    if body.text is not None and body.text.format is not None and body.text.format.type != "text":
        found.append(
            (
                "text.format",
                f"text.format {body.text.format.type[:40]!r} cannot be honoured: the dental "
                "assistant answers in prose with a sources section",
            )
        )
    if body.reasoning:
        found.append(("reasoning", "reasoning options are not supported by this assistant"))
    if body.include:
        found.append(("include", "include: this response has text only, nothing to include"))
    if body.top_logprobs:
        found.append(("top_logprobs", LOGPROBS))
    if body.background:
        found.append(("background", "background responses are not supported; use stream"))
    if body.prompt is not None:
        found.append(("prompt", "prompt templates are not supported; send input"))
    if body.service_tier not in (None, "auto", "default"):
        found.append(("service_tier", "this bridge has one service tier: auto"))
    if body.stream_options is not None and not body.stream:
        found.append(("stream_options", "stream_options is only allowed when stream is true"))
    if body.previous_response_id is not None and body.conversation is not None:
        found.append(("conversation", "give previous_response_id or conversation, not both"))
    if isinstance(body.input, list):
        for index, item in enumerate(body.input):
            if item.type != "message":
                found.append(
                    (
                        f"input[{index}]",
                        f"input items of type {item.type!r} are not supported: this assistant "
                        "calls its own tools; send messages with text",
                    )
                )
            elif item.role is None:
                found.append((f"input[{index}].role", "a message needs a role"))
            elif isinstance(item.content, list):
                for part in item.content:
                    if part.type not in _TEXT_PARTS:
                        found.append(
                            (
                                f"input[{index}].content",
                                f"content parts of type {part.type!r} are not supported; "
                                "send input_text",
                            )
                        )
                        break
    return found


# ---- ids and threads --------------------------------------------------------------------------


def response_id(conversation_id: str, turn: int) -> str:
    """A stored response's id: its conversation and its turn (1 for the first) in it."""
    return f"{PREFIX}{conversation_id}_{turn}"


def parse_response_id(value: str) -> tuple[str, int] | None:
    """(conversation id, turn) of a stored response's id; None for any other id."""
    conversation_id, _, turn = value.removeprefix(PREFIX).rpartition("_")
    if not value.startswith(PREFIX) or not (turn.isascii() and turn.isdigit()) or int(turn) < 1:
        return None
    try:
        return check_conversation_id(conversation_id), int(turn)
    except InvalidConversationId:
        return None


@dataclass(frozen=True, slots=True)
class _Thread:
    """Where a response goes: its conversation (None: not stored), its turn there, and the
    stored messages that come before its input."""

    conversation_id: str | None
    turn: int
    history: list[InputMessage]

    @property
    def id(self) -> str:
        if self.conversation_id is None:
            return f"{PREFIX}{uuid.uuid4().hex}"
        return response_id(self.conversation_id, self.turn)


def _previous_not_found(value: str) -> ApiError:
    return ApiError(
        400,
        "previous_response_not_found",
        f"previous response with id {value[:_MAX_ID]!r} not found (a response made with "
        "store: false cannot be continued)",
        param="previous_response_id",
    )


async def _thread(memory: MemoryStore, body: ResponseRequest) -> _Thread:
    """The conversation a request continues (with its stored messages), or a new one."""
    found: Conversation | None = None
    turn = 1
    if body.previous_response_id is not None:
        parsed = parse_response_id(body.previous_response_id)
        if parsed is None:
            raise _previous_not_found(body.previous_response_id)
        conversation_id, previous = parsed
        try:
            found = await memory.get(conversation_id, with_messages=True)
        except ConversationNotFound:
            if previous != 1:
                raise _previous_not_found(body.previous_response_id) from None
            # A first turn the bridge did not keep (a refused question): continued, empty.
            return _Thread(conversation_id if body.stored else None, 1, [])
        stored = len(found.messages) // 2
        if previous > stored + 1:  # the response after the latest may be one not kept
            raise _previous_not_found(body.previous_response_id)
        if previous < stored:
            raise ApiError(
                400,
                "unsupported_parameter",
                "continuing from an earlier response than its conversation's latest "
                f"({response_id(found.id, stored)}) is not supported",
                param="previous_response_id",
            )
        turn = stored + 1
    elif body.conversation is not None:
        wanted = body.conversation if isinstance(body.conversation, str) else body.conversation.id
        try:
            found = await memory.get(check_conversation_id(wanted), with_messages=True)
        except InvalidConversationId as exc:
            raise ApiError(400, "invalid_request", str(exc), param="conversation") from None
        turn = len(found.messages) // 2 + 1
    if found is None:
        return _Thread(uuid.uuid4().hex if body.stored else None, 1, [])
    history = [InputMessage(role=m.role, content=m.content) for m in found.messages]
    return _Thread(found.id if body.stored else None, turn, history)


# ---- the response -----------------------------------------------------------------------------


def usage_json(usage: TurnUsage | None) -> dict[str, Any] | None:
    """OpenAI's Responses `usage` of a turn."""
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def citations(text: str, sources: Sequence[SourceItem]) -> list[dict[str, Any]]:
    """`url_citation` annotations for the source links the text holds."""
    found: list[dict[str, Any]] = []
    for item in sources:
        start = text.find(item.link)
        if start != -1:
            end = start + len(item.link)
            found.append(
                {
                    "type": "url_citation",
                    "url": item.link,
                    "title": item.title,
                    "start_index": start,
                    "end_index": end,
                }
            )
    return found


class ResponseShape:
    """OpenAI's Responses shapes for one response."""

    def __init__(
        self,
        response_id: str,
        body: ResponseRequest | None,
        conversation_id: str | None,
        created_at: int | None = None,
    ) -> None:
        self.id = response_id
        self.item_id = "msg_" + response_id.removeprefix(PREFIX)
        self.created_at = int(time.time()) if created_at is None else created_at
        self.body = body
        self.conversation_id = conversation_id

    def part(self, text: str, sources: Sequence[SourceItem] = ()) -> dict[str, Any]:
        """An `output_text` part, its source links as `url_citation` annotations."""
        return {
            "type": "output_text",
            "text": text,
            "annotations": citations(text, sources),
            "logprobs": [],
        }

    def item(
        self, status: str, text: str | None = None, sources: list[SourceItem] | None = None
    ) -> dict[str, Any]:
        """The output message item (no content part yet without `text`)."""
        content = [] if text is None else [self.part(text, sources or [])]
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def response(
        self,
        status: Literal["in_progress", "completed", "incomplete", "failed"],
        text: str | None = None,
        done: Done | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The `response` object in this state."""
        body = self.body
        metadata = done.metadata if done is not None else None
        item_status = "completed" if status == "completed" else "incomplete"
        output = (
            [self.item(item_status, text, metadata.sources if metadata else None)]
            if text is not None
            else []
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions if body else None,
            "max_output_tokens": body.max_output_tokens if body else None,
            "model": MODEL_ID,
            "output": output,
            "parallel_tool_calls": False,
            "previous_response_id": body.previous_response_id if body else None,
            "conversation": {"id": self.conversation_id} if self.conversation_id else None,
            "store": body.stored if body else True,
            "temperature": body.temperature if body else None,
            "top_p": body.top_p if body else None,
            "text": {"format": {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
            "truncation": "auto",
            "usage": usage_json(metadata.usage if metadata else None),
            "sources": sources_json(metadata.sources if metadata else []),
            "user": body.user if body else None,
            "metadata": (body.metadata or {}) if body else {},
        }

    def finished(self, text: str, done: Done) -> dict[str, Any]:
        """The whole response of a turn that ended: completed, or incomplete when cut."""
        cut = done.metadata.finish_reason == "length"
        return self.response("incomplete" if cut else "completed", text, done)


# ---- the routes -------------------------------------------------------------------------------


def responses_router(
    chat: ChatService,
    registry: DeviceRegistry,
    servers: McpServerHub | None = None,
    allowed: frozenset[str] | None = None,
) -> APIRouter:
    """`POST /v1/responses` and `GET /v1/responses/{response_id}` (see module)."""
    front = ChatFront(chat, registry, servers)
    router = APIRouter(tags=["chat"])

    @router.post("/v1/responses", response_model=None, responses=streamed(404, 503, json_too=True))
    async def create(body: ResponseRequest, principal: Chatter, http_request: Request) -> Response:
        check_openai_body(body, body.model)
        refuse_first(_refusals(body))
        check_models_allowed((body.chat_model, body.guardrail_model), allowed)
        thread = await _thread(chat.memory, body)
        prepared = await front.prepare(
            principal,
            messages=[*thread.history, *body.messages()],
            conversation_id=thread.conversation_id,
            device_id=body.device_id,
            client_context=True,
            store=thread.conversation_id is not None,
            sampling=body.sampling(),
            models=(body.chat_model, body.guardrail_model),
        )
        conversation_id = prepared.request.conversation_id
        headers = {CONVERSATION_HEADER: conversation_id} if conversation_id else {}
        shape = ResponseShape(thread.id, body, conversation_id)
        events = front.events(prepared, principal, "responses")
        if body.stream:
            return StreamingResponse(
                _events(shape, events),
                media_type="text/event-stream",
                headers={**headers, **SSE_HEADERS},
            )
        done = await unless_client_leaves(http_request, last_done(events))
        if done is None:
            return Response(status_code=499)  # nobody is there to read it
        if done.metadata.usage is not None:
            headers[USAGE_HEADER] = done.metadata.usage.counted_by
        whole = shape.finished(done.metadata.answer, done)
        return Response(
            json.dumps(whole, ensure_ascii=False), media_type="application/json", headers=headers
        )

    @router.get("/v1/responses/{response_id}", responses=errors(404, 503))
    async def retrieve(response_id: ResponseIdPath, _chatter: Chatter) -> dict[str, Any]:
        return await _stored_response(chat.memory, response_id)

    return router


async def _stored_response(memory: MemoryStore, value: str) -> dict[str, Any]:
    """A stored response as `GET` shows it: its text, from its conversation (no usage)."""
    parsed = parse_response_id(value)
    missing = ApiError(404, "response_not_found", f"no response {value[:_MAX_ID]!r}")
    if parsed is None:
        raise missing
    conversation_id, turn = parsed
    try:
        found = await memory.get(conversation_id, with_messages=True)
    except ConversationNotFound:
        raise missing from None
    pair = found.messages[2 * turn - 2 : 2 * turn]
    if len(pair) != 2 or (pair[0].role, pair[1].role) != ("user", "assistant"):
        raise missing
    answer = pair[1]
    shape = ResponseShape(value, None, found.id, int(answer.created_at.timestamp()))
    data = shape.response("completed", answer.content)
    data["completed_at"] = shape.created_at
    return data


def _sse(data: dict[str, Any]) -> bytes:
    text = json.dumps(data, ensure_ascii=False)
    return f"event: {data['type']}\ndata: {text}\n\n".encode()


async def _events(shape: ResponseShape, events: AsyncIterator[ChatEvent]) -> AsyncIterator[bytes]:
    """The Responses stream of one turn (see module)."""
    numbers = itertools.count()
    part = {"output_index": 0, "item_id": shape.item_id, "content_index": 0}

    def event(kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(numbers), **fields})

    yield event("response.created", response=shape.response("in_progress"))
    yield event("response.in_progress", response=shape.response("in_progress"))
    yield event("response.output_item.added", output_index=0, item=shape.item("in_progress"))
    yield event("response.content_part.added", **part, part=shape.part(""))
    said: list[str] = []
    done: Done | None = None
    try:
        async for item in events:
            delta = None
            if isinstance(item, Token):
                delta = item.text
            elif isinstance(item, Sources) and item.section:
                delta = "\n\n" + item.section
            elif isinstance(item, Done):
                done = item
            if delta:
                said.append(delta)
                yield event("response.output_text.delta", **part, delta=delta, logprobs=[])
    except Exception as exc:  # the status line is gone: OpenAI's error event, then failed
        message = f"internal error: {type(exc).__name__}"
        yield event("error", code="internal_error", message=message, param=None)
        failed = shape.response("failed", error={"code": "server_error", "message": message})
        yield event("response.failed", response=failed)
        return
    assert done is not None, "a turn always ends with Done"
    text = "".join(said)
    sources = done.metadata.sources
    status = "incomplete" if done.metadata.finish_reason == "length" else "completed"
    yield event("response.output_text.done", **part, text=text, logprobs=[])
    yield event("response.content_part.done", **part, part=shape.part(text, sources))
    item_status = "completed" if status == "completed" else "incomplete"
    whole = shape.item(item_status, text, sources)
    yield event("response.output_item.done", output_index=0, item=whole)
    final = shape.finished(text, done)
    yield event(f"response.{status}", response=final)
