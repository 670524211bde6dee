"""The rules' answer (offline mode, `offline.py`'s rules at work in a turn): the device calls
the request asks for and an extractive answer to its question, when no model answers; and the
answers the rules give whatever model there is (`rules_answer`)."""

import time
from collections.abc import AsyncIterator, Sequence

from backend.chat import prompts
from backend.chat.confirm import PendingConfirmation
from backend.chat.confirmation import said_done
from backend.chat.device_state import no_reading_tool_reply
from backend.chat.events import ChatEvent, Token
from backend.chat.offline import (
    OFFLINE_NOTE,
    Intent,
    IntentDetector,
    current_level,
    device_reply,
    extractive_answer,
    rejected_reply,
    stepped,
    unserved_reply,
)
from backend.chat.tool_runs import run_tool
from backend.chat.turn import Answer, Found, Said, ToolRun, Turn, Verdict, limited

_NO_PERMISSION = {
    "vi": "Tôi không có quyền điều khiển thiết bị này ({reason}).",
    "en": "I'm not allowed to control this device ({reason}).",
}


class OfflineAnswer:
    """The offline stage of a turn: `detector`'s plan of the request, carried out."""

    def __init__(self, detector: IntentDetector) -> None:
        self.detector = detector

    async def answer(
        self,
        turn: Turn,
        found: Found,
        device_only: bool,
        before: Answer,
    ) -> AsyncIterator[ChatEvent | Answer]:
        """The rules' answer: device calls the request asks for, an extractive answer to its
        question. `before`: what the model said and did before it failed."""
        began = time.perf_counter()
        plan = self.detector.plan(turn.reading.text, turn.functions)
        # Tools the model ran before it failed: the user hears what they did, in words.
        parts = [said_done(turn, run, self.detector) for run in before.runs]
        runs: list[ToolRun] = []
        confirmation: PendingConfirmation | None = None
        done_already = {run.tool for run in before.runs}
        unavailable = turn.toolbox.unavailable_reason
        if unavailable is not None and plan.intents:  # the turn reported it (denied_event)
            parts.append(Said(_NO_PERMISSION[turn.language].format(reason=unavailable)))
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
                        parts.append(Said(rejected_reply(intent, turn.language)))
                        continue
                    intent = moved
                async for item in run_tool(turn, intent.llm_name, intent.arguments):
                    if not isinstance(item, ToolRun):
                        yield item
                    elif item.needs_confirmation:
                        confirmation = item.pending(turn.request.device_id)
                    else:
                        runs.append(item)
                        said = device_reply(intent, item.outcome.text, item.ok, turn.language)
                        parts.append(Said(said))
                if confirmation is not None:
                    break
        if plan.unanswered:
            parts.append(Said(no_reading_tool_reply(turn.language)))
        if not plan.intents and plan.rejected and (not plan.question or device_only):
            parts.append(Said(rejected_reply(plan.rejected[0], turn.language)))
        if not plan.intents and not plan.rejected and plan.unserved:
            parts.append(Said(unserved_reply(turn.language)))
        question_text = plan.question if turn.functions else turn.reading.text
        if question_text and not device_only:
            answer = extractive_answer(
                question_text, found.results, turn.language, stress=turn.reading.own
            )
            # The note is for screens: a voice reads the answer, not a disclaimer before it.
            parts.append(Said(f"{OFFLINE_NOTE[turn.language]}\n{answer}", answer))
        elif question_text and not plan.intents and not plan.rejected:
            parts.append(Said(extractive_answer(question_text, found.results, turn.language)))
        text, cut = limited(turn, before.pieces, "\n\n".join(part.text for part in parts))
        if text:
            yield Token(text=text, speech=speech(parts, text))
        turn.log.step(
            "offline",
            began,
            reason=turn.log.offline_reason,
            calls=len(plan.intents),
            question=bool(question_text),
        )
        yield Answer(
            (text,) if text else (),
            tuple(runs),
            confirmation,
            finish_reason="length" if cut else "stop",
        )

    async def _level_now(
        self, turn: Turn, intent: Intent
    ) -> AsyncIterator[ChatEvent | ToolRun | int | None]:
        """For a step up or down ("turn it up"): the device's status call, if it has a status
        tool, then the level it reports (None: unknown)."""
        status = self.detector.status_function(turn.functions)
        if intent.step is None or status is None:
            yield None
            return
        async for item in run_tool(turn, status.llm_name, {}):
            yield item
            if isinstance(item, ToolRun):
                yield current_level(item.outcome.text, intent.step.argument)


def rules_answer(turn: Turn, verdict: Verdict, *, has_model: bool) -> Said | None:
    """An answer the rules give whatever model there is: a device request with no device
    chosen ("which device?"); a greeting or thanks when no model answers (`has_model`: one is
    configured)."""
    if verdict.guardrail.reason == "device request, no device":
        return Said(prompts.which_device(turn.language, turn.request.device_choices))
    social = turn.reading.social
    if social is not None and (not has_model or turn.log.offline_reason is not None):
        return Said(prompts.social_reply(social, turn.language, bool(turn.functions)))
    return None


def speech(parts: Sequence[Said], text: str, separator: str = "\n\n") -> str | None:
    """What a voice says for `text` (the parts joined by `separator`, maybe cut by `limited`):
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
