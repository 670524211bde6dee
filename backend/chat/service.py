"""One chat turn, end to end (seed 003): language → guardrail → memory → search → LLM with
device tools → sources → memory with an accumulated summary; offline when no model answers.

`ChatService.run_turn(request)` is an async generator of `ChatEvent`s (see `events.py`); it
never raises for model, search, tool or device failures: they become events and metadata.
"""

import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import structlog
from pydantic import BaseModel, ConfigDict, Field, SkipValidation, model_validator

from backend.chat import prompts
from backend.chat.confirm import (
    CANCELLED,
    DONE,
    FAILED,
    ConfirmationBook,
    PendingConfirmation,
    answer_kind,
    question,
)
from backend.chat.context import ClientTurn, client_context, without_sources
from backend.chat.deadline import Deadline
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
    IntentDetector,
    dental_words,
    device_reply,
    extractive_answer,
    extractive_summary,
    rejected_reply,
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

log = structlog.get_logger("chat")
_T = TypeVar("_T")

# A question, typed or spoken, fits in this many characters. Longer ones are refused before
# any work: the guardrail, the intent rules and the ranking all read the whole text.
MAX_QUERY_CHARS = 4000
# The accumulated summary kept and sent to the model: the newest part within both bounds (the
# token count is an over-estimate, text.estimated_tokens). Without a bound it grew by a piece
# every turn, 160 KB in every prompt after 400 turns.
SUMMARY_MAX_CHARS = 4000
SUMMARY_MAX_TOKENS = 1000
_SPOKEN_RESULT_CHARS = 200  # a confirmed call's result, as said back to the user
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
    front end chose (`conversation_id`)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    messages: list[InputMessage] = Field(default_factory=list)
    text: str | None = None
    conversation_id: str | None = Field(default=None, max_length=128)
    device_id: str | None = None
    context: Literal["memory", "messages"] = "memory"
    store: bool = True
    sampling: Annotated[Sampling, SkipValidation] = Field(default=ANY_SAMPLING, exclude=True)
    count_usage: bool = False  # the front end reports `usage`: count what the model did not
    # This request's models (the console's settings); None: the server's configured ones.
    chat_model: ModelName | None = None
    guardrail_model: ModelName | None = None
    toolbox: Annotated[ToolBox | None, SkipValidation] = Field(default=None, exclude=True)

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


