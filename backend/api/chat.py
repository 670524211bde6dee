"""The chat pipeline over HTTP (scope `chat:use`), on the same app and port as the admin API.

- `POST /v1/chat/completions`: OpenAI-compatible (model `dental-duckduckgo`); extra body fields
  `chat_id` (the conversation) and `device_id` (whose tools the turn may use). `stream: true`
  answers with SSE chunks in OpenAI's chunk format ending with `data: [DONE]`; otherwise one
  `chat.completion`. The conversation id comes back in `system_fingerprint` (the data-flow
  design, step 11) and in the `X-Conversation-Id` header.
- `POST /v1/responses`, `GET /v1/responses/{id}`: OpenAI's Responses API, in
  backend/api/responses.py (it shares this module's checks, `ChatFront` and helpers).
- `GET /v1/models`, `GET /v1/models/{id}`.
- `GET /v1/conversations` (paged; `q` searches titles and messages), `GET
  /v1/conversations/{id}` (history and summary), `PATCH /v1/conversations/{id}` (`{"title"}`),
  `DELETE /v1/conversations/{id}`.
- `POST /api/chat/stream` (the chat integration design): Server-Sent Events `token`, `mcp_tool`
  (`started`/`completed`/`error`), `sources`, `done` with the turn's metadata.

Text must be Unicode: a string with a lone surrogate (JSON `"\ud800"`, which no UTF-8 encoder
takes) anywhere in a body is 400 `invalid_text` naming the field, as OpenAI's API refuses a body
it cannot read, rather than silently changed (text from a device is repaired instead, see
backend/dialogue/device_chat.py).

A turn may call a device's tools only if the caller's key may call that device; otherwise the
turn goes on without them and the stream says why (an `mcp_tool` `error` event). An unknown
device is 404 `unknown_device`, a known offline one 503 `device_offline`.
"""

import asyncio
import contextlib
import json
import time
import unicodedata
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import structlog
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backend.api.app import ApiError
from backend.api.errors import errors
from backend.api.openai_compat import (
    MODEL_ID,
    OWNER,
    CompletionRequest,
    CompletionShape,
    RequestModels,
    check_supported,
)
from backend.api.openapi import ConversationIdPath, streamed
from backend.api.scopes import actor_of, needs
from backend.chat import (
    MAX_QUERY_CHARS,
    ChatEvent,
    ChatService,
    DeviceToolBox,
    Done,
    InputMessage,
    Sources,
    Token,
    ToolBox,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnRequest,
)
from backend.chat.errors import ConversationNotFound, LlmError
from backend.chat.llm.base import ANY_SAMPLING, Sampling
from backend.chat.memory import (
    MAX_SEARCH_LENGTH,
    MAX_TITLE_LENGTH,
    Conversation,
    check_conversation_id,
)
from backend.chat.text import first_surrogate
from backend.config import Settings
from backend.devices import DeviceRegistry, DeviceState
from backend.keys import Principal, Scope
from backend.mcp_servers.hub import McpServerHub

log = structlog.get_logger("api.chat")
_T = TypeVar("_T")

CONVERSATION_HEADER = "X-Conversation-Id"
USAGE_HEADER = "X-Usage-Counted-By"  # "provider" (the model's counts) or "tokenizer"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_MAX_LISTED_MODELS = 1000  # a provider listing more is cut: the page shows a select

Chatter = Annotated[Principal, Depends(needs(Scope.CHAT_USE))]


