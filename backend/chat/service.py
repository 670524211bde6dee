"""One chat turn, end to end (seed 003): language → guardrail → memory → search → LLM with
device tools → sources → memory with an accumulated summary; offline when no model answers.

`ChatService.run_turn(request, toolbox)` is an async generator of `ChatEvent`s (see
`events.py`); it never raises for model, search, tool or device failures: they become events
and metadata.

How the turn is built: the request is pure data and the toolbox comes beside it; what the turn
knows before answering is one frozen `_Turn`; each stage returns what it found (`_Context`,
`_Found`, `_Answer`) instead of writing into a shared object. An answering stage is an async
generator of events whose last item is its `_Answer`. Every device call, whoever asks for it
(the model, the offline rules, a confirmed question), goes through `_run_tool`. When the model
cannot answer, its stage says why (`_Answer.failure`) and the offline stage takes over: that is
the one place the turn branches to offline mode.
"""

import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, SkipValidation, model_validator

from backend.chat import prompts
from backend.chat.confirm import (
    CANCELLED,
    CANCELLED_SPOKEN,
    DONE,
    FAILED,
    ConfirmationBook,
    PendingConfirmation,
    answer_kind,
    question,
    spoken_action,
)
from backend.chat.context import ClientTurn, client_context, without_sources
from backend.chat.conversation import Reading, read_turn
from backend.chat.deadline import Deadline
from backend.chat.device_state import no_reading_tool_reply
from backend.chat.events import (
    ChatEvent,
    Confirmation,
    Done,
    Guardrail,
    SourceItem,
    Sources,
    Token,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnMetadata,
    TurnUsage,
)
from backend.chat.language import detect_language
from backend.chat.llm.base import (
    ANY_SAMPLING,
    DETERMINISTIC,
    Completion,
    FunctionSpec,
    LlmError,
    LlmProvider,
    LlmUnavailable,
    Message,
    Sampling,
    StreamEnd,
    TextDelta,
    TokenCount,
    ToolCall,
)
from backend.chat.memory import Conversation, MemoryStore, StoredMessage
from backend.chat.offline import (
    OFFLINE_NOTE,
    Intent,
    IntentDetector,
    asks_a_device,
    concepts_in,
    current_level,
    dental_words,
    device_reply,
    extractive_answer,
    extractive_summary,
    is_dental,
    rejected_reply,
    serving_function,
    stepped,
    unserved_reply,
    with_description_choices,
)
from backend.chat.search import (
    KnowledgeBase,
    SearchFailed,
    SearchResult,
    WebSearch,
    format_results,
)
from backend.chat.text import Language, bounded_summary, replace_surrogates
from backend.chat.tokens import count_prompt, count_tokens, cut_to_tokens
from backend.chat.tools import NoTools, ToolBox, ToolOutcome
from backend.common import clip
from backend.config import Settings
from backend.errors import BridgeError
from backend.metrics import record_chat_stage, record_chat_turn

log = structlog.get_logger("chat")

# A question, typed or spoken, fits in this many characters. Longer ones are refused before
# any work: the guardrail, the intent rules and the ranking all read the whole text.
MAX_QUERY_CHARS = 4000
# The accumulated summary kept and sent to the model: the newest part within both bounds (the
# token count is an over-estimate, text.estimated_tokens). Without a bound it grew by a piece
# every turn, 160 KB in every prompt after 400 turns.
SUMMARY_MAX_CHARS = 4000
SUMMARY_MAX_TOKENS = 1000
_SHOWN_RESULT_CHARS = 200  # a confirmed call's result, as shown back to the user
# A whole turn (guardrail, every model round and tool call, summary) ends within this by default,
# and an answer within this many tokens: a model that keeps talking made 104-161 s turns.
TURN_TIMEOUT_S = 120.0
MAX_ANSWER_TOKENS = 1024

_NO_PERMISSION = {
    "vi": "Tôi không có quyền điều khiển thiết bị này ({reason}).",
    "en": "I'm not allowed to control this device ({reason}).",
}


class TurnDeadline(LlmUnavailable):
    """The turn's time is up (`chat_turn_timeout_s`): what was said stands, cut; else offline."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the turn took longer than its {timeout_s:g} s deadline")


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


NO_LLM = "no LLM configured (llm_provider = none)"
# The log steps that are also metric stages (backend.metrics.record_chat_stage).
_STAGE_OF_STEP = {"guardrail": "guardrail", "memory_load": "memory", "search": "search"}


@dataclass
class _TurnLog:
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
class _TokenUsage:
    """Tokens of every model call of a turn (an accumulator: each call adds to it)."""

    prompt: int = 0
    completion: int = 0
    counted: bool = False  # some usage counted by the tokenizer, not reported by the model


@dataclass(frozen=True, slots=True)
class _Turn:
    """What a turn knows before it answers."""

    request: TurnRequest
    query: str
    language: Language
    toolbox: ToolBox
    functions: list[FunctionSpec]  # the toolbox's, with quoted choices as enums (offline rules)
    deadline: Deadline
    log: _TurnLog
    usage: _TokenUsage
    # The message read in its conversation (conversation.py), and the user's earlier messages.
    reading: Reading = field(default_factory=lambda: Reading(""))
    earlier: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Verdict:
    guardrail: Guardrail
    dental: bool  # the question is about dentistry
    offline_reason: str | None = None  # the guardrail model failed: no model answers this turn


@dataclass(frozen=True, slots=True)
class _Context:
    """What the memory stage found: the conversation (None: nothing is stored) and the context
    sent to the model."""

    conversation: Conversation | None = None
    history: tuple[Message, ...] = ()
    summary: str = ""
    instructions: str = ""  # the client's system/developer messages


@dataclass(frozen=True, slots=True)
class _Peeked:
    """The stored talk read before the guardrail, without creating a conversation (a refused
    turn stores nothing): the conversation's id and its recent messages."""

    conversation_id: str | None = None
    messages: tuple[StoredMessage, ...] = ()


