"""How well offline mode does on a labelled set of requests (device commands, dental questions,
off-topic ones, in Vietnamese and English): the share routed to the right tool with the right
arguments, refused correctly, and answered. The set ships in data/offline_eval.json; the tests
assert on it and `bench/chat.py` reports it.
"""

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from backend.chat.events import Done, ToolCompleted, ToolFailed, ToolStarted
from backend.chat.llm.base import LlmProvider
from backend.chat.memory import CHAT_MIGRATIONS, SqliteMemoryStore
from backend.chat.offline import current_level
from backend.chat.request import TurnRequest
from backend.chat.service import ChatService, collect
from backend.chat.text import fold
from backend.chat.tools import DeviceToolBox, ToolSource
from backend.storage import Database


@dataclass
class OfflineOutcome:
    """What offline mode did with one labelled request, and whether that was right."""

    item: dict[str, Any]
    refused: bool
    calls: list[tuple[str, dict[str, Any]]]
    answered: bool
    correct: bool
    answer: str


@dataclass
class OfflineReport:
    """The outcomes of a run over the labelled set, with the shares per expectation."""

    outcomes: list[OfflineOutcome]

    def share(self, *expects: str) -> tuple[int, int]:
        """(correct, total) over the items expecting any of `expects`."""
        chosen = [o for o in self.outcomes if o.item["expect"] in expects]
        return sum(o.correct for o in chosen), len(chosen)

    @property
    def routed(self) -> tuple[int, int]:
        """(correct, total) of the requests that expect a tool call."""
        return self.share("tool", "tool+answer")

    @property
    def refused(self) -> tuple[int, int]:
        """(correct, total) of the requests that expect a refusal."""
        return self.share("refuse")

    @property
    def answered(self) -> tuple[int, int]:
        """(correct, total) of the questions that expect an answer."""
        return self.share("answer")

    def failures(self) -> list[OfflineOutcome]:
        """The outcomes that were wrong."""
        return [o for o in self.outcomes if not o.correct]


def load_offline_set() -> list[dict[str, Any]]:
    """The labelled requests shipped with the package (data/offline_eval.json)."""
    text = resources.files("backend.chat").joinpath("data/offline_eval.json").read_text("utf-8")
    items: list[dict[str, Any]] = json.loads(text)["items"]
    return items


async def evaluate_offline(
    new_device: Callable[[], ToolSource], items: list[dict[str, Any]] | None = None
) -> OfflineReport:
    """Run every request through a ChatService without a model (and without the web: the
    knowledge base answers), each against a fresh device from `new_device`."""
    items = items if items is not None else load_offline_set()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="chat-offline-eval-") as folder:
        db = Database(Path(folder) / "eval.sqlite3", CHAT_MIGRATIONS)
        await db.open()
        service = ChatService(SqliteMemoryStore(db), None, None)
        for index, item in enumerate(items):
            device = new_device()
            request = TurnRequest(text=item["text"], conversation_id=f"o{index}")
            events = await collect(service.run_turn(request, DeviceToolBox(device)))
            done = events[-1]
            assert isinstance(done, Done)
            meta = done.metadata
            refused = meta.guardrail.verdict == "refused"
            answered = not refused and any(
                link.startswith("https://") for link in (s.link for s in meta.sources)
            )
            calls = [(e.tool, e.arguments) for e in events if isinstance(e, ToolStarted)]
            failed = any(isinstance(e, ToolFailed) for e in events)
            ok_calls = [e for e in events if isinstance(e, ToolCompleted) and not e.is_error]
            expect = item["expect"]
            if expect == "refuse":
                correct = refused and not calls
            elif expect == "answer":
                correct = answered and not calls
            else:
                wanted = [(item["tool"], item["arguments"])]
                correct = calls == wanted and len(ok_calls) == 1 and not failed
                if expect == "tool+answer":
                    correct = correct and answered
            outcomes.append(OfflineOutcome(item, refused, calls, answered, correct, meta.answer))
        await db.close()
    return OfflineReport(outcomes)


# ---- conversations: several turns, each read in the talk before it -----------------------------


@dataclass
class TurnOutcome:
    """What the assistant did with one labelled turn of a conversation."""

    conversation: int
    index: int  # the turn's place in its conversation (0: the first)
    item: dict[str, Any]
    refused: bool
    calls: list[tuple[str, dict[str, Any]]]
    correct: bool
    answer: str


