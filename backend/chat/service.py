"""One chat turn, end to end (the dental chatbot flow design): language → guardrail → memory →
search → LLM with device tools → sources → memory with an accumulated summary; offline when no
model answers.

`ChatService.run_turn(request, toolbox)` is an async generator of `ChatEvent`s (see
`events.py`); it never raises for model, search, tool or device failures: they become events
and metadata.

This module is the turn's control flow; each stage has its own home. The request is pure data
(`request.py`) and the toolbox comes beside it; what the turn knows before answering is one
frozen `Turn` (`turn.py`); each stage returns what it found (`Verdict`, `Context`, `Found`,
`Answer`) instead of writing into a shared object: the guardrail (`guardrail.py`), the
conversation's memory (`history.py`), search (here), the model's answer (`model_answer.py`),
the rules' answer (`offline_answer.py`) and the question about a risky call and its answer
(`confirmation.py`). An answering stage is an async generator of events whose last item is its
`Answer`. Every device call, whoever asks for it (the model, the offline rules, a confirmed
question), goes through `tool_runs.run_tool`. When the model cannot answer, its stage says why
(`Answer.failure`) and the offline stage takes over: that is the one place the turn branches
to offline mode.
"""

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Literal

import structlog

from backend.chat import prompts
from backend.chat.confirm import ConfirmationBook, PendingConfirmation, answer_kind
from backend.chat.confirmation import Confirmations, confirmation_event
from backend.chat.conversation import Reading, read_turn
from backend.chat.deadline import Deadline
from backend.chat.events import (
    ChatEvent,
    Done,
    Guardrail,
    SourceItem,
    Sources,
    Token,
    TurnMetadata,
    TurnUsage,
)
from backend.chat.guardrail import GuardrailStage
from backend.chat.history import SUMMARY_MAX_CHARS, SUMMARY_MAX_TOKENS, History
from backend.chat.knowledge import KnowledgeBase
from backend.chat.language import detect_language
from backend.chat.llm.base import LlmProvider
from backend.chat.memory import MemoryStore
from backend.chat.model_answer import ModelAnswer
from backend.chat.offline import (
    IntentDetector,
    asks_a_device,
    concepts_in,
    is_dental,
    with_description_choices,
)
from backend.chat.offline_answer import OfflineAnswer, rules_answer
from backend.chat.request import TurnRequest
from backend.chat.search import SearchFailed, SearchResult, WebSearch
from backend.chat.text import replace_surrogates
from backend.chat.tokens import count_prompt, count_tokens
from backend.chat.tool_budget import MAX_TOOL_BYTES_PER_TURN, MAX_TOOLS_PER_TURN
from backend.chat.tool_runs import denied_event, record_tool_time
from backend.chat.tools import NoTools, ToolBox
from backend.chat.turn import (
    Answer,
    Context,
    Found,
    Peeked,
    Said,
    TokenUsage,
    Turn,
    TurnDeadline,
    TurnLog,
    count_added,
    limited,
)
from backend.config import Settings
from backend.metrics import record_chat_stage, record_chat_turn

log = structlog.get_logger("chat")

# A whole turn (guardrail, every model round and tool call, summary) ends within this by default,
# and an answer within this many tokens: a model that keeps talking made 104-161 s turns.
TURN_TIMEOUT_S = 120.0
MAX_ANSWER_TOKENS = 1024