@dataclass(frozen=True, slots=True)
class _Found:
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
class _Answer:
    """What an answering stage said and did."""

    pieces: tuple[str, ...] = ()  # the spoken answer, as its tokens went out
    runs: tuple[ToolRun, ...] = ()  # calls that ran (not one waiting for a "yes")
    confirmation: PendingConfirmation | None = None  # a risky call the user is asked about
    tool_rounds: int = 0
    finish_reason: Literal["stop", "length"] = "stop"
    failure: str | None = None  # why the model did not answer: offline mode takes over

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def then(self, later: "_Answer") -> "_Answer":
        """This answer followed by a later stage's (offline after the model failed)."""
        cut = "length" in (self.finish_reason, later.finish_reason)
        return _Answer(
            self.pieces + later.pieces,
            self.runs + later.runs,
            self.confirmation or later.confirmation,
            self.tool_rounds + later.tool_rounds,
            "length" if cut else "stop",
            later.failure,
        )


class ChatService:
    """The dental assistant. Safe to share between concurrent turns."""

    def __init__(
        self,
        memory: MemoryStore,
        llm: LlmProvider | None,
        web: WebSearch | None = None,
        knowledge: KnowledgeBase | None = None,
        *,
        search_results: int = 5,
        kb_results: int = 2,
        history_messages: int = 6,
        max_tool_rounds: int = 5,
        intent_threshold: float = 0.7,
        summary_max_chars: int = SUMMARY_MAX_CHARS,
        summary_max_tokens: int = SUMMARY_MAX_TOKENS,
        turn_timeout_s: float = TURN_TIMEOUT_S,
        max_answer_tokens: int = MAX_ANSWER_TOKENS,
    ) -> None:
        self.memory = memory
        self.turn_timeout_s = turn_timeout_s
        self.max_answer_tokens = max_answer_tokens
        self.summary_max_chars = summary_max_chars
        self.summary_max_tokens = summary_max_tokens
        self.llm = llm
        self.web = web
        self.knowledge = knowledge if knowledge is not None else KnowledgeBase.bundled()
        self.search_results = search_results
        self.kb_results = kb_results
        self.history_messages = history_messages
        self.max_tool_rounds = max_tool_rounds
        self.detector = IntentDetector(intent_threshold)
        self.confirmations = ConfirmationBook()

    @classmethod
    def from_settings(cls, settings: Settings, memory: MemoryStore) -> "ChatService":
        """The service as the settings describe it (provider, models, web search)."""
        from backend.chat.llm import make_provider
        from backend.chat.search import web_search_from_settings

        return cls(
            memory,
            make_provider(settings),
            web_search_from_settings(settings),
            KnowledgeBase.bundled(min_score=settings.kb_min_score),
            search_results=settings.search_results,
            summary_max_chars=settings.chat_summary_max_chars,
            summary_max_tokens=settings.chat_summary_max_tokens,
            turn_timeout_s=settings.chat_turn_timeout_s,
            max_answer_tokens=settings.chat_max_answer_tokens,
        )

    def bounded(self, summary: str) -> str:
        """The summary within the service's bounds (one stored before there were any may be
        longer: it is cut when it is read, too)."""
        return bounded_summary(summary, self.summary_max_chars, self.summary_max_tokens)

    async def aclose(self) -> None:
        """Close the LLM provider's clients."""
        if self.llm is not None:
            await self.llm.aclose()

    # ---- the turn ------------------------------------------------------------------------------

    async def run_turn(
        self, request: TurnRequest, toolbox: ToolBox | None = None
    ) -> AsyncIterator[ChatEvent]:
        """The turn's events; `toolbox`: the tools it may use (none: a turn without a device)."""
        began = time.perf_counter()
        # Front ends refuse (HTTP) or repair (devices) invalid text; this keeps any other caller
        # from failing deep in the turn (SQLite, the model's client) on a lone surrogate.
        query = replace_surrogates(request.query.strip())
        turn_log = _TurnLog(request.device_id, request.conversation_id)
        turn_log.offline_reason = None if self.llm is not None else NO_LLM
        deadline = Deadline(self.turn_timeout_s, lambda: TurnDeadline(self.turn_timeout_s))
        outcome = "abandoned"  # the consumer stopped reading (a client went away)
        try:
            turn = self._start(request, query, toolbox or NoTools(), deadline, turn_log)
            async for event in self._turn_events(turn):
                if isinstance(event, Done):
                    outcome = event.metadata.guardrail.verdict
                yield event
        except Exception:
            outcome = "failed"
            raise
        finally:
            deadline.close()
            log.info(
                "chat turn",
                step="turn",
                outcome=outcome,
                duration_ms=round((time.perf_counter() - began) * 1000, 3),
                offline=turn_log.offline_reason is not None,
                tools=turn_log.tools_used,
                conversation_id=turn_log.conversation_id,
                device_id=turn_log.device_id,
            )

    def _start(
        self,
        request: TurnRequest,
        query: str,
        toolbox: ToolBox,
        deadline: Deadline,
        turn_log: _TurnLog,
    ) -> _Turn:
        began = time.perf_counter()
        language = request.language or detect_language(query)
        functions = [with_description_choices(spec) for spec in toolbox.functions()]
        turn_log.step("language", began, language=language)
        return _Turn(
            request,
            query,
            language,
            toolbox,
            functions,
            deadline,
            turn_log,
            _TokenUsage(),
            Reading(query),
        )

    async def _turn_events(self, turn: _Turn) -> AsyncIterator[ChatEvent]:
        request = turn.request
        asked = self.confirmations.take(_confirmation_keys(request))
        if asked is not None and asked.device_id == request.device_id:
            kind = answer_kind(turn.query)
            if kind != "other":
                async for event in self._confirmed(turn, asked, kind == "yes"):
                    yield event
                return

        began = time.perf_counter()
        peeked = await self._peek(turn)
        turn = self._read(turn, peeked)
        turn.log.step("reading", began, follows=turn.reading.follows is not None)

        began = time.perf_counter()
        verdict = await self._guardrail(turn)
        offline_reason = turn.log.offline_reason or verdict.offline_reason
        turn.log.offline_reason = offline_reason
        # A clearly dental question does not get the device's functions (a toothache question
        # made a real model raise the screen brightness), unless it also asks something of the
        # device. Whatever the rules could not place keeps them (the model judged it).
        about_device = bool(turn.functions) and (
            verdict.guardrail.by != "rules"
            or not verdict.dental
            or self.detector.is_device_request(turn.reading.text, turn.functions)
        )
        guardrail = verdict.guardrail
        turn.log.step("guardrail", began, verdict=guardrail.verdict, by=guardrail.by)
        if guardrail.verdict == "refused":
            text, _cut = _limited(turn, (), prompts.refusal(turn.language, bool(turn.functions)))
            yield Token(text=text)
            record_chat_turn("refused")
            answer = _Answer((text,))
            yield Done(metadata=self._metadata(turn, guardrail, answer, offline_reason))
            return

        began = time.perf_counter()
        context = await self._load_memory(turn, peeked)
        turn.log.step("memory_load", began, history=len(context.history))

        ruled = self._rules_answer(turn, verdict)
        if ruled is not None:  # a greeting offline, a device request with no device chosen
            async for event in self._answer_by_rules(turn, guardrail, context, ruled):
                yield event
            return

        device_only = not verdict.dental
        began = time.perf_counter()
        found = await self._search(turn, skip_web=device_only)
        turn.log.step("search", began, status=found.status, results=len(found.results))

        # A key that may not call the device: said once, whichever stage answers.
        denied = self._denied_event(turn) if about_device else None
        if denied is not None:
            yield denied
        answer = _Answer()
        if offline_reason is None:
            async for item in self._answer_with_llm(turn, context, found, about_device):
                if isinstance(item, _Answer):
                    answer = item
                else:
                    yield item
            offline_reason = answer.failure
            turn.log.offline_reason = offline_reason
        if offline_reason is not None:
            async for item in self._answer_offline(turn, found, device_only, answer):
                if isinstance(item, _Answer):
                    answer = answer.then(item)
                else:
                    yield item
        pending = answer.confirmation
        if pending is not None:
            asked = ("\n\n" if answer.pieces else "") + question(
                turn.language, pending, _compact(pending.arguments)
            )
            text, _cut = _within(turn, answer.pieces, asked)  # the client's stop and max_tokens
            answer = dataclasses.replace(answer, pieces=(*answer.pieces, text))
            if text:
                yield Token(text=text)
            self.confirmations.remember(_confirmation_keys(request, context.conversation), pending)
        record_chat_turn("offline" if offline_reason is not None else "llm")
        _record_tool_time(turn)

        if pending is not None:  # the question above is the bridge's words: counted as such
            _count_added(turn, answer.pieces[:-1], answer.pieces[-1])
        spoken = answer.text.strip()
        sources = self._sources(turn, found, device_only, spoken)
        if sources is not None:
            yield sources
        full = f"{spoken}\n\n{sources.section}" if sources and sources.section else spoken
        began = time.perf_counter()
        # Nothing empty is stored or summarised (an empty answer's summary was invented).
        stored = bool(spoken) and await self._store(
            turn, context, full, sources, answer.runs, offline_reason
        )
        if stored:
            await self._summarize(turn, context, spoken, offline=offline_reason is not None)
            record_chat_stage("store", time.perf_counter() - began)
        yield Done(
            metadata=self._metadata(
                turn,
                guardrail,
                answer,
                offline_reason,
                context=context,
                found=found,
                stored=stored,
                sources=sources,
                full_answer=full,
            )
        )

    # ---- stages -------------------------------------------------------------------------------

    async def _guardrail(self, turn: _Turn) -> _Verdict:
        text = turn.reading.text
        if turn.reading.social is not None:
            return _Verdict(Guardrail(verdict="passed", reason="social", by="rules"), False)
        dental = dental_words(text)
        if dental == "clear" and (turn.reading.sure or self.llm is None):
            reason = "follow-up" if turn.reading.follows else "dental question"
            return _Verdict(Guardrail(verdict="passed", reason=reason, by="rules"), True)
        if turn.functions and self.detector.is_device_request(text, turn.functions):
            # The device request passed; an ambiguous dental word beside it is taken as meant.
            passed = Guardrail(verdict="passed", reason="device request", by="rules")
            return _Verdict(passed, bool(dental))
        if not turn.functions and not dental and asks_a_device(text):
            passed = Guardrail(verdict="passed", reason="device request, no device", by="rules")
            return _Verdict(passed, False)
        external = serving_function(text, turn.toolbox.external_functions())
        if external is not None and not dental:
            # A tool of an external or dialed-in server serves it: the model may call it.
            passed = Guardrail(verdict="passed", reason="external tool", by="rules")
            return _Verdict(passed, False)
        failure: str | None = None
        if self.llm is not None:
            names = [f"{spec.llm_name}: {spec.description}" for spec in turn.functions]
            prompt = prompts.guardrail_prompt(turn.language, turn.query, names, turn.earlier)
            sent = [Message("user", prompt)]
            sampling = _with_max_tokens(DETERMINISTIC, 3)
            try:
                model = turn.request.guardrail_model or self.llm.models.guardrail
                reply = await self._complete(turn, sent, model, sampling)
            except LlmError as exc:
                failure = _went_offline(turn, exc)
            else:
                return _model_verdict(reply.text)
        if dental is not None and not turn.reading.sure:  # a follow-up the model could not judge
            passed = Guardrail(verdict="passed", reason="follow-up (unchecked)", by="rules")
            return _Verdict(passed, True, failure)
        if dental == "ambiguous":  # no model to judge "brush", "gum"...: answer rather than refuse
            passed = Guardrail(verdict="passed", reason="dental word (unchecked)", by="rules")
            return _Verdict(passed, True, failure)
        refused = Guardrail(verdict="refused", reason="no dental or device words", by="rules")
        return _Verdict(refused, False, failure)

    async def _peek(self, turn: _Turn) -> _Peeked:
        """The stored conversation's recent messages, read without creating one."""
        request = turn.request
        if request.context == "messages":
            return _Peeked(request.conversation_id)
        try:
            conversation_id = request.conversation_id
            if conversation_id is None and request.device_id is not None:
                conversation_id = await self.memory.device_conversation_id(request.device_id)
            if conversation_id is None:
                return _Peeked()
            stored = await self.memory.recent(conversation_id, self.history_messages)
        except BridgeError as exc:
            log.warning("chat memory unavailable", error=str(exc), device_id=request.device_id)
            return _Peeked()
        return _Peeked(conversation_id, tuple(stored))

    def _read(self, turn: _Turn, peeked: _Peeked) -> _Turn:
        """The turn with its message read in the conversation: follow-ups, greetings, names."""
        if turn.request.context == "messages":
            earlier = [t.text for t in turn.request.earlier() if t.role == "user"]
        else:
            earlier = [m.content for m in peeked.messages if m.role == "user"]

        def on_topic(text: str) -> bool:
            """Dental, or a device request the rules would act on by itself (not one short
            of a value: "put it back to light" after a theme change is a follow-up)."""
            if is_dental(text):
                return True
            if turn.functions:
                plan = self.detector.plan(text, turn.functions)
                return bool(plan.intents or plan.unserved or plan.unanswered)
            return asks_a_device(text)

        def known(word: str) -> bool:
            return self.knowledge.knows(word) or is_dental(word) or bool(concepts_in(word))

        reading = read_turn(turn.query, earlier, turn.language, on_topic=on_topic, known=known)
        return dataclasses.replace(turn, reading=reading, earlier=tuple(earlier))

    def _rules_answer(self, turn: _Turn, verdict: _Verdict) -> "_Said | None":
        """An answer the rules give whatever model there is: a device request with no device
        chosen ("which device?"); a greeting or thanks when no model answers."""
        if verdict.guardrail.reason == "device request, no device":
            return _Said(prompts.which_device(turn.language, turn.request.device_choices))
        social = turn.reading.social
        if social is not None and (self.llm is None or turn.log.offline_reason is not None):
            return _Said(prompts.social_reply(social, turn.language, bool(turn.functions)))
        return None

    async def _answer_by_rules(
        self, turn: _Turn, guardrail: Guardrail, context: _Context, said: "_Said"
    ) -> AsyncIterator[ChatEvent]:
        text, _cut = _limited(turn, (), said.text)
        yield Token(text=text)
        record_chat_turn("offline" if turn.log.offline_reason is not None else "rules")
        answer = _Answer((text,))
        reason = turn.log.offline_reason
        stored = bool(text) and await self._store(turn, context, text, None, (), reason)
        yield Done(
            metadata=self._metadata(turn, guardrail, answer, reason, context=context, stored=stored)
        )

    async def _load_memory(self, turn: _Turn, peeked: _Peeked | None = None) -> _Context:
        request = turn.request
        if request.context == "messages":
            context = client_context(request.earlier(), self.history_messages, turn.language)
            opened = await self._open_conversation(turn) if request.store else None
            return _Context(
                opened,
                tuple(context.history),
                self.bounded(context.summary),
                context.instructions,
            )
        conversation: Conversation | None = None
        try:
            if request.conversation_id is None and request.device_id is not None:
                conversation = await self.memory.conversation_for_device(request.device_id)
            else:
                conversation = await self.memory.get_or_create(
                    request.conversation_id, device_id=request.device_id
                )
            turn.log.conversation_id = conversation.id
            if peeked is not None and peeked.conversation_id == conversation.id:
                stored = list(peeked.messages)
            else:
                stored = await self.memory.recent(conversation.id, self.history_messages)
        except BridgeError as exc:
            log.warning("chat memory unavailable", error=str(exc), device_id=request.device_id)
            return _Context(conversation)  # found but unread: the turn is still stored there
        history = tuple(_history_message(message) for message in stored)
        return _Context(conversation, history, self.bounded(conversation.summary))

    async def _open_conversation(self, turn: _Turn) -> Conversation | None:
        """A new stored conversation for a client that sent its own history with `store`."""
        request = turn.request
        try:
            conversation = await self.memory.get_or_create(
                request.conversation_id, device_id=request.device_id
            )
        except BridgeError as exc:
            log.warning("chat memory unavailable", error=str(exc), device_id=request.device_id)
            return None
        turn.log.conversation_id = conversation.id
        return conversation

    async def _search(self, turn: _Turn, *, skip_web: bool) -> _Found:
        if skip_web:
            return _Found()
        results: list[SearchResult] = []
        status: Literal["ok", "failed", "skipped"] = "skipped"
        error: str | None = None
        question = self._question(turn)
        if self.web is not None:
            try:
                results = await self.web.search(question, self.search_results)
            except SearchFailed as exc:
                status, error = "failed", str(exc)
            else:
                status = "ok"
        if turn.reading.own:  # a follow-up: the entries about what it adds come first
            kb = self.knowledge.search(question, self.kb_results + 2, language=turn.language)
            own = self.knowledge.search(turn.reading.own, language=turn.language)
            links = {result.link for result in own}
            kb = sorted(kb, key=lambda result: result.link not in links)
            kb += [result for result in own if result not in kb]
            kb = kb[: self.kb_results]
        else:
            kb = self.knowledge.search(question, self.kb_results, language=turn.language)
        known = self.knowledge.known_part(question) if not kb and is_dental(question) else None
        if known:  # a dental question whose other words no entry holds ("the difference")
            kb = self.knowledge.search(known, self.kb_results, language=turn.language)
        seen = {result.link for result in results}
        results += [result for result in kb if result.link not in seen]
        return _Found(tuple(results), status, error)

    def _question(self, turn: _Turn) -> str:
        """What the turn asks to know, for search: the message read in its conversation,
        without its device requests ("set the volume to 25 and tell me how often to floss")."""
        text = turn.reading.text
        if turn.functions:
            return self.detector.plan(text, turn.functions).question or text
        return text

    def _denied_event(self, turn: _Turn) -> ToolFailed | None:
        """The refusal of the first device call the request asks for, when the key may not call
        the device (the model is offered no device tools; offline mode calls none)."""
        reason = turn.toolbox.unavailable_reason
        if reason is None:
            return None
        for intent in self.detector.plan(turn.reading.text, turn.functions).intents:
            tool = turn.toolbox.device_tool_name(intent.llm_name)
            return ToolFailed(tool=tool, llm_name=intent.llm_name, error=reason)
        return None

    async def _run_tool(
        self, turn: _Turn, llm_name: str, arguments: dict[str, Any], *, confirmed: bool = False
    ) -> AsyncIterator[ChatEvent | ToolRun]:
        """The one way a turn calls a tool, for the model, the offline rules and a confirmed
        question alike: `tool_started`, the call, its log line, `tool_failed` or
        `tool_completed`; the last item is the `ToolRun`."""
        tool = turn.toolbox.device_tool_name(llm_name)
        yield ToolStarted(tool=tool, llm_name=llm_name, arguments=arguments)
        began = time.perf_counter()
        outcome = await turn.toolbox.call(llm_name, arguments, confirmed=confirmed)
        seconds = time.perf_counter() - began
        run = ToolRun(tool, llm_name, arguments, outcome, round(seconds * 1000, 3))
        log.info(
            "chat tool call",
            step="tool",
            tool=tool,
            duration_ms=run.duration_ms,
            failed=outcome.failed,
            is_error=outcome.is_error,
            offline=turn.log.offline_reason is not None,
            conversation_id=turn.log.conversation_id,
            device_id=turn.log.device_id,
        )
        if not run.needs_confirmation or confirmed:
            turn.log.tools_used += 1
        turn.log.tool_seconds += seconds
        yield run.event()
        yield run

    async def _answer_with_llm(
        self, turn: _Turn, context: _Context, found: _Found, about_device: bool
    ) -> AsyncIterator[ChatEvent | _Answer]:
        """The model's answer, with up to `max_tool_rounds` rounds of tool calls."""
        toolbox = turn.toolbox
        unavailable = toolbox.unavailable_reason if about_device else None
        offered = list(toolbox.functions()) if about_device and unavailable is None else []
        if not offered:  # external MCP servers' tools are not device tools (backend/mcp_servers)
            offered = toolbox.external_functions()
        user = prompts.user_prompt(
            turn.language,
            turn.query,
            summary=context.summary,
            search_results=format_results(found.results),
            tools_unavailable=unavailable,
        )
        messages = [Message("system", prompts.system_prompt(turn.language, context.instructions))]
        messages += context.history
        messages.append(Message("user", user))
        log.debug("chat prompt", conversation_id=turn.log.conversation_id, prompt=user)

        began = time.perf_counter()
        said: list[str] = []
        runs: list[ToolRun] = []
        rounds = 0
        finish: Literal["stop", "length"] = "stop"
        confirmation: PendingConfirmation | None = None
        failure: str | None = None
        invalid_rounds = 0
        tool_time = 0.0
        try:
            for round_index in range(self.max_tool_rounds + 1):
                tools = offered if round_index < self.max_tool_rounds else []
                if offered and not tools:
                    messages.append(Message("system", prompts.TOO_MANY_ROUNDS_NOTE[turn.language]))
                calls: list[ToolCall] = []
                text: list[str] = []
                first = round_index == 0
                async for item in self._stream_round(turn, messages, tools, said):
                    if first:
                        record_chat_stage("llm_first_token", time.perf_counter() - began)
                        first = False
                    if isinstance(item, StreamEnd):
                        finish = "length" if item.finish_reason == "length" else finish
                    elif isinstance(item, TextDelta):
                        text.append(item.text)
                        said.append(item.text)
                        yield Token(text=item.text)
                    else:
                        calls.append(item)
                if not calls or finish == "length":
                    break
                rounds += 1
                messages.append(Message("assistant", "".join(text), tool_calls=tuple(calls)))
                tools_began = time.perf_counter()
                invalid = False
                for call in calls:
                    async for event, reply, run in self._model_call(turn, call):
                        if event is not None:
                            yield event
                        if reply is not None:
                            messages.append(reply)
                        if run is not None and run.needs_confirmation:
                            confirmation = run.pending(turn.request.device_id)
                        elif run is not None:
                            runs.append(run)
                    invalid = invalid or call.arguments is None
                tool_time += time.perf_counter() - tools_began
                if confirmation is not None:
                    break  # a risky call: the user is asked before anything else happens
                invalid_rounds += invalid
                if invalid_rounds >= 2:
                    text_end = prompts.INVALID_TOOL_CALL_ANSWER[turn.language]
                    said.append(("\n\n" if said else "") + text_end)
                    yield Token(text=said[-1])
                    break
        except TurnDeadline as exc:
            if "".join(said).strip():
                finish = "length"  # the answer so far is the answer, cut
            else:
                failure = _went_offline(turn, exc)
        except LlmError as exc:
            failure = _went_offline(turn, exc)
            if said:
                said.append("\n\n")
                yield Token(text="\n\n")
        steps = turn.log.steps
        steps["tools"] = round(tool_time * 1000, 3)
        turn.log.step("llm", began, rounds=rounds, offline=failure is not None)
        steps["llm"] = round(steps["llm"] - steps["tools"], 3)
        log.debug("chat answer", conversation_id=turn.log.conversation_id, answer="".join(said))
        yield _Answer(tuple(said), tuple(runs), confirmation, rounds, finish, failure)

    async def _model_call(
        self, turn: _Turn, call: ToolCall
    ) -> AsyncIterator[tuple[ChatEvent | None, Message | None, ToolRun | None]]:
        """Events for one call the model asked for, the tool message that answers it, and the
        run (none for invalid arguments: those go back to the model unrun)."""
        if call.arguments is None:
            tool = turn.toolbox.device_tool_name(call.name)
            error = call.error or "invalid arguments"
            yield ToolFailed(tool=tool, llm_name=call.name, error=error), None, None
            content = f"error: {error}. Call the function again with a valid JSON object."
            yield None, Message("tool", content, tool_call_id=call.id, name=call.name), None
            return
        async for item in self._run_tool(turn, call.name, call.arguments):
            if isinstance(item, ToolRun):
                reply = Message("tool", item.outcome.text, tool_call_id=call.id, name=call.name)
                yield None, reply, item
            else:
                yield item, None, None

    async def _stream_round(
        self,
        turn: _Turn,
        messages: list[Message],
        tools: Sequence[FunctionSpec],
        said: Sequence[str],
    ) -> AsyncIterator[TextDelta | ToolCall | StreamEnd]:
        """One model round: its text (cut at the answer's token budget, `said` being what the
        turn said so far) and tool calls, within the turn's deadline, its usage added to the
        turn's; last, a `StreamEnd` saying "length" when the answer was cut."""
        assert self.llm is not None
        budget = self._answer_budget(turn, said)
        sampling = _with_max_tokens(turn.request.sampling, budget)
        # The model counts with its own tokenizer: the bridge cuts only a server that clearly
        # ignores max_tokens (one that keeps talking), with room for the tokenizers to differ.
        budget += budget // 2 + 8
        model = turn.request.chat_model  # None: the provider's own chat model
        stream = self.llm.stream(messages, model=model, tools=tools, sampling=sampling)
        text: list[str] = []
        calls: list[ToolCall] = []
        used = 0
        end = StreamEnd()
        try:
            while True:
                item = await turn.deadline.run(anext(stream, None))
                if item is None:
                    break
                if isinstance(item, StreamEnd):
                    end = item
                    continue
                if isinstance(item, ToolCall):
                    calls.append(item)
                    yield item
                    continue
                tokens = count_tokens(item.text)
                if used + tokens > budget:  # a server that ignores max_tokens
                    kept = cut_to_tokens(item.text, budget - used)
                    if kept:
                        text.append(kept)
                        yield TextDelta(kept)
                    end = StreamEnd("length", end.usage)
                    break
                used += tokens
                text.append(item.text)
                yield item
        finally:
            if isinstance(stream, AsyncGenerator):
                await stream.aclose()
            reply_text = "".join(text) + "".join(call.raw_arguments for call in calls)
            self._count(turn, messages, reply_text, end.usage)
        if end.finish_reason == "length" and not calls:
            yield StreamEnd("length", end.usage)

    def _answer_budget(self, turn: _Turn, said: Sequence[str]) -> int:
        asked = turn.request.sampling.max_tokens
        cap = self.max_answer_tokens if asked is None else min(asked, self.max_answer_tokens)
        spent = sum(count_tokens(piece) for piece in said)
        return max(1, cap - spent)

    async def _complete(
        self, turn: _Turn, messages: list[Message], model: str | None, sampling: Sampling
    ) -> Completion:
        assert self.llm is not None
        reply = await turn.deadline.run(self.llm.complete(messages, model=model, sampling=sampling))
        self._count(turn, messages, reply.text, reply.usage)
        return reply

    @staticmethod
    def _count(
        turn: _Turn, messages: Sequence[Message], reply: str, reported: TokenCount | None
    ) -> None:
        usage = turn.usage
        if reported is not None:
            usage.prompt += reported.prompt
            usage.completion += reported.completion
            return
        usage.counted = True
        if not turn.request.count_usage:
            return  # tokenizing every prompt costs ~0.1 ms per KB; only the OpenAI API needs it
        usage.prompt += count_prompt(message.content for message in messages)
        usage.completion += count_tokens(reply)

    async def _answer_offline(
        self,
        turn: _Turn,
        found: _Found,
        device_only: bool,
        before: _Answer,
    ) -> AsyncIterator[ChatEvent | _Answer]:
        """The rules' answer: device calls the request asks for, an extractive answer to its
        question. `before`: what the model said and did before it failed."""
        began = time.perf_counter()
        plan = self.detector.plan(turn.reading.text, turn.functions)
        # Tools the model ran before it failed: the user hears what they did, in words.
        parts = [self._said_done(turn, run) for run in before.runs]
        runs: list[ToolRun] = []
        confirmation: PendingConfirmation | None = None
        done_already = {run.tool for run in before.runs}
        unavailable = turn.toolbox.unavailable_reason
        if unavailable is not None and plan.intents:  # the turn reported it (_denied_event)
            parts.append(_Said(_NO_PERMISSION[turn.language].format(reason=unavailable)))
        else:
            for intent in plan.intents:
                if turn.toolbox.device_tool_name(intent.llm_name) in done_already:
                    continue  # the model already did it before the service went away
                if intent.step is not None:  # "turn it up": from the level the device reports
                    current: int | None = None
                    async for found_item in self._level_now(turn, intent):
                        if isinstance(found_item, ToolRun):
                            runs.append(found_item)
                        elif isinstance(found_item, int) or found_item is None:
                            current = found_item
                        else:
                            yield found_item
                    moved = stepped(intent, current)
                    if moved is None:  # the device does not say where it is: ask for a value
                        parts.append(_Said(rejected_reply(intent, turn.language)))
                        continue
                    intent = moved
                async for item in self._run_tool(turn, intent.llm_name, intent.arguments):
                    if not isinstance(item, ToolRun):
                        yield item
                    elif item.needs_confirmation:
                        confirmation = item.pending(turn.request.device_id)
                    else:
                        runs.append(item)
                        said = device_reply(intent, item.outcome.text, item.ok, turn.language)
                        parts.append(_Said(said))
                if confirmation is not None:
                    break
        if plan.unanswered:
            parts.append(_Said(no_reading_tool_reply(turn.language)))
        if not plan.intents and plan.rejected and (not plan.question or device_only):
            parts.append(_Said(rejected_reply(plan.rejected[0], turn.language)))
        if not plan.intents and not plan.rejected and plan.unserved:
            parts.append(_Said(unserved_reply(turn.language)))
        question_text = plan.question if turn.functions else turn.reading.text
        if question_text and not device_only:
            answer = extractive_answer(
                question_text, found.results, turn.language, stress=turn.reading.own
            )
            # The note is for screens: a voice reads the answer, not a disclaimer before it.
            parts.append(_Said(f"{OFFLINE_NOTE[turn.language]}\n{answer}", answer))
        elif question_text and not plan.intents and not plan.rejected:
            parts.append(_Said(extractive_answer(question_text, found.results, turn.language)))
        text, cut = _limited(turn, before.pieces, "\n\n".join(part.text for part in parts))
        if text:
            yield Token(text=text, speech=_speech(parts, text))
        turn.log.step(
            "offline",
            began,
            reason=turn.log.offline_reason,
            calls=len(plan.intents),
            question=bool(question_text),
        )
        yield _Answer(
            (text,) if text else (),
            tuple(runs),
            confirmation,
            finish_reason="length" if cut else "stop",
        )

    async def _level_now(
        self, turn: _Turn, intent: Intent
    ) -> AsyncIterator[ChatEvent | ToolRun | int | None]:
        """For a step up or down ("turn it up"): the device's status call, if it has a status
        tool, then the level it reports (None: unknown)."""
        status = self.detector.status_function(turn.functions)
        if intent.step is None or status is None:
            yield None
            return
        async for item in self._run_tool(turn, status.llm_name, {}):
            yield item
            if isinstance(item, ToolRun):
                yield current_level(item.outcome.text, intent.step.argument)

    async def _confirmed(
        self, turn: _Turn, asked: PendingConfirmation, yes: bool
    ) -> AsyncIterator[ChatEvent]:
        """The turn after a risky call was asked about: run it (yes) or drop it (no)."""
        verdict = Guardrail(verdict="passed", reason="confirmation answer", by="rules")
        context = await self._load_memory(turn)
        runs: tuple[ToolRun, ...] = ()
        if yes:
            run: ToolRun | None = None
            async for item in self._run_tool(turn, asked.llm_name, asked.arguments, confirmed=True):
                if isinstance(item, ToolRun):
                    run = item
                else:
                    yield item
            assert run is not None
            runs = (run,)
            said = self._said_done(turn, run)
        else:
            action = spoken_action(asked.tool, asked.arguments)
            spoken = CANCELLED_SPOKEN[turn.language].format(action=action)
            said = _Said(CANCELLED[turn.language].format(tool=asked.tool), spoken)
        text = said.text
        yield Token(text=text, speech=said.speech)
        record_chat_turn("confirmation")
        _record_tool_time(turn)
        reason = turn.log.offline_reason
        answer = _Answer((text,), runs)
        stored = await self._store(turn, context, text, None, runs, reason)
        yield Done(
            metadata=self._metadata(turn, verdict, answer, reason, context=context, stored=stored)
        )

    def _said_done(self, turn: _Turn, run: ToolRun) -> "_Said":
        """A call that ran, as the text shows it (the tool and its result, for the record) and
        as a voice says it: in words, as the offline rules would ("Volume set to 30.")."""
        template = DONE if run.ok else FAILED
        result = clip(run.outcome.text, _SHOWN_RESULT_CHARS)
        text = template[turn.language].format(tool=run.tool, result=result)
        intent = self.detector.called(run.llm_name, run.arguments, turn.functions)
        return _Said(text, device_reply(intent, run.outcome.text, run.ok, turn.language))

    def _sources(
        self, turn: _Turn, found: _Found, device_only: bool, spoken: str
    ) -> Sources | None:
        """The references and the section that follows the answer (`spoken`), its tokens
        counted. When the client set `stop` or `max_tokens`, which cover the whole content, the
        section is empty: the content is the answer alone and the references go beside it."""
        if device_only or not found.results:
            return None
        items: list[SourceItem] = []
        seen: set[str] = set()
        for result in found.results:
            if result.link in seen:
                continue
            seen.add(result.link)
            items.append(SourceItem(title=result.title, link=result.link, origin=result.origin))
        lines = [prompts.SOURCES_HEADING[turn.language]]
        lines += [f"{i}. {item.title} - {item.link}" for i, item in enumerate(items, 1)]
        sampling = turn.request.sampling
        if sampling.stop or sampling.max_tokens is not None:
            return Sources(items=items, section="")
        section = "\n".join(lines)
        _count_added(turn, (spoken,), f"\n\n{section}")
        return Sources(items=items, section=section)

    async def _store(
        self,
        turn: _Turn,
        context: _Context,
        answer: str,
        sources: Sources | None,
        runs: Sequence[ToolRun],
        offline_reason: str | None,
    ) -> bool:
        if context.conversation is None:
            return False
        began = time.perf_counter()
        metadata = {
            "language": turn.language,
            "offline": offline_reason is not None,
            "tools": [run.tool for run in runs],
            "sources": [item.link for item in sources.items] if sources else [],
        }
        try:
            await self.memory.append_pair(
                context.conversation.id, turn.query, answer, metadata=metadata
            )
        except BridgeError as exc:
            log.warning("chat memory write failed", error=str(exc), device_id=turn.log.device_id)
            return False
        turn.log.step("memory_store", began)
        return True

    async def _summarize(
        self, turn: _Turn, context: _Context, answer: str, *, offline: bool
    ) -> None:
        assert context.conversation is not None
        began = time.perf_counter()
        piece = ""
        how = "extractive"
        if self.llm is not None and not offline:
            prompt = prompts.summarize_prompt(turn.language, turn.query, answer)
            sampling = _with_max_tokens(DETERMINISTIC, 120)
            try:
                sent = [Message("user", prompt)]
                reply = await self._complete(turn, sent, turn.request.chat_model, sampling)
            except LlmError as exc:
                log.info("chat summary falls back to extractive", error=str(exc))
            else:
                piece, how = reply.text.strip(), "llm"
        if not piece:
            piece = extractive_summary(answer, turn.language)
        summary = self.bounded(
            "\n\n".join(part for part in (context.conversation.summary, piece) if part)
        )
        try:
            await self.memory.set_summary(context.conversation.id, summary)
        except BridgeError as exc:
            log.warning("chat summary write failed", error=str(exc), device_id=turn.log.device_id)
        turn.log.step("summary", began, how=how, length=len(summary))

    # ---- helpers ------------------------------------------------------------------------------

    def _metadata(
        self,
        turn: _Turn,
        verdict: Guardrail,
        answer: _Answer,
        offline_reason: str | None,
        *,
        context: _Context | None = None,
        found: _Found | None = None,
        stored: bool = False,
        sources: Sources | None = None,
        full_answer: str | None = None,
    ) -> TurnMetadata:
        """`full_answer`: the text as stored (with its sources section); the spoken tokens
        when not given."""
        conversation = context.conversation if context is not None else None
        found = found or _Found()
        return TurnMetadata(
            conversation_id=conversation.id if conversation else turn.request.conversation_id,
            device_id=turn.request.device_id,
            language=turn.language,
            guardrail=verdict,
            stored=stored,
            sources=sources.items if sources else [],
            offline=offline_reason is not None,
            offline_reason=offline_reason,
            search=found.status,
            search_error=found.error,
            steps_ms=dict(turn.log.steps),
            tool_rounds=answer.tool_rounds,
            answer=answer.text if full_answer is None else full_answer,
            finish_reason=answer.finish_reason,
            usage=_usage(turn, answer),
            confirmation=_confirmation(answer.confirmation),
        )


