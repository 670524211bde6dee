"""The guardrail stage: whether a turn is answered at all, before anything is stored
(docs/chat.md, "One turn", step 4). The rules decide what they can (social turns, clear dental
questions, device requests, external tools); the guardrail model judges the rest, and without
one an unclear question is answered when it has a dental word and refused otherwise."""

from backend.chat import prompts
from backend.chat.errors import LlmError
from backend.chat.events import Guardrail
from backend.chat.llm.base import DETERMINISTIC, LlmProvider, Message
from backend.chat.model_answer import complete, with_max_tokens
from backend.chat.offline import IntentDetector, asks_a_device, dental_words, serving_function
from backend.chat.turn import Turn, Verdict, went_offline


class GuardrailStage:
    """The guardrail of a turn: the rules, then `llm` (None: no model to ask)."""

    def __init__(self, llm: LlmProvider | None, detector: IntentDetector) -> None:
        self.llm = llm
        self.detector = detector

    async def judge(self, turn: Turn) -> Verdict:
        """The turn's verdict; `offline_reason` set when the guardrail model failed."""
        text = turn.reading.text
        if turn.reading.social is not None:
            return Verdict(Guardrail(verdict="passed", reason="social", by="rules"), False)
        dental = dental_words(text)
        if dental == "clear" and (turn.reading.sure or self.llm is None):
            reason = "follow-up" if turn.reading.follows else "dental question"
            return Verdict(Guardrail(verdict="passed", reason=reason, by="rules"), True)
        if turn.functions and self.detector.is_device_request(text, turn.functions):
            # The device request passed; an ambiguous dental word beside it is taken as meant.
            passed = Guardrail(verdict="passed", reason="device request", by="rules")
            return Verdict(passed, bool(dental))
        if not turn.functions and not dental and asks_a_device(text):
            passed = Guardrail(verdict="passed", reason="device request, no device", by="rules")
            return Verdict(passed, False)
        external = serving_function(text, turn.toolbox.external_functions())
        if external is not None and not dental:
            # A tool of an external or dialed-in server serves it: the model may call it.
            passed = Guardrail(verdict="passed", reason="external tool", by="rules")
            return Verdict(passed, False)
        failure: str | None = None
        if self.llm is not None:
            names = [f"{spec.llm_name}: {spec.description}" for spec in turn.functions]
            prompt = prompts.guardrail_prompt(turn.language, turn.query, names, turn.earlier)
            sent = [Message("user", prompt)]
            sampling = with_max_tokens(DETERMINISTIC, 3)
            try:
                model = turn.request.guardrail_model or self.llm.models.guardrail
                reply = await complete(self.llm, turn, sent, model, sampling)
            except LlmError as exc:
                failure = went_offline(turn, exc)
            else:
                return model_verdict(reply.text)
        if dental is not None and not turn.reading.sure:  # a follow-up the model could not judge
            passed = Guardrail(verdict="passed", reason="follow-up (unchecked)", by="rules")
            return Verdict(passed, True, failure)
        if dental == "ambiguous":  # no model to judge "brush", "gum"...: answer rather than refuse
            passed = Guardrail(verdict="passed", reason="dental word (unchecked)", by="rules")
            return Verdict(passed, True, failure)
        refused = Guardrail(verdict="refused", reason="no dental or device words", by="rules")
        return Verdict(refused, False, failure)


def model_verdict(reply: str) -> Verdict:
    """The guardrail model's reply as a verdict: a NO refuses, a YES passes, else refused."""
    word = reply.strip().upper()
    if "NO" in word:  # rejection first, as in the seed design
        return Verdict(Guardrail(verdict="refused", reason="not dental", by="llm"), False)
    if "YES" in word:
        return Verdict(Guardrail(verdict="passed", reason="dental (model)", by="llm"), True)
    unclear = Guardrail(verdict="refused", reason="unclear guardrail reply", by="llm")
    return Verdict(unclear, False)