@dataclass
class ConversationReport:
    """The outcomes of a run over labelled conversations."""

    outcomes: list[TurnOutcome]

    def share(self, *expects: str, later_only: bool = False) -> tuple[int, int]:
        """(correct, total) over the turns expecting any of `expects`; `later_only`: only
        turns after a conversation's first (follow-ups)."""
        chosen = [
            o
            for o in self.outcomes
            if o.item["expect"] in expects and (o.index > 0 or not later_only)
        ]
        return sum(o.correct for o in chosen), len(chosen)

    @property
    def follow_ups(self) -> tuple[int, int]:
        """Questions after a conversation's first turn, answered on topic."""
        return self.share("answer", later_only=True)

    @property
    def refused(self) -> tuple[int, int]:
        """Off-topic turns refused."""
        return self.share("refuse")

    @property
    def commands(self) -> tuple[int, int]:
        """Device commands routed to the right tool with the right arguments."""
        return self.share("tool")

    def failures(self) -> list[TurnOutcome]:
        """The outcomes that were wrong."""
        return [o for o in self.outcomes if not o.correct]


def load_conversation_set(path: Path) -> list[dict[str, Any]]:
    """A file of labelled conversations (`{"conversations": [{"lang", "turns": [...]}]}`)."""
    conversations: list[dict[str, Any]] = json.loads(path.read_text("utf-8"))["conversations"]
    return conversations


async def evaluate_conversations(
    conversations: list[dict[str, Any]],
    new_device: Callable[[], ToolSource],
    *,
    llm: LlmProvider | None = None,
    judge: Literal["answers", "guardrail"] = "answers",
) -> ConversationReport:
    """Run each conversation's turns in order through one stored conversation (as a client
    sending `chat_id` does), against a fresh device from `new_device` per conversation.

    A turn expects `answer` (not refused, no device call, an answer holding one of its
    `about` words), `refuse`, `tool` (`tool` called with `arguments`; "up"/"down" for a
    level moved from where the device said it was; `also_answer` words in the answer),
    `state` (only a reading call, an answer holding an `about` word) or `social` (a reply,
    no refusal, no call). With `llm` the model answers and routes; the labels are then
    checked the same way. `judge="guardrail"`: a turn is right when it is refused or passed
    as labelled (for a fake model, whose answers say nothing)."""
    outcomes: list[TurnOutcome] = []
    with tempfile.TemporaryDirectory(prefix="chat-conversations-eval-") as folder:
        db = Database(Path(folder) / "eval.sqlite3", CHAT_MIGRATIONS)
        await db.open()
        service = ChatService(SqliteMemoryStore(db), llm, None)
        try:
            for number, conversation in enumerate(conversations):
                box = DeviceToolBox(new_device())
                for index, item in enumerate(conversation["turns"]):
                    before = await _levels(box)
                    request = TurnRequest(text=item["text"], conversation_id=f"conv{number}")
                    events = await collect(service.run_turn(request, box))
                    outcome = _judged(number, index, item, events, before)
                    if judge == "guardrail":
                        passed = not outcome.refused
                        outcome.correct = passed != (item["expect"] == "refuse")
                    outcomes.append(outcome)
        finally:
            await db.close()
    return ConversationReport(outcomes)


async def _levels(box: DeviceToolBox) -> dict[str, int | None]:
    status = await box.call(_STATUS, {})
    return {name: current_level(status.text, name) for name in ("volume", "brightness")}


_STATUS = "self_get_device_status"


def _judged(
    number: int,
    index: int,
    item: dict[str, Any],
    events: list[Any],
    before: dict[str, int | None],
) -> TurnOutcome:
    done = events[-1]
    assert isinstance(done, Done)
    meta = done.metadata
    refused = meta.guardrail.verdict == "refused"
    calls = [(e.tool, e.arguments) for e in events if isinstance(e, ToolStarted)]
    changes = [(tool, arguments) for tool, arguments in calls if not tool.endswith("status")]
    answer = meta.answer
    expect = item["expect"]
    if expect == "refuse":
        correct = refused and not calls
    elif expect == "answer":
        correct = not refused and not calls and _mentions(answer, item.get("about", []))
    elif expect == "state":
        correct = not refused and not changes and bool(calls)
        correct = correct and _mentions(answer, item.get("about", []))
    elif expect == "social":
        correct = not refused and not calls and bool(answer.strip())
    else:
        correct = not refused and len(changes) == 1 and _wanted(changes[0], item, before)
        correct = correct and _mentions(answer, item.get("also_answer", []))
    return TurnOutcome(number, index, item, refused, calls, correct, answer)


def _wanted(call: tuple[str, dict[str, Any]], item: dict[str, Any], before: dict[str, Any]) -> bool:
    tool, arguments = call
    if _llm_name(tool) != _llm_name(item["tool"]):  # "self.led.set" or "self_led_set"
        return False
    for name, wanted in item["arguments"].items():
        got = arguments.get(name)
        if wanted in ("up", "down"):
            start = before.get(name)
            if not isinstance(got, int) or start is None:
                return False
            if (got > start) != (wanted == "up") or got == start:
                return False
        elif got != wanted:
            return False
    return True


def _llm_name(tool: str) -> str:
    return tool.replace(".", "_")


def _mentions(answer: str, words: list[str]) -> bool:
    """Whether the answer holds one of `words` (any case, accents optional); no words: yes."""
    if not words:
        return True
    said = fold(answer)
    return any(fold(word) in said for word in words)