def _model_verdict(reply: str) -> _Verdict:
    word = reply.strip().upper()
    if "NO" in word:  # rejection first, as in the seed design
        return _Verdict(Guardrail(verdict="refused", reason="not dental", by="llm"), False)
    if "YES" in word:
        return _Verdict(Guardrail(verdict="passed", reason="dental (model)", by="llm"), True)
    unclear = Guardrail(verdict="refused", reason="unclear guardrail reply", by="llm")
    return _Verdict(unclear, False)


def _record_tool_time(turn: _Turn) -> None:
    """The turn's time in device calls, one observation a turn (none without a call)."""
    if turn.log.tool_seconds:
        record_chat_stage("tools", turn.log.tool_seconds)


def _went_offline(turn: _Turn, exc: LlmError) -> str:
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


def _usage(turn: _Turn, answer: _Answer) -> TurnUsage | None:
    """The model's own counts of every call of the turn (the tokenizer's where it gave none),
    plus the tokenizer's count of every part of the content the bridge wrote, as `_limited`
    and `_count_added` counted it (an offline answer, a question, the sources section); an
    answer no model wrote and nothing counted (a refusal or a confirmed call, which do not go
    through `_limited`) is counted here. With no model call, the prompt is the question."""
    usage = turn.usage
    nothing = usage.prompt == usage.completion == 0
    if not turn.request.count_usage and (usage.counted or nothing):
        return None  # counting is the OpenAI front end's need, not every turn's cost
    prompt, completion, counted = usage.prompt, usage.completion, usage.counted
    if nothing:
        completion = count_tokens(answer.text.strip())
    if prompt == 0:  # no model was asked
        prompt = count_prompt([turn.query])
        counted = True
    return TurnUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        counted_by="tokenizer" if counted else "provider",
    )


