"""The events of one chat turn: what every front end (SSE, OpenAI-compatible API, device TTS,
CLI) consumes.

A turn is an async stream of these, in this order: zero or more `Token`s interleaved with tool
events (`ToolStarted` then `ToolCompleted` or `ToolFailed`), then at most one `Sources`, then
exactly one `Done`. Tokens are the spoken answer only (a token's `speech` says how a voice
reads it when that differs from its text); the sources section (a heading and the numbered
links) travels in `Sources` so that a voice front end does not read URLs aloud, while a text
front end appends `Sources.section`. `Done.metadata.answer` is the full stored text.

Every event is a frozen pydantic model with a `type` discriminator, so a front end serialises
it with `event.model_dump(mode="json")` and a client parses it back with `parse_event`.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from backend.chat.text import Language

StepName = Literal[
    "language",
    "guardrail",
    "memory_load",
    "search",
    "llm",
    "tools",
    "offline",
    "memory_store",
    "summary",
]


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Token(_Event):
    """A piece of the answer text, as the model (or the offline answerer) produced it.

    `speech` is what a voice says for this piece when that differs from `text`: "" for text
    meant for screens only (the offline note, "(Offline mode: ...)"), a sentence in words for
    text that names tools and raw results ("Done: self.audio_speaker.set_volume → true" is said
    "Volume set to 30."). None: the text is said as it is. Text front ends ignore it."""

    type: Literal["token"] = "token"
    text: str
    speech: str | None = None

    @property
    def spoken(self) -> str:
        """What a voice says for this piece."""
        return self.text if self.speech is None else self.speech


class ToolStarted(_Event):
    """A device tool is being called. `tool` is the device's MCP name, `llm_name` the model's."""

    type: Literal["tool_started"] = "tool_started"
    tool: str
    llm_name: str
    arguments: dict[str, Any]


class ToolCompleted(_Event):
    """The device answered; `is_error` is the tool's own `isError` (the model sees it anyway)."""

    type: Literal["tool_completed"] = "tool_completed"
    tool: str
    llm_name: str
    result_text: str
    is_error: bool = False
    duration_ms: float | None = None  # the device call, as the bridge timed it


class ToolFailed(_Event):
    """The call did not happen or did not finish: device error, timeout, invalid arguments from
    the model, or no permission (missing scope). `error` is one line for an operator."""

    type: Literal["tool_failed"] = "tool_failed"
    tool: str
    llm_name: str
    error: str
    # The call's time; None when no call was made (invalid arguments, no permission).
    duration_ms: float | None = None


class SourceItem(BaseModel):
    """A source the answer drew on (web result or knowledge-base entry), sent apart."""

    model_config = ConfigDict(frozen=True)

    title: str
    link: str
    # Who found it: "duckduckgo", "google", "searxng" (web search), "kb" (the knowledge base),
    # "web" (a web search that does not say which engine).
    origin: Literal["web", "duckduckgo", "google", "searxng", "kb"]


class Sources(_Event):
    """The references behind the answer, and the section text a text front end appends."""

    type: Literal["sources"] = "sources"
    items: list[SourceItem]
    section: str


class Guardrail(BaseModel):
    """The guardrail's verdict on the question: passed or refused, why, by rules or model."""

    model_config = ConfigDict(frozen=True)

    verdict: Literal["passed", "refused"]
    reason: str
    by: Literal["rules", "llm"]


class TurnUsage(BaseModel):
    """OpenAI's `usage` for the turn; `counted_by` says where the numbers come from."""

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    counted_by: Literal["provider", "tokenizer"]


class Confirmation(BaseModel):
    """The risky call a turn ended asking about: a "yes" in the same conversation runs it."""

    model_config = ConfigDict(frozen=True)

    tool: str
    arguments: dict[str, Any]
    reason: str


class TurnMetadata(BaseModel):
    """What `done` says about the turn: conversation, language, guardrail, sources, timings."""

    model_config = ConfigDict(frozen=True)

    conversation_id: str | None
    device_id: str | None = None
    language: Language
    guardrail: Guardrail
    stored: bool
    sources: list[SourceItem] = Field(default_factory=list)
    offline: bool = False
    offline_reason: str | None = None
    search: Literal["ok", "failed", "skipped"] = "skipped"
    search_error: str | None = None
    steps_ms: dict[str, float] = Field(default_factory=dict)
    tool_rounds: int = 0
    answer: str = ""
    finish_reason: Literal["stop", "length"] = "stop"
    usage: TurnUsage | None = None
    confirmation: Confirmation | None = None


class Done(_Event):
    """The last event of a turn, with its metadata."""

    type: Literal["done"] = "done"
    metadata: TurnMetadata


ChatEvent = Annotated[
    Token | ToolStarted | ToolCompleted | ToolFailed | Sources | Done, Field(discriminator="type")
]
_EVENT_ADAPTER: TypeAdapter[ChatEvent] = TypeAdapter(ChatEvent)


def parse_event(data: dict[str, Any] | str | bytes) -> ChatEvent:
    """An event back from its JSON form (a dict, or JSON text)."""
    if isinstance(data, dict):
        return _EVENT_ADAPTER.validate_python(data)
    return _EVENT_ADAPTER.validate_json(data)
