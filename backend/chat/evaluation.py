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
from typing import Any

from backend.chat.events import Done, ToolCompleted, ToolFailed, ToolStarted
from backend.chat.memory import CHAT_MIGRATIONS, SqliteMemoryStore
from backend.chat.service import ChatService, TurnRequest, collect
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