def _confirmation_keys(request: TurnRequest, conversation: Conversation | None = None) -> list[str]:
    """Where a question about a risky call is remembered: the conversation; the device only
    for a turn that named no conversation (so another conversation cannot answer it)."""
    conversation_id = request.conversation_id or (conversation.id if conversation else None)
    keys = [f"conversation:{conversation_id}"] if conversation_id else []
    if request.conversation_id is None and request.device_id is not None:
        keys.append(f"device:{request.device_id}")
    return keys


def _confirmation(pending: PendingConfirmation | None) -> Confirmation | None:
    if pending is None:
        return None
    return Confirmation(tool=pending.tool, arguments=pending.arguments, reason=pending.reason)


def _compact(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":")) if arguments else ""


def _with_max_tokens(sampling: Sampling, max_tokens: int) -> Sampling:
    if sampling.max_tokens is not None and sampling.max_tokens <= max_tokens:
        return sampling
    return dataclasses.replace(sampling, max_tokens=max_tokens)


@dataclass(frozen=True, slots=True)
class _Said:
    """A part of an answer no model wrote: its text, and what a voice says for it when that
    differs (None: the text itself)."""

    text: str
    speech: str | None = None


def _speech(parts: Sequence[_Said], text: str, separator: str = "\n\n") -> str | None:
    """What a voice says for `text` (the parts joined by `separator`, maybe cut by `_limited`):
    each part's speech; None when every part is said as written. A part with a speech of its
    own that was cut short says nothing (half a replacement could say the wrong thing)."""
    if all(part.speech is None for part in parts):
        return None
    said: list[str] = []
    position = 0
    for index, part in enumerate(parts):
        lead = separator if index else ""
        whole = lead + part.text
        piece = text[position : position + len(whole)]
        position += len(whole)
        if not piece:
            break
        if part.speech is None:
            said.append(piece)
        elif piece == whole:
            said.append(lead + part.speech)
    return "".join(said)