@dataclass
class _Turn:
    """Mutable state of one turn (internal)."""

    request: TurnRequest
    query: str
    language: Language = "en"
    conversation: Conversation | None = None
    device_id: str | None = None
    offline_reason: str | None = None
    steps: dict[str, float] = field(default_factory=dict)
    answer: list[str] = field(default_factory=list)
    results: list[SearchResult] = field(default_factory=list)
    search: Literal["ok", "failed", "skipped"] = "skipped"
    search_error: str | None = None
    tool_rounds: int = 0
    used_tools: list[str] = field(default_factory=list)
    confirmation: PendingConfirmation | None = None  # a risky call the user is asked about
    history: list[Message] = field(default_factory=list)
    summary: str = ""
    instructions: str = ""  # the client's system/developer messages
    about_device: bool = False  # only then are the device's tools offered to the model
    tool_results: list[tuple[str, str, bool]] = field(default_factory=list)  # (tool, text, ok)
    finish_reason: Literal["stop", "length"] = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counted: bool = False  # some usage counted by the tokenizer, not reported by the model
    deadline: Deadline | None = None

    @property
    def conversation_id(self) -> str | None:
        if self.conversation is not None:
            return self.conversation.id
        return self.request.conversation_id

    def log_step(self, step: str, began: float, **detail: Any) -> None:
        ms = round((time.perf_counter() - began) * 1000, 3)
        self.steps[step] = round(self.steps.get(step, 0.0) + ms, 3)
        log.info(
            "chat step",
            step=step,
            duration_ms=ms,
            conversation_id=self.conversation_id,
            device_id=self.device_id,
            **detail,
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
        if self.llm is not None:
            await self.llm.aclose()

    # ---- the turn ------------------------------------------------------------------------------

    async def run_turn(self, request: TurnRequest) -> AsyncIterator[ChatEvent]:
        # Front ends refuse (HTTP) or repair (devices) invalid text; this keeps any other caller
        # from failing deep in the turn (SQLite, the model's client) on a lone surrogate.
        query = replace_surrogates(request.query.strip())
        turn = _Turn(request, query, device_id=request.device_id)
        turn.deadline = Deadline(self.turn_timeout_s, lambda: TurnDeadline(self.turn_timeout_s))
        began = time.perf_counter()
        outcome = "abandoned"  # the consumer stopped reading (a client went away)
        try:
            async for event in self._turn_events(turn, request):
                if isinstance(event, Done):
                    outcome = event.metadata.guardrail.verdict
                yield event
        except Exception:
            outcome = "failed"
            raise
        finally:
            turn.deadline.close()
            log.info(
                "chat turn",
                step="turn",
                outcome=outcome,
                duration_ms=round((time.perf_counter() - began) * 1000, 3),
                offline=turn.offline_reason is not None,
                tools=len(turn.used_tools),
                conversation_id=turn.conversation_id,
                device_id=turn.device_id,
            )

    async def _turn_events(self, turn: _Turn, request: TurnRequest) -> AsyncIterator[ChatEvent]:
        if self.llm is None:
            turn.offline_reason = "no LLM configured (llm_provider = none)"
        toolbox: ToolBox = request.toolbox if request.toolbox is not None else NoTools()

        began = time.perf_counter()
        turn.language = detect_language(turn.query)
        functions = [with_description_choices(spec) for spec in toolbox.functions()]
        turn.log_step("language", began, language=turn.language)

        asked = self.confirmations.take(_confirmation_keys(request))
        if asked is not None and asked.device_id == request.device_id:
            kind = answer_kind(turn.query)
            if kind != "other":
                async for event in self._confirmed(turn, toolbox, asked, kind == "yes"):
                    yield event
                return

        began = time.perf_counter()
        verdict, dental = await self._guardrail(turn, functions)
        # A clearly dental question does not get the device's functions (a toothache question
        # made a real model raise the screen brightness), unless it also asks something of the
        # device. Whatever the rules could not place keeps them (the model judged it).
        turn.about_device = bool(functions) and (
            verdict.by != "rules"
            or not dental
            or self.detector.is_device_request(turn.query, functions)
        )
        turn.log_step("guardrail", began, verdict=verdict.verdict, by=verdict.by)
        if verdict.verdict == "refused":
            text = prompts.refusal(turn.language, bool(functions))
            turn.answer.append(text)
            yield Token(text=text)
            yield Done(metadata=self._metadata(turn, verdict, stored=False))
            return

        began = time.perf_counter()
        await self._load_memory(turn)
        turn.log_step("memory_load", began, history=len(turn.history))

        device_only = not dental
        began = time.perf_counter()
        await self._search(turn, skip_web=device_only)
        turn.log_step("search", began, status=turn.search, results=len(turn.results))

        if turn.offline_reason is None:
            async for event in self._answer_with_llm(turn, toolbox, functions):
                yield event
        if turn.offline_reason is not None:
            async for event in self._answer_offline(turn, toolbox, functions, device_only):
                yield event
        if turn.confirmation is not None:
            text = ("\n\n" if turn.answer else "") + question(
                turn.language, turn.confirmation, _compact(turn.confirmation.arguments)
            )
            turn.answer.append(text)
            yield Token(text=text)
            self.confirmations.remember(_confirmation_keys(request, turn), turn.confirmation)

        sources = self._sources(turn, device_only)
        if sources is not None:
            yield sources
        answer = "".join(turn.answer).strip()
        full = f"{answer}\n\n{sources.section}" if sources is not None else answer
        # Nothing empty is stored or summarised (an empty answer's summary was invented).
        stored = bool(answer) and await self._store(turn, full, sources)
        if stored:
            await self._summarize(turn, answer)
        yield Done(
            metadata=self._metadata(turn, verdict, stored=stored, sources=sources, answer=full)
        )

    # ---- steps --------------------------------------------------------------------------------

    async def _guardrail(
        self, turn: _Turn, functions: Sequence[FunctionSpec]
    ) -> tuple[Guardrail, bool]:
        """(verdict, whether the question is about dentistry)."""
        dental = dental_words(turn.query)
        if dental == "clear":
            return Guardrail(verdict="passed", reason="dental question", by="rules"), True
        if functions and self.detector.is_device_request(turn.query, functions):
            # The device request passed; an ambiguous dental word beside it is taken as meant.
            return Guardrail(verdict="passed", reason="device request", by="rules"), bool(dental)
        if self.llm is not None and turn.offline_reason is None:
            names = [f"{spec.llm_name}: {spec.description}" for spec in functions]
            prompt = prompts.guardrail_prompt(turn.language, turn.query, names)
            sent = [Message("user", prompt)]
            sampling = _with_max_tokens(DETERMINISTIC, 3)
            try:
                model = turn.request.guardrail_model or self.llm.models.guardrail
                reply = await self._complete(turn, sent, model, sampling)
            except LlmError as exc:
                self._go_offline(turn, exc)
            else:
                word = reply.text.strip().upper()
                if "NO" in word:  # rejection first, as in the seed design
                    return Guardrail(verdict="refused", reason="not dental", by="llm"), False
                if "YES" in word:
                    return Guardrail(verdict="passed", reason="dental (model)", by="llm"), True
                return (
                    Guardrail(verdict="refused", reason="unclear guardrail reply", by="llm"),
                    False,
                )
        if dental == "ambiguous":  # no model to judge "brush", "gum"...: answer rather than refuse
            return Guardrail(verdict="passed", reason="dental word (unchecked)", by="rules"), True
        return Guardrail(verdict="refused", reason="no dental or device words", by="rules"), False

    async def _load_memory(self, turn: _Turn) -> None:
        request = turn.request
        if request.context == "messages":
            context = client_context(request.earlier(), self.history_messages, turn.language)
            turn.history, turn.instructions = context.history, context.instructions
            turn.summary = self.bounded(context.summary)
            if request.store:
                await self._open_conversation(turn)
            return
        try:
            if request.conversation_id is None and request.device_id is not None:
                turn.conversation = await self.memory.conversation_for_device(request.device_id)
            else:
                turn.conversation = await self.memory.get_or_create(
                    request.conversation_id, device_id=request.device_id
                )
            stored = await self.memory.recent(turn.conversation.id, self.history_messages)
        except BridgeError as exc:
            log.warning("chat memory unavailable", error=str(exc), device_id=turn.device_id)
            return
        turn.history = [_history_message(message) for message in stored]
        turn.summary = self.bounded(turn.conversation.summary)

    async def _open_conversation(self, turn: _Turn) -> None:
        """A new stored conversation for a client that sent its own history with `store`."""
        try:
            turn.conversation = await self.memory.get_or_create(
                turn.request.conversation_id, device_id=turn.request.device_id
            )
        except BridgeError as exc:
            log.warning("chat memory unavailable", error=str(exc), device_id=turn.device_id)

    async def _search(self, turn: _Turn, *, skip_web: bool) -> None:
        results: list[SearchResult] = []
        if self.web is not None and not skip_web:
            try:
                results = await self.web.search(turn.query, self.search_results)
            except SearchFailed as exc:
                turn.search, turn.search_error = "failed", str(exc)
            else:
                turn.search = "ok"
        if not skip_web:
            kb = self.knowledge.search(turn.query, self.kb_results, language=turn.language)
            seen = {result.link for result in results}
            results += [result for result in kb if result.link not in seen]
        turn.results = results

    async def _answer_with_llm(
        self,
        turn: _Turn,
        toolbox: ToolBox,
        functions: Sequence[FunctionSpec],
    ) -> AsyncIterator[ChatEvent]:
        assert self.llm is not None
        unavailable = toolbox.unavailable_reason if turn.about_device else None
        offered = list(toolbox.functions()) if turn.about_device and unavailable is None else []
        if not offered:  # external MCP servers' tools are not device tools (backend/mcp_servers)
            offered = toolbox.external_functions()
        if unavailable is not None:
            failed = self._unavailable_event(turn, toolbox, functions, unavailable)
            if failed is not None:
                yield failed
        user = prompts.user_prompt(
            turn.language,
            turn.query,
            summary=turn.summary,
            search_results=format_results(turn.results),
            tools_unavailable=unavailable,
        )
        messages = [Message("system", prompts.system_prompt(turn.language, turn.instructions))]
        messages += turn.history
        messages.append(Message("user", user))
        log.debug("chat prompt", conversation_id=turn.conversation_id, prompt=user)

        began = time.perf_counter()
        invalid_rounds = 0
        tool_time = 0.0
        try:
            for round_index in range(self.max_tool_rounds + 1):
                tools = offered if round_index < self.max_tool_rounds else []
                if offered and not tools:
                    messages.append(Message("system", prompts.TOO_MANY_ROUNDS_NOTE[turn.language]))
                calls: list[ToolCall] = []
                text: list[str] = []
                async for item in self._stream_round(turn, messages, tools):
                    if isinstance(item, TextDelta):
                        text.append(item.text)
                        turn.answer.append(item.text)
                        yield Token(text=item.text)
                    else:
                        calls.append(item)
                if not calls or turn.finish_reason == "length":
                    break
                turn.tool_rounds += 1
                messages.append(Message("assistant", "".join(text), tool_calls=tuple(calls)))
                tools_began = time.perf_counter()
                invalid = False
                for call in calls:
                    async for event, reply in self._run_call(turn, toolbox, call):
                        if event is not None:
                            yield event
                        if reply is not None:
                            messages.append(reply)
                    invalid = invalid or call.arguments is None
                tool_time += time.perf_counter() - tools_began
                if turn.confirmation is not None:
                    break  # a risky call: the user is asked before anything else happens
                invalid_rounds += invalid
                if invalid_rounds >= 2:
                    text_end = prompts.INVALID_TOOL_CALL_ANSWER[turn.language]
                    turn.answer.append(("\n\n" if turn.answer else "") + text_end)
                    yield Token(text=turn.answer[-1])
                    break
        except TurnDeadline as exc:
            if "".join(turn.answer).strip():
                turn.finish_reason = "length"  # the answer so far is the answer, cut
            else:
                self._go_offline(turn, exc)
        except LlmError as exc:
            self._go_offline(turn, exc)
            if turn.answer:
                turn.answer.append("\n\n")
                yield Token(text="\n\n")
        turn.steps["tools"] = round(tool_time * 1000, 3)
        turn.log_step(
            "llm", began, rounds=turn.tool_rounds, offline=turn.offline_reason is not None
        )
        turn.steps["llm"] = round(turn.steps["llm"] - turn.steps["tools"], 3)
        log.debug("chat answer", conversation_id=turn.conversation_id, answer="".join(turn.answer))

    async def _stream_round(
        self, turn: _Turn, messages: list[Message], tools: Sequence[FunctionSpec]
    ) -> AsyncIterator[TextDelta | ToolCall]:
        """One model round: its text (cut at the answer's token budget) and tool calls, within
        the turn's deadline, its usage added to the turn's."""
        assert self.llm is not None
        budget = self._answer_budget(turn)
        sampling = _with_max_tokens(turn.request.sampling, budget)
        # The model counts with its own tokenizer: the bridge cuts only a server that clearly
        # ignores max_tokens (one that keeps talking), with room for the tokenizers to differ.
        budget += budget // 2 + 8
        model = turn.request.chat_model  # None: the provider's own chat model
        stream = self.llm.stream(messages, model=model, tools=tools, sampling=sampling)
        said: list[str] = []
        calls: list[ToolCall] = []
        used = 0
        end = StreamEnd()
        try:
            while True:
                item = await self._within(turn, anext(stream, None))
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
                        said.append(kept)
                        yield TextDelta(kept)
                    end = StreamEnd("length", end.usage)
                    break
                used += tokens
                said.append(item.text)
                yield item
        finally:
            if isinstance(stream, AsyncGenerator):
                await stream.aclose()
            reply_text = "".join(said) + "".join(call.raw_arguments for call in calls)
            self._count(turn, messages, reply_text, end.usage)
        if end.finish_reason == "length" and not calls:
            turn.finish_reason = "length"

    def _answer_budget(self, turn: _Turn) -> int:
        asked = turn.request.sampling.max_tokens
        cap = self.max_answer_tokens if asked is None else min(asked, self.max_answer_tokens)
        spent = sum(count_tokens(piece) for piece in turn.answer)
        return max(1, cap - spent)

    async def _complete(
        self, turn: _Turn, messages: list[Message], model: str | None, sampling: Sampling
    ) -> Completion:
        assert self.llm is not None
        reply = await self._within(
            turn, self.llm.complete(messages, model=model, sampling=sampling)
        )
        self._count(turn, messages, reply.text, reply.usage)
        return reply

    @staticmethod
    async def _within(turn: _Turn, step: Awaitable[_T]) -> _T:
        """A model step within what is left of the turn's deadline."""
        assert turn.deadline is not None
        return await turn.deadline.run(step)

    @staticmethod
    def _count(
        turn: _Turn, messages: Sequence[Message], reply: str, reported: TokenCount | None
    ) -> None:
        if reported is not None:
            turn.prompt_tokens += reported.prompt
            turn.completion_tokens += reported.completion
            return
        turn.counted = True
        if not turn.request.count_usage:
            return  # tokenizing every prompt costs ~0.1 ms per KB; only the OpenAI API needs it
        turn.prompt_tokens += count_prompt(message.content for message in messages)
        turn.completion_tokens += count_tokens(reply)

    async def _run_call(
        self, turn: _Turn, toolbox: ToolBox, call: ToolCall
    ) -> AsyncIterator[tuple[ChatEvent | None, Message | None]]:
        """Events for one model call and the tool message that answers it."""
        tool = toolbox.device_tool_name(call.name)
        if call.arguments is None:
            error = call.error or "invalid arguments"
            yield ToolFailed(tool=tool, llm_name=call.name, error=error), None
            content = f"error: {error}. Call the function again with a valid JSON object."
            yield None, Message("tool", content, tool_call_id=call.id, name=call.name)
            return
        yield ToolStarted(tool=tool, llm_name=call.name, arguments=call.arguments), None
        began = time.perf_counter()
        outcome = await toolbox.call(call.name, call.arguments)
        took = _log_tool_call(turn, tool, began, outcome)
        if outcome.needs_confirmation is not None:
            turn.confirmation = _pending(turn, tool, call.name, call.arguments, outcome)
        else:
            turn.used_tools.append(tool)
            turn.tool_results.append((tool, outcome.text, not (outcome.failed or outcome.is_error)))
        event = _outcome_event(tool, call.name, outcome, took)
        yield event, Message("tool", outcome.text, tool_call_id=call.id, name=call.name)

    async def _answer_offline(
        self,
        turn: _Turn,
        toolbox: ToolBox,
        functions: Sequence[FunctionSpec],
        device_only: bool,
    ) -> AsyncIterator[ChatEvent]:
        began = time.perf_counter()
        plan = self.detector.plan(turn.query, functions)
        # Tools the model ran before it failed: the user hears what they did, in words.
        parts = [
            (DONE if ok else FAILED)[turn.language].format(
                tool=tool, result=clip(text, _SPOKEN_RESULT_CHARS)
            )
            for tool, text, ok in turn.tool_results
        ]
        unavailable = toolbox.unavailable_reason
        for intent in plan.intents:
            tool = toolbox.device_tool_name(intent.llm_name)
            if tool in turn.used_tools:
                continue  # the model already did it before the service went away
            if unavailable is not None:
                yield ToolFailed(tool=tool, llm_name=intent.llm_name, error=unavailable)
                parts.append(_NO_PERMISSION[turn.language].format(reason=unavailable))
                break
            yield ToolStarted(tool=tool, llm_name=intent.llm_name, arguments=intent.arguments)
            call_began = time.perf_counter()
            outcome = await toolbox.call(intent.llm_name, intent.arguments)
            took = _log_tool_call(turn, tool, call_began, outcome)
            if outcome.needs_confirmation is not None:
                yield ToolFailed(
                    tool=tool, llm_name=intent.llm_name, error=outcome.text, duration_ms=took
                )
                turn.confirmation = _pending(turn, tool, intent.llm_name, intent.arguments, outcome)
                break
            turn.used_tools.append(tool)
            yield _outcome_event(tool, intent.llm_name, outcome, took)
            ok = not (outcome.failed or outcome.is_error)
            parts.append(device_reply(intent, outcome.text, ok, turn.language))
        if not plan.intents and plan.rejected and not plan.question:
            parts.append(rejected_reply(plan.rejected[0], turn.language))
        question = plan.question if functions else turn.query
        if question and not device_only:
            answer = extractive_answer(question, turn.results, turn.language)
            parts.append(f"{OFFLINE_NOTE[turn.language]}\n{answer}")
        elif question and not plan.intents and not plan.rejected:
            parts.append(extractive_answer(question, turn.results, turn.language))
        text = _limited(turn, "\n\n".join(parts))
        if text:
            turn.answer.append(text)
            yield Token(text=text)
        turn.log_step(
            "offline",
            began,
            reason=turn.offline_reason,
            calls=len(plan.intents),
            question=bool(question),
        )

    async def _confirmed(
        self, turn: _Turn, toolbox: ToolBox, asked: PendingConfirmation, yes: bool
    ) -> AsyncIterator[ChatEvent]:
        """The turn after a risky call was asked about: run it (yes) or drop it (no)."""
        verdict = Guardrail(verdict="passed", reason="confirmation answer", by="rules")
        await self._load_memory(turn)
        if yes:
            yield ToolStarted(tool=asked.tool, llm_name=asked.llm_name, arguments=asked.arguments)
            began = time.perf_counter()
            outcome = await toolbox.call(asked.llm_name, asked.arguments, confirmed=True)
            turn.used_tools.append(asked.tool)
            took = _log_tool_call(turn, asked.tool, began, outcome)
            yield _outcome_event(asked.tool, asked.llm_name, outcome, took)
            template = FAILED if outcome.failed or outcome.is_error else DONE
            result = clip(outcome.text, _SPOKEN_RESULT_CHARS)
            text = template[turn.language].format(tool=asked.tool, result=result)
        else:
            text = CANCELLED[turn.language].format(tool=asked.tool)
        turn.answer.append(text)
        yield Token(text=text)
        stored = await self._store(turn, text, None)
        yield Done(metadata=self._metadata(turn, verdict, stored=stored))

    def _unavailable_event(
        self,
        turn: _Turn,
        toolbox: ToolBox,
        functions: Sequence[FunctionSpec],
        reason: str,
    ) -> ToolFailed | None:
        for clause_intent in self.detector.plan(turn.query, functions).intents:
            tool = toolbox.device_tool_name(clause_intent.llm_name)
            return ToolFailed(tool=tool, llm_name=clause_intent.llm_name, error=reason)
        return None

    def _sources(self, turn: _Turn, device_only: bool) -> Sources | None:
        if device_only or not turn.results:
            return None
        items: list[SourceItem] = []
        seen: set[str] = set()
        for result in turn.results:
            if result.link in seen:
                continue
            seen.add(result.link)
            items.append(SourceItem(title=result.title, link=result.link, origin=result.origin))
        lines = [prompts.SOURCES_HEADING[turn.language]]
        lines += [f"{i}. {item.title} - {item.link}" for i, item in enumerate(items, 1)]
        return Sources(items=items, section="\n".join(lines))

    async def _store(self, turn: _Turn, answer: str, sources: Sources | None) -> bool:
        if turn.conversation is None:
            return False
        began = time.perf_counter()
        metadata = {
            "language": turn.language,
            "offline": turn.offline_reason is not None,
            "tools": turn.used_tools,
            "sources": [item.link for item in sources.items] if sources else [],
        }
        try:
            await self.memory.append_pair(
                turn.conversation.id, turn.query, answer, metadata=metadata
            )
        except BridgeError as exc:
            log.warning("chat memory write failed", error=str(exc), device_id=turn.device_id)
            return False
        turn.log_step("memory_store", began)
        return True

    async def _summarize(self, turn: _Turn, answer: str) -> None:
        assert turn.conversation is not None
        began = time.perf_counter()
        piece = ""
        how = "extractive"
        if self.llm is not None and turn.offline_reason is None:
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
            "\n\n".join(part for part in (turn.conversation.summary, piece) if part)
        )
        try:
            await self.memory.set_summary(turn.conversation.id, summary)
        except BridgeError as exc:
            log.warning("chat summary write failed", error=str(exc), device_id=turn.device_id)
        turn.log_step("summary", began, how=how, length=len(summary))

    # ---- helpers ------------------------------------------------------------------------------

    def _go_offline(self, turn: _Turn, exc: LlmError) -> None:
        turn.offline_reason = str(exc)
        log.warning(
            "chat offline mode",
            reason=str(exc),
            conversation_id=turn.conversation_id,
            device_id=turn.device_id,
        )

    def _metadata(
        self,
        turn: _Turn,
        verdict: Guardrail,
        *,
        stored: bool,
        sources: Sources | None = None,
        answer: str | None = None,
    ) -> TurnMetadata:
        """`answer`: the full text as stored (with its sources section); the spoken tokens
        when not given."""
        return TurnMetadata(
            conversation_id=turn.conversation_id,
            device_id=turn.device_id,
            language=turn.language,
            guardrail=verdict,
            stored=stored,
            sources=sources.items if sources else [],
            offline=turn.offline_reason is not None,
            offline_reason=turn.offline_reason,
            search=turn.search,
            search_error=turn.search_error,
            steps_ms=dict(turn.steps),
            tool_rounds=turn.tool_rounds,
            answer="".join(turn.answer) if answer is None else answer,
            finish_reason=turn.finish_reason,
            usage=self._usage(turn),
            confirmation=_confirmation(turn.confirmation),
        )

    @staticmethod
    def _usage(turn: _Turn) -> TurnUsage | None:
        """The model's own counts of every call of the turn; the tokenizer's where it gave none,
        and for an answer no model wrote (offline, refused): the question and the answer."""
        nothing = turn.prompt_tokens == turn.completion_tokens == 0
        if not turn.request.count_usage and (turn.counted or nothing):
            return None  # counting is the OpenAI front end's need, not every turn's cost
        prompt, completion, counted = turn.prompt_tokens, turn.completion_tokens, turn.counted
        if prompt == 0 and completion == 0:
            prompt = count_prompt([turn.query])
            completion = count_tokens("".join(turn.answer).strip())
            counted = True
        return TurnUsage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            counted_by="tokenizer" if counted else "provider",
        )