NO_LLM = "no LLM configured (llm_provider = none)"


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
        max_tools: int = MAX_TOOLS_PER_TURN,
        max_tool_bytes: int = MAX_TOOL_BYTES_PER_TURN,
    ) -> None:
        self.memory = memory
        self.turn_timeout_s = turn_timeout_s
        self.llm = llm
        self.web = web
        self.knowledge = knowledge if knowledge is not None else KnowledgeBase.bundled()
        self.search_results = search_results
        self.kb_results = kb_results
        self.detector = IntentDetector(intent_threshold)
        # The stages, each given the parts it uses.
        self.guardrail = GuardrailStage(llm, self.detector)
        self.history = History(
            memory,
            llm,
            history_messages=history_messages,
            summary_max_chars=summary_max_chars,
            summary_max_tokens=summary_max_tokens,
        )
        self.model_answer = ModelAnswer(
            llm,
            max_tool_rounds=max_tool_rounds,
            max_answer_tokens=max_answer_tokens,
            max_tools=max_tools,
            max_tool_bytes=max_tool_bytes,
        )
        self.offline_answer = OfflineAnswer(self.detector)
        self.confirmations = Confirmations(ConfirmationBook(), self.detector)

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
            max_tools=settings.chat_max_tools_per_turn,
            max_tool_bytes=settings.chat_max_tool_bytes_per_turn,
        )

    def bounded(self, summary: str) -> str:
        """The summary within the service's bounds (one stored before there were any may be
        longer: it is cut when it is read, too)."""
        return self.history.bounded(summary)

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
        turn_log = TurnLog(request.device_id, request.conversation_id)
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
        turn_log: TurnLog,
    ) -> Turn:
        began = time.perf_counter()
        language = request.language or detect_language(query)
        functions = [with_description_choices(spec) for spec in toolbox.functions()]
        turn_log.step("language", began, language=language)
        return Turn(
            request,
            query,
            language,
            toolbox,
            functions,
            deadline,
            turn_log,
            TokenUsage(),
            Reading(query),
        )

    async def _turn_events(self, turn: Turn) -> AsyncIterator[ChatEvent]:
        request = turn.request
        asked = self.confirmations.take(request)
        if asked is not None and asked.device_id == request.device_id:
            kind = answer_kind(turn.query)
            if kind != "other":
                async for event in self._confirmed(turn, asked, kind == "yes"):
                    yield event
                return

        began = time.perf_counter()
        peeked = await self.history.peek(turn)
        turn = self._read(turn, peeked)
        turn.log.step("reading", began, follows=turn.reading.follows is not None)

        began = time.perf_counter()
        verdict = await self.guardrail.judge(turn)
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
            text, _cut = limited(turn, (), prompts.refusal(turn.language, bool(turn.functions)))
            yield Token(text=text)
            record_chat_turn("refused")
            answer = Answer((text,))
            yield Done(metadata=self._metadata(turn, guardrail, answer, offline_reason))
            return

        began = time.perf_counter()
        context = await self.history.load(turn, peeked)
        turn.log.step("memory_load", began, history=len(context.history))

        ruled = rules_answer(turn, verdict, has_model=self.llm is not None)
        if ruled is not None:  # a greeting offline, a device request with no device chosen
            async for event in self._answer_by_rules(turn, guardrail, context, ruled):
                yield event
            return

        device_only = not verdict.dental
        began = time.perf_counter()
        found = await self._search(turn, skip_web=device_only)
        turn.log.step("search", began, status=found.status, results=len(found.results))

        # A key that may not call the device: said once, whichever stage answers.
        denied = denied_event(turn, self.detector) if about_device else None
        if denied is not None:
            yield denied
        answer = Answer()
        if offline_reason is None:
            async for item in self.model_answer.answer(turn, context, found, about_device):
                if isinstance(item, Answer):
                    answer = item
                else:
                    yield item
            offline_reason = answer.failure
            turn.log.offline_reason = offline_reason
        if offline_reason is not None:
            async for item in self.offline_answer.answer(turn, found, device_only, answer):
                if isinstance(item, Answer):
                    answer = answer.then(item)
                else:
                    yield item
        pending = answer.confirmation
        if pending is not None:
            answer, text = self.confirmations.ask(turn, answer)
            if text:
                yield Token(text=text)
            self.confirmations.remember(turn, pending, context.conversation)
        record_chat_turn("offline" if offline_reason is not None else "llm")
        record_tool_time(turn)

        if pending is not None:  # the question above is the bridge's words: counted as such
            count_added(turn, answer.pieces[:-1], answer.pieces[-1])
        spoken = answer.text.strip()
        sources = self._sources(turn, found, device_only, spoken)
        if sources is not None:
            yield sources
        full = f"{spoken}\n\n{sources.section}" if sources and sources.section else spoken
        began = time.perf_counter()
        # Nothing empty is stored or summarised (an empty answer's summary was invented).
        stored = bool(spoken) and await self.history.store(
            turn, context, full, sources, answer.runs, offline_reason
        )
        if stored:
            await self.history.summarize(turn, context, spoken, offline=offline_reason is not None)
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

    async def _confirmed(
        self, turn: Turn, asked: PendingConfirmation, yes: bool
    ) -> AsyncIterator[ChatEvent]:
        """The turn after a risky call was asked about: run it (yes) or drop it (no); nothing
        else happens in that turn."""
        verdict = Guardrail(verdict="passed", reason="confirmation answer", by="rules")
        context = await self.history.load(turn)
        answer = Answer()
        async for item in self.confirmations.answer(turn, asked, yes):
            if isinstance(item, Answer):
                answer = item
            else:
                yield item
        record_chat_turn("confirmation")
        record_tool_time(turn)
        reason = turn.log.offline_reason
        stored = await self.history.store(turn, context, answer.text, None, answer.runs, reason)
        yield Done(
            metadata=self._metadata(turn, verdict, answer, reason, context=context, stored=stored)
        )

    async def _answer_by_rules(
        self, turn: Turn, guardrail: Guardrail, context: Context, said: Said
    ) -> AsyncIterator[ChatEvent]:
        text, _cut = limited(turn, (), said.text)
        yield Token(text=text)
        record_chat_turn("offline" if turn.log.offline_reason is not None else "rules")
        answer = Answer((text,))
        reason = turn.log.offline_reason
        stored = bool(text) and await self.history.store(turn, context, text, None, (), reason)
        yield Done(
            metadata=self._metadata(turn, guardrail, answer, reason, context=context, stored=stored)
        )

    # ---- reading and search ------------------------------------------------------------------

    def _read(self, turn: Turn, peeked: Peeked) -> Turn:
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

    async def _search(self, turn: Turn, *, skip_web: bool) -> Found:
        if skip_web:
            return Found()
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
        return Found(tuple(results), status, error)

    def _question(self, turn: Turn) -> str:
        """What the turn asks to know, for search: the message read in its conversation,
        without its device requests ("set the volume to 25 and tell me how often to floss")."""
        text = turn.reading.text
        if turn.functions:
            return self.detector.plan(text, turn.functions).question or text
        return text

    def _sources(self, turn: Turn, found: Found, device_only: bool, spoken: str) -> Sources | None:
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
        count_added(turn, (spoken,), f"\n\n{section}")
        return Sources(items=items, section=section)

    # ---- helpers ------------------------------------------------------------------------------

    def _metadata(
        self,
        turn: Turn,
        verdict: Guardrail,
        answer: Answer,
        offline_reason: str | None,
        *,
        context: Context | None = None,
        found: Found | None = None,
        stored: bool = False,
        sources: Sources | None = None,
        full_answer: str | None = None,
    ) -> TurnMetadata:
        """`full_answer`: the text as stored (with its sources section); the spoken tokens
        when not given."""
        conversation = context.conversation if context is not None else None
        found = found or Found()
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
            confirmation=confirmation_event(answer.confirmation),
        )


def _usage(turn: Turn, answer: Answer) -> TurnUsage | None:
    """The model's own counts of every call of the turn (the tokenizer's where it gave none),
    plus the tokenizer's count of every part of the content the bridge wrote, as `limited`
    and `count_added` counted it (an offline answer, a question, the sources section); an
    answer no model wrote and nothing counted (a refusal or a confirmed call, which do not go
    through `limited`) is counted here. With no model call, the prompt is the question."""
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


async def collect(events: AsyncIterator[ChatEvent]) -> list[ChatEvent]:
    """Every event of a turn, in order (for tests, the CLI and non-streaming front ends)."""
    return [event async for event in events]