def check_text(value: Any, where: str = "") -> None:
    """400 `invalid_text` if any string (or key) in a parsed body holds a lone surrogate."""
    if isinstance(value, str):
        index = first_surrogate(value)
        if index is not None:
            raise ApiError(
                400,
                "invalid_text",
                f"{where}: character {index} is a lone UTF-16 surrogate "
                f"(\\u{ord(value[index]):04x}), which is not Unicode text; send valid UTF-8",
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, f"a key in {where or 'the body'}")  # a key is checked first
            check_text(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for number, item in enumerate(value):
            check_text(item, f"{where}[{number}]")


def unknown_model(model: str) -> ApiError:
    """The 404 for a model this bridge does not serve (OpenAI's `model_not_found`)."""
    return ApiError(
        404, "model_not_found", f"no model {model[:80]!r}; this bridge serves {MODEL_ID!r}"
    )


def check_openai_body(body: BaseModel, model: str) -> None:
    """What every OpenAI-style request passes first: Unicode text everywhere, then this bridge's
    model (404 `model_not_found` for another)."""
    check_text(body.model_dump())
    if model != MODEL_ID:
        raise unknown_model(model)


# ---- request bodies ---------------------------------------------------------------------------


class StreamRequest(RequestModels):
    """Seed 002's `POST /chat/stream` body (camelCase names accepted too)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    message: str = Field(min_length=1, max_length=MAX_QUERY_CHARS)
    conversation_id: str | None = Field(default=None, alias="conversationId", max_length=128)
    device_id: str | None = Field(default=None, alias="deviceId")


_NOT_CONTROL = "[^\\u0000-\\u001f\\u007f-\\u009f]"
TITLE_PATTERN = f"^{_NOT_CONTROL}*[^\\s\\u0000-\\u001f\\u007f-\\u009f]{_NOT_CONTROL}*$"


class ConversationPatch(BaseModel):
    """`PATCH /v1/conversations/{id}`: the new title (one line; spaces at its ends dropped)."""

    model_config = ConfigDict(extra="forbid")

    title: str = Field(
        min_length=1,
        max_length=MAX_TITLE_LENGTH,
        # Checked in the route (one message for both rules): no control character, and one
        # character at least that is not a space.
        json_schema_extra={"pattern": TITLE_PATTERN},
    )


class ModelDefaults(BaseModel):
    """The provider's configured models: for the chat and for the guardrail."""

    chat: str | None
    guardrail: str | None


class ChatModels(BaseModel):
    """`GET /api/chat/models`: the provider, its defaults, the models it lists; `error` says why
    the list is empty when the provider could not be asked."""

    provider: Literal["openai", "ollama", "none"]
    defaults: ModelDefaults
    models: list[str]
    error: str | None = None


def allowed_models(settings: Settings) -> frozenset[str] | None:
    """The models a request may ask for: `chat_models_allowed` and the configured two, or None
    (any the model service has)."""
    if settings.chat_models_allowed is None:
        return None
    return frozenset([*settings.chat_models_allowed, settings.llm_model, settings.guardrail_model])


def check_models_allowed(
    models: tuple[str | None, str | None], allowed: frozenset[str] | None
) -> None:
    """400 `model_not_allowed` for a requested model outside `chat_models_allowed`: a key may
    choose among the models the operator allowed, not run up a bill on any other."""
    if allowed is None:
        return
    for param, model in zip(("chat_model", "guardrail_model"), models, strict=True):
        if model is not None and model not in allowed:
            message = f"model {model[:80]!r} is not allowed here (setting chat_models_allowed)"
            raise ApiError(400, "model_not_allowed", message, param=param)


async def provider_models(chat: ChatService, allowed: frozenset[str] | None = None) -> ChatModels:
    """The provider's models (only `allowed` ones); a failing one gives `error`, not a raise."""
    llm = chat.llm
    if llm is None:
        return ChatModels(
            provider="none",
            defaults=ModelDefaults(chat=None, guardrail=None),
            models=[],
            error="no LLM configured (llm_provider = none): answers come from offline mode",
        )
    defaults = ModelDefaults(chat=llm.models.chat, guardrail=llm.models.guardrail)
    kind: Literal["openai", "ollama"] = "ollama" if llm.name == "ollama" else "openai"
    try:
        names = await llm.list_models()
    except LlmError as exc:  # unreachable, refused, garbled: the page still offers the defaults
        log.info("chat model listing failed", provider=llm.name, error=str(exc))
        return ChatModels(provider=kind, defaults=defaults, models=[], error=str(exc))
    if allowed is not None:
        names = [name for name in names if name in allowed]
    return ChatModels(provider=kind, defaults=defaults, models=names[:_MAX_LISTED_MODELS])


# ---- shared views -----------------------------------------------------------------------------


def conversation_json(conversation: Conversation, *, with_messages: bool = False) -> dict[str, Any]:
    """A conversation as the API and `/mcp` show it."""
    data: dict[str, Any] = {
        "id": conversation.id,
        "object": "conversation",
        "device_id": conversation.device_id,
        "title": conversation.title,
        "summary": conversation.summary,
        "message_count": conversation.message_count,
        "created_at": conversation.created_at.isoformat(),
        "updated_at": conversation.updated_at.isoformat(),
    }
    if with_messages:
        data["messages"] = [
            {
                "role": message.role,
                "content": message.content,
                "created_at": message.created_at.isoformat(),
                "metadata": message.metadata,
            }
            for message in conversation.messages
        ]
    return data


def seed_event(event: ChatEvent) -> dict[str, Any]:
    """A chat event in the chat integration design's SSE shape (`token`, `mcp_tool`, `sources`,
    `done`)."""
    if isinstance(event, Token):
        return {"type": "token", "token": event.text}
    if isinstance(event, ToolStarted):
        return {
            "type": "mcp_tool",
            "tool": event.tool,
            "status": "started",
            "arguments": event.arguments,
        }
    if isinstance(event, ToolCompleted):
        return {
            "type": "mcp_tool",
            "tool": event.tool,
            "status": "completed",
            "result": [{"type": "text", "text": event.result_text}],
            "is_error": event.is_error,
            "duration_ms": event.duration_ms,
        }
    if isinstance(event, ToolFailed):
        return {
            "type": "mcp_tool",
            "tool": event.tool,
            "status": "error",
            "error": event.error,
            "duration_ms": event.duration_ms,
        }
    if isinstance(event, Sources):
        return event.model_dump(mode="json")
    assert isinstance(event, Done)
    metadata = event.metadata.model_dump(mode="json")
    return {"type": "done", "conversation_id": metadata["conversation_id"], "metadata": metadata}


def sse(data: dict[str, Any] | str) -> bytes:
    """One Server-Sent Events `data:` frame of JSON (or of a literal such as `[DONE]`)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


# ---- turns ------------------------------------------------------------------------------------


_READY = frozenset({DeviceState.READY})
_CHOICES_LISTED = 200


@dataclass(frozen=True, slots=True)
class PreparedTurn:
    """A checked request (pure data) and the tools its turn may use."""

    request: TurnRequest
    toolbox: ToolBox | None


class ChatFront:
    """What both HTTP front ends share: the device toolbox, the conversation id, the log line."""

    def __init__(
        self, chat: ChatService, registry: DeviceRegistry, servers: McpServerHub | None = None
    ) -> None:
        self.chat = chat
        self.registry = registry
        self.servers = servers

    async def prepare(
        self,
        principal: Principal,
        *,
        messages: list[InputMessage] | None = None,
        text: str | None = None,
        conversation_id: str | None,
        device_id: str | None,
        client_context: bool = False,
        store: bool = True,
        sampling: Sampling = ANY_SAMPLING,
        models: tuple[str | None, str | None] = (None, None),
    ) -> PreparedTurn:
        """A checked turn request with its conversation id settled before the turn starts
        (so a streamed answer can carry it in its headers). `client_context`: the messages are
        the context (OpenAI clients without `chat_id`), stored only with `store`, in a new
        conversation or in `conversation_id` (the Responses API continuing one). `models`:
        this request's (chat, guardrail) models, None for the server's."""
        try:
            request = TurnRequest(
                messages=messages or [],
                text=text,
                device_id=device_id,
                context="messages" if client_context else "memory",
                store=store,
                sampling=sampling,
                count_usage=messages is not None,  # the OpenAI front end reports usage
                chat_model=models[0],
                guardrail_model=models[1],
            )
        except ValidationError as exc:
            message = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
            too_long = len(TurnRequest.model_construct(messages=messages or [], text=text).query)
            code = "context_length_exceeded" if too_long > MAX_QUERY_CHARS else "invalid_request"
            raise ApiError(400, code, message, param="messages" if messages else "text") from None
        toolbox: ToolBox | None = None
        if device_id is not None:
            device = self.registry.require(device_id)  # 404 unknown, 503 offline
            reason = principal.call_denied_reason(device_id)
            toolbox = DeviceToolBox(
                device, unavailable_reason=reason, actor=f"chat:{actor_of(principal)}"
            )
        else:
            request.device_choices = self._choices(principal)
        if self.servers is not None:  # external MCP servers this key may use (mcp:<name>)
            toolbox = self.servers.toolbox_for(principal, device_id, toolbox)
        if client_context:
            request.conversation_id = (conversation_id or uuid.uuid4().hex) if store else None
        elif conversation_id is not None:
            request.conversation_id = check_conversation_id(conversation_id)
        elif device_id is not None:
            request.conversation_id = await self.chat.memory.device_conversation_id(device_id)
        else:
            request.conversation_id = uuid.uuid4().hex
        return PreparedTurn(request, toolbox)

    def _choices(self, principal: Principal) -> list[str]:
        """The ready devices this key may call: named when a device request comes without a
        device ("which device?"); the first page of the listing only."""
        page = self.registry.listing(states=_READY, limit=_CHOICES_LISTED)
        ids = (summary["device_id"] for summary in page.devices)
        return [device_id for device_id in ids if principal.may_call(device_id)]

    async def events(
        self, prepared: PreparedTurn, principal: Principal, front: str
    ) -> AsyncIterator[ChatEvent]:
        """The turn's events, with one log line for the request when it ends (or is dropped)."""
        request = prepared.request
        began = time.perf_counter()
        outcome = "abandoned"
        try:
            async for event in self.chat.run_turn(request, prepared.toolbox):
                if isinstance(event, Done):
                    outcome = event.metadata.guardrail.verdict
                yield event
        except Exception:
            outcome = "failed"
            raise
        finally:
            log.info(
                "chat request",
                step="request",
                front=front,
                key_id=principal.key_id,
                conversation_id=request.conversation_id,
                device_id=request.device_id,
                outcome=outcome,
                duration_ms=round((time.perf_counter() - began) * 1000, 3),
            )


def chat_router(
    chat: ChatService,
    registry: DeviceRegistry,
    servers: McpServerHub | None = None,
    allowed: frozenset[str] | None = None,
) -> APIRouter:
    """The chat routes; `allowed`: the models a request may ask for (None: any)."""
    return ChatRoutes(chat, ChatFront(chat, registry, servers), allowed).router()


class ChatRoutes:
    """The chat routes' handlers: the OpenAI-compatible API, conversations and the SSE stream."""

    def __init__(self, chat: ChatService, front: ChatFront, allowed: frozenset[str] | None) -> None:
        self.chat = chat
        self.front = front
        self.allowed = allowed

    def router(self) -> APIRouter:
        """The routes, each on its handler below."""
        router = APIRouter(tags=["chat"])
        add = router.add_api_route
        add("/v1/models", self.list_models, methods=["GET"])
        add("/api/chat/models", self.chat_models, methods=["GET"], response_model=ChatModels)
        add("/v1/models/{model}", self.get_model, methods=["GET"], responses=errors(404))
        add(
            "/v1/chat/completions",
            self.completions,
            methods=["POST"],
            response_model=None,
            responses=streamed(404, 503, json_too=True),
        )
        add("/v1/conversations", self.list_conversations, methods=["GET"], responses=errors(503))
        one = "/v1/conversations/{conversation_id}"
        add(one, self.get_conversation, methods=["GET"], responses=errors(404, 503))
        add(one, self.rename_conversation, methods=["PATCH"], responses=errors(404, 503))
        add(
            one,
            self.delete_conversation,
            methods=["DELETE"],
            status_code=204,
            responses=errors(404, 503),
        )
        add(
            "/api/chat/stream",
            self.stream,
            methods=["POST"],
            response_model=None,
            responses=streamed(404, 503),
        )
        return router

    async def list_models(self, _chatter: Chatter) -> dict[str, Any]:
        """The one model this bridge serves."""
        return {"object": "list", "data": [_model()]}

    async def chat_models(self, _chatter: Chatter) -> ChatModels:
        """What the configured provider offers, for the console's settings page."""
        return await provider_models(self.chat, self.allowed)

    async def get_model(self, model: str, _chatter: Chatter) -> dict[str, Any]:
        """The model by its id (404 for any other)."""
        if model != MODEL_ID:
            raise unknown_model(model)
        return _model()

    async def completions(
        self, body: CompletionRequest, principal: Chatter, http_request: Request
    ) -> Response:
        """OpenAI's chat completions, streamed or whole (docs/chat.md)."""
        check_openai_body(body, body.model)
        check_supported(body)
        check_models_allowed((body.chat_model, body.guardrail_model), self.allowed)
        client_context = body.chat_id is None
        prepared = await self.front.prepare(
            principal,
            messages=body.messages,
            conversation_id=body.chat_id,
            device_id=body.device_id,
            client_context=client_context,
            store=bool(body.store) if client_context else True,
            sampling=body.sampling(),
            models=(body.chat_model, body.guardrail_model),
        )
        conversation_id = prepared.request.conversation_id
        headers = {CONVERSATION_HEADER: conversation_id} if conversation_id else {}
        shape = CompletionShape(conversation_id)
        events = self.front.events(prepared, principal, "openai")
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                _completion_chunks(shape, events, include_usage),
                media_type="text/event-stream",
                headers={**headers, **SSE_HEADERS},
            )
        done = await unless_client_leaves(http_request, last_done(events))
        if done is None:
            return Response(status_code=499)  # nobody is there to read it
        metadata = done.metadata
        whole = shape.whole(
            metadata.answer, metadata.finish_reason, metadata.usage, metadata.sources
        )
        if metadata.usage is not None:
            headers[USAGE_HEADER] = metadata.usage.counted_by
        return Response(
            json.dumps(whole, ensure_ascii=False),
            media_type="application/json",
            headers=headers,
        )

    async def list_conversations(
        self,
        _chatter: Chatter,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
        device_id: Annotated[str | None, Query(description="only this device's")] = None,
        q: Annotated[
            str | None,
            Query(
                max_length=MAX_SEARCH_LENGTH,
                description="only those whose title or a message contains this text",
            ),
        ] = None,
    ) -> dict[str, Any]:
        """Stored conversations, newest first, a page at a time; `q` searches them."""
        page = await self.chat.memory.list_conversations(
            limit=limit, offset=offset, device_id=device_id, query=q
        )
        end = offset + len(page.items)
        return {
            "object": "list",
            "data": [conversation_json(item) for item in page.items],
            "total": page.total,
            "limit": limit,
            "offset": offset,
            "next_offset": end if end < page.total else None,
        }

    async def get_conversation(
        self, conversation_id: ConversationIdPath, _chatter: Chatter
    ) -> dict[str, Any]:
        """One conversation with its messages and summary."""
        found = await self.chat.memory.get(conversation_id, with_messages=True)
        return conversation_json(found, with_messages=True)

    async def rename_conversation(
        self, conversation_id: ConversationIdPath, body: ConversationPatch, _chatter: Chatter
    ) -> dict[str, Any]:
        """Give a conversation a title (its `updated_at` is kept)."""
        check_text(body.model_dump())
        title = " ".join(body.title.split())
        if not title or any(unicodedata.category(char) == "Cc" for char in body.title):
            raise ApiError(
                400,
                "invalid_request",
                "title: one line of visible text (no control characters, not only spaces)",
                param="title",
            )
        return conversation_json(await self.chat.memory.rename(conversation_id, title))

    async def delete_conversation(
        self, conversation_id: ConversationIdPath, _chatter: Chatter
    ) -> Response:
        """Delete a conversation and its messages."""
        if not await self.chat.memory.delete(conversation_id):
            raise ConversationNotFound(conversation_id)
        return Response(status_code=204)

    async def stream(self, body: StreamRequest, principal: Chatter) -> StreamingResponse:
        """One chat turn as server-sent events (the chat integration design's API)."""
        check_text(body.model_dump())
        check_models_allowed((body.chat_model, body.guardrail_model), self.allowed)
        prepared = await self.front.prepare(
            principal,
            text=body.message,
            conversation_id=body.conversation_id,
            device_id=body.device_id,
            models=(body.chat_model, body.guardrail_model),
        )
        events = self.front.events(prepared, principal, "sse")
        conversation_id = prepared.request.conversation_id
        return StreamingResponse(
            _seed_stream(events),
            media_type="text/event-stream",
            headers={CONVERSATION_HEADER: conversation_id or "", **SSE_HEADERS},
        )


