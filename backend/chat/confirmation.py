"""The confirmation stage of a turn: a risky call the user is asked about (the question said
and remembered), and the next turn's yes or no to it (the call run, confirmed, or dropped).

The words and the remembered questions are `confirm.py`'s; this module is the turn's side.
"""

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from backend.chat.confirm import (
    CANCELLED,
    CANCELLED_SPOKEN,
    DONE,
    FAILED,
    ConfirmationBook,
    PendingConfirmation,
    question,
    spoken_action,
)
from backend.chat.events import ChatEvent, Confirmation, Token
from backend.chat.memory import Conversation
from backend.chat.offline import IntentDetector, device_reply
from backend.chat.request import TurnRequest
from backend.chat.tool_runs import run_tool
from backend.chat.turn import Answer, Said, ToolRun, Turn, within
from backend.common import clip

_SHOWN_RESULT_CHARS = 200  # a confirmed call's result, as shown back to the user


class Confirmations:
    """Questions about risky calls, asked in one turn and answered in the next (`book`)."""

    def __init__(self, book: ConfirmationBook, detector: IntentDetector) -> None:
        self.book = book
        self.detector = detector

    def take(self, request: TurnRequest) -> PendingConfirmation | None:
        """The question this turn may be the answer to (removed from the book), if any."""
        return self.book.take(confirmation_keys(request))

    def ask(self, turn: Turn, answer: Answer) -> tuple[Answer, str]:
        """The answer with the question about its pending call after it, within the client's
        `stop` and `max_tokens`; and the question's text as said (maybe empty)."""
        pending = answer.confirmation
        assert pending is not None
        asked = ("\n\n" if answer.pieces else "") + question(
            turn.language, pending, compact(pending.arguments)
        )
        text, _cut = within(turn, answer.pieces, asked)  # the client's stop and max_tokens
        return dataclasses.replace(answer, pieces=(*answer.pieces, text)), text

    def remember(
        self, turn: Turn, pending: PendingConfirmation, conversation: Conversation | None
    ) -> None:
        """Remember the question for the next turn of this conversation (or device)."""
        self.book.remember(confirmation_keys(turn.request, conversation), pending)

    async def answer(
        self, turn: Turn, asked: PendingConfirmation, yes: bool
    ) -> AsyncIterator[ChatEvent | Answer]:
        """The turn after a risky call was asked about: run it (yes) or drop it (no)."""
        runs: tuple[ToolRun, ...] = ()
        if yes:
            run: ToolRun | None = None
            async for item in run_tool(turn, asked.llm_name, asked.arguments, confirmed=True):
                if isinstance(item, ToolRun):
                    run = item
                else:
                    yield item
            assert run is not None
            runs = (run,)
            said = said_done(turn, run, self.detector)
        else:
            action = spoken_action(asked.tool, asked.arguments)
            spoken = CANCELLED_SPOKEN[turn.language].format(action=action)
            said = Said(CANCELLED[turn.language].format(tool=asked.tool), spoken)
        text = said.text
        yield Token(text=text, speech=said.speech)
        yield Answer((text,), runs)


def said_done(turn: Turn, run: ToolRun, detector: IntentDetector) -> Said:
    """A call that ran, as the text shows it (the tool and its result, for the record) and
    as a voice says it: in words, as the offline rules would ("Volume set to 30.")."""
    template = DONE if run.ok else FAILED
    result = clip(run.outcome.text, _SHOWN_RESULT_CHARS)
    text = template[turn.language].format(tool=run.tool, result=result)
    intent = detector.called(run.llm_name, run.arguments, turn.functions)
    return Said(text, device_reply(intent, run.outcome.text, run.ok, turn.language))


def confirmation_keys(request: TurnRequest, conversation: Conversation | None = None) -> list[str]:
    """Where a question about a risky call is remembered: the conversation; the device only
    for a turn that named no conversation (so another conversation cannot answer it)."""
    conversation_id = request.conversation_id or (conversation.id if conversation else None)
    keys = [f"conversation:{conversation_id}"] if conversation_id else []
    if request.conversation_id is None and request.device_id is not None:
        keys.append(f"device:{request.device_id}")
    return keys


def confirmation_event(pending: PendingConfirmation | None) -> Confirmation | None:
    """The pending call as the turn's metadata shows it (None: nothing is asked)."""
    if pending is None:
        return None
    return Confirmation(tool=pending.tool, arguments=pending.arguments, reason=pending.reason)


def compact(arguments: dict[str, Any]) -> str:
    """A call's arguments as compact JSON, as the question shows them ("" when none)."""
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":")) if arguments else ""
