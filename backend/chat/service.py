"""One chat turn, end to end (seed 003): language → guardrail → memory → search → LLM with
device tools → sources → memory with an accumulated summary; offline when no model answers.

`ChatService.run_turn(request)` is an async generator of `ChatEvent`s (see `events.py`); it
never raises for model, search, tool or device failures: they become events and metadata.
"""

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

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
from backend.chat.events import (
    ChatEvent,
    Done,
    Guardrail,
    SourceItem,
    Sources,
    Token,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnMetadata,
)
from backend.chat.language import detect_language
from backend.chat.llm.base import (
    FunctionSpec,
    LlmError,
    LlmProvider,
    Message,
    TextDelta,
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
from backend.chat.text import Language, bounded_summary, clip, replace_surrogates
from backend.chat.tools import NoTools, ToolBox, ToolOutcome
from backend.config import Settings
from backend.errors import BridgeError

log = structlog.get_logger("chat")

# A question, typed or spoken, fits in this many characters. Longer ones are refused before
# any work: the guardrail, the intent rules and the ranking all read the whole text.
MAX_QUERY_CHARS = 4000
# The accumulated summary kept and sent to the model: the newest part within both bounds (the
# token count is an over-estimate, text.estimated_tokens). Without a bound it grew by a piece
# every turn, 160 KB in every prompt after 400 turns.
SUMMARY_MAX_CHARS = 4000
SUMMARY_MAX_TOKENS = 1000
_SPOKEN_RESULT_CHARS = 200  # a confirmed call's result, as said back to the user

_NO_PERMISSION = {
    "vi": "Tôi không có quyền điều khiển thiết bị này ({reason}).",
    "en": "I'm not allowed to control this device ({reason}).",
}


class InputMessage(BaseModel):
    """One OpenAI-style message; `content` may be text or a list of parts."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = self.content or []
        return "".join(
            str(part.get("text", "")) for part in parts if part.get("type") in ("text", None)
        )


class TurnRequest(BaseModel):
    """What a front end asks for. The query is `text`, or the last user message."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    messages: list[InputMessage] = Field(default_factory=list)
    text: str | None = None
    conversation_id: str | None = Field(default=None, max_length=128)
    device_id: str | None = None
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
    ) -> None:
        self.memory = memory
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
        from backend.chat.search import DdgsSearch

        web = DdgsSearch(timeout_s=settings.search_timeout_s) if settings.search_enabled else None
        return cls(
            memory,
            make_provider(settings),
            web,
            search_results=settings.search_results,
            summary_max_chars=settings.chat_summary_max_chars,
            summary_max_tokens=settings.chat_summary_max_tokens,
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
        turn.log_step("guardrail", began, verdict=verdict.verdict, by=verdict.by)
        if verdict.verdict == "refused":
            text = prompts.refusal(turn.language, bool(functions))
            turn.answer.append(text)
            yield Token(text=text)
            yield Done(metadata=self._metadata(turn, verdict, stored=False))
            return

        began = time.perf_counter()
        history = await self._load_memory(turn)
        turn.log_step("memory_load", began, history=len(history))

        device_only = not dental
        began = time.perf_counter()
        await self._search(turn, skip_web=device_only)
        turn.log_step("search", began, status=turn.search, results=len(turn.results))

        if turn.offline_reason is None:
            async for event in self._answer_with_llm(turn, toolbox, functions, history):
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
        stored = await self._store(turn, full, sources)
        if stored:
            await self._summarize(turn, answer)
        turn.answer = [full]
        yield Done(metadata=self._metadata(turn, verdict, stored=stored, sources=sources))

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
            try:
                reply = await self.llm.complete(
                    [Message("user", prompt)], model=self.llm.models.guardrail, max_tokens=3
                )
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

    async def _load_memory(self, turn: _Turn) -> list[StoredMessage]:
        request = turn.request
        try:
            if request.conversation_id is None and request.device_id is not None:
                turn.conversation = await self.memory.conversation_for_device(request.device_id)
            else:
                turn.conversation = await self.memory.get_or_create(
                    request.conversation_id, device_id=request.device_id
                )
            return await self.memory.recent(turn.conversation.id, self.history_messages)
        except BridgeError as exc:
            log.warning("chat memory unavailable", error=str(exc), device_id=turn.device_id)
            return []

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
        history: list[StoredMessage],
    ) -> AsyncIterator[ChatEvent]:
        assert self.llm is not None
        unavailable = toolbox.unavailable_reason if functions else None
        offered = list(toolbox.functions()) if functions and unavailable is None else []
        if unavailable is not None:
            failed = self._unavailable_event(turn, toolbox, functions, unavailable)
            if failed is not None:
                yield failed
        summary = self.bounded(turn.conversation.summary) if turn.conversation is not None else ""
        user = prompts.user_prompt(
            turn.language,
            turn.query,
            summary=summary,
            search_results=format_results(turn.results),
            tools_unavailable=unavailable,
        )
        messages = [Message("system", prompts.SYSTEM[turn.language])]
        messages += [Message(m.role, _without_sources(m.content)) for m in history]
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
                async for item in self.llm.stream(messages, tools=tools):
                    if isinstance(item, TextDelta):
                        text.append(item.text)
                        turn.answer.append(item.text)
                        yield Token(text=item.text)
                    else:
                        calls.append(item)
                if not calls:
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
        _log_tool_call(turn, tool, began, outcome)
        if outcome.needs_confirmation is not None:
            turn.confirmation = _pending(turn, tool, call.name, call.arguments, outcome)
        else:
            turn.used_tools.append(tool)
        if outcome.failed:
            event: ChatEvent = ToolFailed(tool=tool, llm_name=call.name, error=outcome.text)
        else:
            event = ToolCompleted(
                tool=tool, llm_name=call.name, result_text=outcome.text, is_error=outcome.is_error
            )
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
        parts: list[str] = []
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
            _log_tool_call(turn, tool, call_began, outcome)
            if outcome.needs_confirmation is not None:
                yield ToolFailed(tool=tool, llm_name=intent.llm_name, error=outcome.text)
                turn.confirmation = _pending(turn, tool, intent.llm_name, intent.arguments, outcome)
                break
            turn.used_tools.append(tool)
            if outcome.failed:
                yield ToolFailed(tool=tool, llm_name=intent.llm_name, error=outcome.text)
            else:
                yield ToolCompleted(
                    tool=tool,
                    llm_name=intent.llm_name,
                    result_text=outcome.text,
                    is_error=outcome.is_error,
                )
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
        for index, part in enumerate(parts):
            text = part if index == 0 else "\n\n" + part
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
            _log_tool_call(turn, asked.tool, began, outcome)
            if outcome.failed:
                yield ToolFailed(tool=asked.tool, llm_name=asked.llm_name, error=outcome.text)
            else:
                yield ToolCompleted(
                    tool=asked.tool,
                    llm_name=asked.llm_name,
                    result_text=outcome.text,
                    is_error=outcome.is_error,
                )
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
            try:
                reply = await self.llm.complete([Message("user", prompt)], max_tokens=120)
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
        self, turn: _Turn, verdict: Guardrail, *, stored: bool, sources: Sources | None = None
    ) -> TurnMetadata:
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
            answer="".join(turn.answer),
        )


def _log_tool_call(turn: _Turn, tool: str, began: float, outcome: ToolOutcome) -> None:
    log.info(
        "chat tool call",
        step="tool",
        tool=tool,
        duration_ms=round((time.perf_counter() - began) * 1000, 3),
        failed=outcome.failed,
        is_error=outcome.is_error,
        offline=turn.offline_reason is not None,
        conversation_id=turn.conversation_id,
        device_id=turn.device_id,
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


def _compact(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":")) if arguments else ""


def _without_sources(content: str) -> str:
    for heading in prompts.SOURCES_HEADING.values():
        cut = content.rfind("\n\n" + heading)
        if cut != -1:
            return content[:cut]
    return content


async def collect(events: AsyncIterator[ChatEvent]) -> list[ChatEvent]:
    """Every event of a turn, in order (for tests, the CLI and non-streaming front ends)."""
    return [event async for event in events]
