"""What one chat turn knows and what its stages hand back (docs/chat.md, "One turn").

What the turn knows before it answers is one frozen `Turn`; each stage returns what it found
(`Verdict`, `Context`, `Found`) instead of writing into a shared object, and an answering stage
is an async generator of events whose last item is its `Answer`. Only token counts, step
timings and the log context accumulate across stages (`TokenUsage`, `TurnLog`).

The helpers at the end are for text the bridge writes itself (a refusal, an offline answer, a
question, the sources section): within the client's `stop` and `max_tokens`, and counted.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from backend.chat.confirm import PendingConfirmation
from backend.chat.conversation import Reading
from backend.chat.deadline import Deadline
from backend.chat.errors import LlmError, LlmUnavailable
from backend.chat.events import Guardrail, ToolCompleted, ToolFailed
from backend.chat.llm.base import FunctionSpec, Message
from backend.chat.memory import Conversation, StoredMessage
from backend.chat.request import TurnRequest
from backend.chat.search import SearchResult
from backend.chat.text import Language
from backend.chat.tokens import count_tokens, cut_to_tokens
from backend.chat.tools import ToolBox, ToolOutcome
from backend.metrics import record_chat_stage

log = structlog.get_logger("chat")

# The log steps that are also metric stages (backend.metrics.record_chat_stage).
_STAGE_OF_STEP = {"guardrail": "guardrail", "memory_load": "memory", "search": "search"}


class TurnDeadline(LlmUnavailable):
    """The turn's time is up (`chat_turn_timeout_s`): what was said stands, cut; else offline."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the turn took longer than its {timeout_s:g} s deadline")


@dataclass
class TurnLog:
    """A turn's step timings and what its log lines carry; filled in as the turn goes (the
    conversation id once memory is read). The final `chat turn` line reads it even when the
    consumer stopped reading halfway."""

    device_id: str | None
    conversation_id: str | None
    steps: dict[str, float] = field(default_factory=dict)
    offline_reason: str | None = None
    tools_used: int = 0
    tool_seconds: float = 0.0

    def step(self, step: str, began: float, **detail: Any) -> None:
        """Add a step's time since `began` (a metric stage's too) and log its `chat step`."""
        seconds = time.perf_counter() - began
        ms = round(seconds * 1000, 3)
        self.steps[step] = round(self.steps.get(step, 0.0) + ms, 3)
        stage = _STAGE_OF_STEP.get(step)
        if stage is not None:
            record_chat_stage(stage, seconds)
        log.info(
            "chat step",
            step=step,
            duration_ms=ms,
            conversation_id=self.conversation_id,
            device_id=self.device_id,
            **detail,
        )


@dataclass
class TokenUsage:
    """Tokens of every model call of a turn (an accumulator: each call adds to it)."""

    prompt: int = 0
    completion: int = 0
    counted: bool = False  # some usage counted by the tokenizer, not reported by the model


@dataclass(frozen=True, slots=True)
class Turn:
    """What a turn knows before it answers."""

    request: TurnRequest
    query: str
    language: Language
    toolbox: ToolBox
    functions: list[FunctionSpec]  # the toolbox's, with quoted choices as enums (offline rules)
    deadline: Deadline
    log: TurnLog
    usage: TokenUsage
    # The message read in its conversation (conversation.py), and the user's earlier messages.
    reading: Reading = field(default_factory=lambda: Reading(""))
    earlier: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the guardrail stage decided."""

    guardrail: Guardrail
    dental: bool  # the question is about dentistry
    offline_reason: str | None = None  # the guardrail model failed: no model answers this turn


@dataclass(frozen=True, slots=True)
class Context:
    """What the memory stage found: the conversation (None: nothing is stored) and the context
    sent to the model."""

    conversation: Conversation | None = None
    history: tuple[Message, ...] = ()
    summary: str = ""
    instructions: str = ""  # the client's system/developer messages


@dataclass(frozen=True, slots=True)
class Peeked:
    """The stored talk read before the guardrail, without creating a conversation (a refused
    turn stores nothing): the conversation's id and its recent messages."""

    conversation_id: str | None = None
    messages: tuple[StoredMessage, ...] = ()