def _log_tool_call(turn: _Turn, tool: str, began: float, outcome: ToolOutcome) -> float:
    """Logs the call and returns its duration in ms (the front ends show it)."""
    took = round((time.perf_counter() - began) * 1000, 3)
    log.info(
        "chat tool call",
        step="tool",
        tool=tool,
        duration_ms=took,
        failed=outcome.failed,
        is_error=outcome.is_error,
        offline=turn.offline_reason is not None,
        conversation_id=turn.conversation_id,
        device_id=turn.device_id,
    )
    return took


def _outcome_event(
    tool: str, llm_name: str, outcome: ToolOutcome, took: float
) -> ToolCompleted | ToolFailed:
    """The event for a finished call: failed (no answer) or completed (maybe the tool's error)."""
    if outcome.failed:
        return ToolFailed(tool=tool, llm_name=llm_name, error=outcome.text, duration_ms=took)
    return ToolCompleted(
        tool=tool,
        llm_name=llm_name,
        result_text=outcome.text,
        is_error=outcome.is_error,
        duration_ms=took,
    )


def _confirmation_keys(request: TurnRequest, turn: _Turn | None = None) -> list[str]:
    """Where a question about a risky call is remembered: the conversation; the device only
    for a turn that named no conversation (so another conversation cannot answer it)."""
    conversation_id = request.conversation_id or (turn.conversation_id if turn else None)
    keys = [f"conversation:{conversation_id}"] if conversation_id else []
    if request.conversation_id is None and request.device_id is not None:
        keys.append(f"device:{request.device_id}")
    return keys


def _pending(
    turn: _Turn, tool: str, llm_name: str, arguments: dict[str, Any], outcome: ToolOutcome
) -> PendingConfirmation:
    return PendingConfirmation(
        device_id=turn.device_id,
        tool=tool,
        llm_name=llm_name,
        arguments=dict(arguments),
        reason=outcome.needs_confirmation or "risky tool",
        asked_at=time.time(),
    )


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


def _limited(turn: _Turn, text: str) -> str:
    """An answer no model wrote, within the client's `stop` and `max_tokens`."""
    sampling = turn.request.sampling
    for stop in sampling.stop:
        if stop in text:
            text = text[: text.index(stop)]
    if sampling.max_tokens is not None:
        budget = sampling.max_tokens - sum(count_tokens(piece) for piece in turn.answer)
        cut = cut_to_tokens(text, max(0, budget))
        if cut != text:
            text, turn.finish_reason = cut, "length"
    return text


def _history_message(message: StoredMessage) -> Message:
    return Message(message.role, without_sources(message.content))


async def collect(events: AsyncIterator[ChatEvent]) -> list[ChatEvent]:
    """Every event of a turn, in order (for tests, the CLI and non-streaming front ends)."""
    return [event async for event in events]
