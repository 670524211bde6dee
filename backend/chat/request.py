"""What a front end asks of a chat turn: the request models, pure data at the pydantic boundary.

The tools a turn may use are not here: they are passed to `ChatService.run_turn` beside the
request (service.py).
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, model_validator

from backend.chat.context import ClientTurn
from backend.chat.llm.base import ANY_SAMPLING, Sampling
from backend.chat.text import Language

# A question, typed or spoken, fits in this many characters. Longer ones are refused before
# any work: the guardrail, the intent rules and the ranking all read the whole text.
MAX_QUERY_CHARS = 4000

# A model name as providers spell them ("gpt-4o-mini", "qwen2.5:7b-instruct",
# "hf.co/org/repo:Q4_K_M"): bounded, and nothing that could smuggle another field or a newline.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+\-]*$"
MODEL_NAME_MAX = 200
ModelName = Annotated[
    str, Field(min_length=1, max_length=MODEL_NAME_MAX, pattern=MODEL_NAME_PATTERN)
]


class InputMessage(BaseModel):
    """One OpenAI-style message; `content` may be text or a list of parts."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's (kept as text in the history)
    name: str | None = None

    @property
    def text(self) -> str:
        """The message's text (the text parts of a multi-part content)."""
        if isinstance(self.content, str):
            return self.content
        parts = self.content or []
        return "".join(
            str(part.get("text", "")) for part in parts if part.get("type") in ("text", None)
        )


class TurnRequest(BaseModel):
    """What a front end asks for. The query is `text`, or the last user message.

    `context="memory"`: the stored conversation is the context (the seed's page, devices).
    `context="messages"`: the messages before the question are (OpenAI clients without
    `chat_id`); the turn is stored only with `store=True`, in a new conversation whose id the
    front end chose (`conversation_id`). Pure data: the tools a turn may use are passed to
    `ChatService.run_turn` beside it."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    messages: list[InputMessage] = Field(default_factory=list)
    text: str | None = None
    conversation_id: str | None = Field(default=None, max_length=128)
    device_id: str | None = None
    # The language the words were heard in (a recognizer's); None: detected from the text.
    language: Language | None = None
    context: Literal["memory", "messages"] = "memory"
    store: bool = True
    sampling: Annotated[Sampling, SkipValidation] = Field(default=ANY_SAMPLING, exclude=True)
    count_usage: bool = False  # the front end reports `usage`: count what the model did not
    # This request's models (the console's settings); None: the server's configured ones.
    chat_model: ModelName | None = None
    guardrail_model: ModelName | None = None
    # The devices the caller may use, for a device request made with no device chosen ("which
    # device?"); None: not known here (the turn asks to choose one).
    device_choices: list[str] | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _has_query(self) -> "TurnRequest":
        query = self.query
        if not query.strip():
            raise ValueError("a turn needs `text` or a user message with text")
        if len(query) > MAX_QUERY_CHARS:
            raise ValueError(f"a question is at most {MAX_QUERY_CHARS:,} characters")
        return self

    @property
    def query(self) -> str:
        """The question: `text`, else the last user message."""
        if self.text is not None:
            return self.text
        for message in reversed(self.messages):
            if message.role == "user":
                return message.text
        return ""

    def earlier(self) -> list[ClientTurn]:
        """The messages before the question (the last user message)."""
        last = max((i for i, m in enumerate(self.messages) if m.role == "user"), default=0)
        return [
            ClientTurn(m.role, m.text, tuple(m.tool_calls or ()), m.name)
            for m in self.messages[:last]
        ]
