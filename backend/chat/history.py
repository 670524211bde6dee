"""The conversation's memory in a turn: the stored talk peeked at before the guardrail, the
context loaded for the model (the stored conversation's, or the client's own messages), and
the turn stored with an accumulated summary after it (docs/chat.md, "One turn", step 5)."""

import time
from collections.abc import Sequence

from backend.chat import prompts
from backend.chat.context import client_context, without_sources
from backend.chat.errors import LlmError
from backend.chat.events import Sources
from backend.chat.llm.base import DETERMINISTIC, LlmProvider, Message
from backend.chat.memory import Conversation, MemoryStore, StoredMessage
from backend.chat.model_answer import complete, with_max_tokens
from backend.chat.offline import extractive_summary
from backend.chat.text import bounded_summary
from backend.chat.turn import Context, Peeked, ToolRun, Turn, log
from backend.errors import BridgeError

# The accumulated summary kept and sent to the model: the newest part within both bounds (the
# token count is an over-estimate, text.estimated_tokens). Without a bound it grew by a piece
# every turn, 160 KB in every prompt after 400 turns.
SUMMARY_MAX_CHARS = 4000
SUMMARY_MAX_TOKENS = 1000


class History:
    """The memory stage of a turn: `history_messages` recent messages are the model's context;
    `llm` (None: no model) writes the summary's pieces, the rules when it cannot."""

    def __init__(
        self,
        memory: MemoryStore,
        llm: LlmProvider | None,
        *,
        history_messages: int,
        summary_max_chars: int,
        summary_max_tokens: int,
    ) -> None:
        self.memory = memory
        self.llm = llm
        self.history_messages = history_messages
        self.summary_max_chars = summary_max_chars
        self.summary_max_tokens = summary_max_tokens

    def bounded(self, summary: str) -> str:
        """The summary within the service's bounds (one stored before there were any may be
        longer: it is cut when it is read, too)."""
        return bounded_summary(summary, self.summary_max_chars, self.summary_max_tokens)

    async def peek(self, turn: Turn) -> Peeked:
        """The stored conversation's recent messages, read without creating one."""
        request = turn.request
        if request.context == "messages":
            return Peeked(request.conversation_id)
        try:
            conversation_id = request.conversation_id
            if conversation_id is None and request.device_id is not None:
                conversation_id = await self.memory.device_conversation_id(request.device_id)
            if conversation_id is None:
                return Peeked()
            stored = await self.memory.recent(conversation_id, self.history_messages)
        except BridgeError as exc:
            log.warning("chat memory unavailable", error=str(exc), device_id=request.device_id)
            return Peeked()
        return Peeked(conversation_id, tuple(stored))

    async def load(self, turn: Turn, peeked: Peeked | None = None) -> Context:
        """The turn's context: its conversation (created if need be) and what the model reads
        of it; `peeked`: the messages already read, when they are that conversation's."""
        request = turn.request
        if request.context == "messages":
            context = client_context(request.earlier(), self.history_messages, turn.language)
            opened = await self._open_conversation(turn) if request.store else None
            return Context(
                opened,
                tuple(context.history),
                self.bounded(context.summary),
                context.instructions,
            )
        conversation: Conversation | None = None
        try:
            # Not stored until the turn's answer is (`store`): a turn killed before leaves none.
            conversation = await self.memory.open(
                request.conversation_id, device_id=request.device_id
            )
            turn.log.conversation_id = conversation.id
            if peeked is not None and peeked.conversation_id == conversation.id:
                stored = list(peeked.messages)
            else:
                stored = await self.memory.recent(conversation.id, self.history_messages)
        except BridgeError as exc:
            log.warning("chat memory unavailable", error=str(exc), device_id=request.device_id)
            return Context(conversation)  # found but unread: the turn is still stored there
        history = tuple(history_message(message) for message in stored)
        return Context(conversation, history, self.bounded(conversation.summary))

    async def _open_conversation(self, turn: Turn) -> Conversation | None:
        """A new stored conversation for a client that sent its own history with `store`."""
        request = turn.request
        try:
            conversation = await self.memory.open(
                request.conversation_id, device_id=request.device_id
            )
        except BridgeError as exc:
            log.warning("chat memory unavailable", error=str(exc), device_id=request.device_id)
            return None
        turn.log.conversation_id = conversation.id
        return conversation

    async def store(
        self,
        turn: Turn,
        context: Context,
        answer: str,
        sources: Sources | None,
        runs: Sequence[ToolRun],
        offline_reason: str | None,
    ) -> bool:
        """Store the question and `answer` in the turn's conversation; whether it was stored."""
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
                context.conversation.id,
                turn.query,
                answer,
                metadata=metadata,
                device_id=context.conversation.device_id,
            )
        except BridgeError as exc:
            log.warning("chat memory write failed", error=str(exc), device_id=turn.log.device_id)
            return False
        turn.log.step("memory_store", began)
        return True

    async def summarize(self, turn: Turn, context: Context, answer: str, *, offline: bool) -> None:
        """Add the turn's piece to the conversation's summary (the model's, else extractive)."""
        assert context.conversation is not None
        began = time.perf_counter()
        piece = ""
        how = "extractive"
        if self.llm is not None and not offline:
            prompt = prompts.summarize_prompt(turn.language, turn.query, answer)
            sampling = with_max_tokens(DETERMINISTIC, 120)
            try:
                sent = [Message("user", prompt)]
                reply = await complete(self.llm, turn, sent, turn.request.chat_model, sampling)
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


def history_message(message: StoredMessage) -> Message:
    """A stored message as the model reads it (without its sources section)."""
    return Message(message.role, without_sources(message.content))