def _limited(turn: _Turn, said: Sequence[str], text: str) -> tuple[str, bool]:
    """An answer no model wrote, after what the turn said before it (`said`), within the
    client's `stop` and `max_tokens` (`_within`) and counted into the turn's completion tokens
    (`_count_added`); and whether it was cut for length."""
    text, cut = _within(turn, said, text)
    _count_added(turn, said, text)
    return text, cut


def _within(turn: _Turn, said: Sequence[str], text: str) -> tuple[str, bool]:
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


def _count_added(turn: _Turn, said: Sequence[str], text: str) -> None:
    """Add the tokens of text the bridge wrote after `said` (an offline answer, a question, the
    sources section) to the turn's completion tokens, when the front end reports `usage`: what
    the text adds to the whole content's count, so the pieces of an answer no model wrote sum
    to the count of the content."""
    if not turn.request.count_usage or not text:
        return
    before = "".join(said)
    turn.usage.completion += count_tokens(before + text) - count_tokens(before)


def _history_message(message: StoredMessage) -> Message:
    return Message(message.role, without_sources(message.content))


async def collect(events: AsyncIterator[ChatEvent]) -> list[ChatEvent]:
    """Every event of a turn, in order (for tests, the CLI and non-streaming front ends)."""
    return [event async for event in events]