@dataclass(frozen=True, slots=True)
class Found:
    """What the search stage found: web and knowledge-base results, and how the web went."""

    results: tuple[SearchResult, ...] = ()
    status: Literal["ok", "failed", "skipped"] = "skipped"
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ToolRun:
    """One device call as a turn ran it."""

    tool: str  # the device's MCP name
    llm_name: str
    arguments: dict[str, Any]
    outcome: ToolOutcome
    duration_ms: float

    @property
    def ok(self) -> bool:
        """Whether the call ran and the tool did not report an error."""
        return not (self.outcome.failed or self.outcome.is_error)

    @property
    def needs_confirmation(self) -> bool:
        """Whether the call was held back for the user's confirmation."""
        return self.outcome.needs_confirmation is not None

    def event(self) -> ToolCompleted | ToolFailed:
        """Failed (no answer, or not run yet) or completed (maybe with the tool's error)."""
        if self.outcome.failed:
            return ToolFailed(
                tool=self.tool,
                llm_name=self.llm_name,
                error=self.outcome.text,
                duration_ms=self.duration_ms,
            )
        return ToolCompleted(
            tool=self.tool,
            llm_name=self.llm_name,
            result_text=self.outcome.text,
            is_error=self.outcome.is_error,
            duration_ms=self.duration_ms,
        )

    def pending(self, device_id: str | None) -> PendingConfirmation:
        """The question to remember for a risky call that did not run."""
        return PendingConfirmation(
            device_id=device_id,
            tool=self.tool,
            llm_name=self.llm_name,
            arguments=dict(self.arguments),
            reason=self.outcome.needs_confirmation or "risky tool",
            asked_at=time.time(),
        )


@dataclass(frozen=True, slots=True)
class Answer:
    """What an answering stage said and did."""

    pieces: tuple[str, ...] = ()  # the spoken answer, as its tokens went out
    runs: tuple[ToolRun, ...] = ()  # calls that ran (not one waiting for a "yes")
    confirmation: PendingConfirmation | None = None  # a risky call the user is asked about
    tool_rounds: int = 0
    finish_reason: Literal["stop", "length"] = "stop"
    failure: str | None = None  # why the model did not answer: offline mode takes over

    @property
    def text(self) -> str:
        """The answer's text: its pieces joined."""
        return "".join(self.pieces)

    def then(self, later: "Answer") -> "Answer":
        """This answer followed by a later stage's (offline after the model failed)."""
        cut = "length" in (self.finish_reason, later.finish_reason)
        return Answer(
            self.pieces + later.pieces,
            self.runs + later.runs,
            self.confirmation or later.confirmation,
            self.tool_rounds + later.tool_rounds,
            "length" if cut else "stop",
            later.failure,
        )


@dataclass(frozen=True, slots=True)
class Said:
    """A part of an answer no model wrote: its text, and what a voice says for it when that
    differs (None: the text itself)."""

    text: str
    speech: str | None = None


def went_offline(turn: Turn, exc: LlmError) -> str:
    """Why no model answers this turn: a warning, or debug when the provider logged it already
    (a model service that stays down is logged once when it goes down, not on every turn)."""
    reason = str(exc)
    turn.log.offline_reason = reason
    (log.debug if exc.reported else log.warning)(
        "chat offline mode",
        reason=reason,
        conversation_id=turn.log.conversation_id,
        device_id=turn.log.device_id,
    )
    return reason


def limited(turn: Turn, said: Sequence[str], text: str) -> tuple[str, bool]:
    """An answer no model wrote, after what the turn said before it (`said`), within the
    client's `stop` and `max_tokens` (`within`) and counted into the turn's completion tokens
    (`count_added`); and whether it was cut for length."""
    text, cut = within(turn, said, text)
    count_added(turn, said, text)
    return text, cut


def within(turn: Turn, said: Sequence[str], text: str) -> tuple[str, bool]:
    """`text` as the bridge may add it after `said`: the client's `stop` and `max_tokens` hold
    for the whole content, so it ends before any stop sequence in `said + text` (nothing after
    one `said` already holds) and within what `said` left of `max_tokens` (the tokenizer's
    count); and whether it was cut for length."""
    sampling = turn.request.sampling
    before = "".join(said)
    for stop in sampling.stop:
        at = (before + text).find(stop)
        if at != -1:  # the spaces before the stop go too: a whole answer is sent stripped
            text = text[: max(0, at - len(before))].rstrip()
    if sampling.max_tokens is not None and text:
        budget = max(0, sampling.max_tokens - count_tokens(before))
        kept = cut_to_tokens(text, budget)
        if kept != text:
            return kept.rstrip(), True
    return text, False


def count_added(turn: Turn, said: Sequence[str], text: str) -> None:
    """Add the tokens of text the bridge wrote after `said` (an offline answer, a question, the
    sources section) to the turn's completion tokens, when the front end reports `usage`: what
    the text adds to the whole content's count, so the pieces of an answer no model wrote sum
    to the count of the content."""
    if not turn.request.count_usage or not text:
        return
    before = "".join(said)
    turn.usage.completion += count_tokens(before + text) - count_tokens(before)