def _model() -> dict[str, Any]:
    return {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": OWNER}


async def _seed_stream(events: AsyncIterator[ChatEvent]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield sse(seed_event(event))
    except Exception as exc:  # the status line is gone: say it in the stream
        log.exception("chat stream failed")
        yield sse({"type": "error", "error": f"internal error: {type(exc).__name__}"})


async def last_done(events: AsyncIterator[ChatEvent]) -> Done:
    """The turn's `Done`, its other events read and dropped (a non-streamed answer)."""
    done: Done | None = None
    async for event in events:
        if isinstance(event, Done):
            done = event
    assert done is not None, "a turn always ends with Done"
    return done


async def unless_client_leaves(request: Request, work: Awaitable[_T]) -> _T | None:
    """The work's result, or None once the client has gone (the work is then cancelled: a
    non-streamed turn kept the model busy for 719 s after its client left)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    log.info("chat request abandoned by its client", step="request", front="openai")
    return None


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _completion_chunks(
    shape: CompletionShape, events: AsyncIterator[ChatEvent], include_usage: bool
) -> AsyncIterator[bytes]:
    yield sse(shape.chunk({"role": "assistant", "content": ""}))
    done: Done | None = None
    try:
        async for event in events:
            if isinstance(event, Token):
                yield sse(shape.chunk({"content": event.text}))
            elif isinstance(event, Sources) and event.section:
                yield sse(shape.chunk({"content": "\n\n" + event.section}))
            elif isinstance(event, Done):
                done = event
    except Exception as exc:  # the status line is gone: an OpenAI-style error in the stream
        log.exception("chat completion stream failed")
        error = {
            "message": f"internal error: {type(exc).__name__}",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
        yield sse({"error": error})
        return
    finish = done.metadata.finish_reason if done is not None else "stop"
    yield sse(shape.last_chunk(finish, done.metadata.sources if done is not None else []))
    if include_usage:
        yield sse(shape.usage_chunk(done.metadata.usage if done is not None else None))
    yield sse("[DONE]")
