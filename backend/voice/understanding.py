"""What a transcript asks of the device, checked against the recognizer's other readings.

The recognizer's best reading alone is a poor judge of whether to act: a sentence can be read
with a low score because of one filler word, and read with a high one while its number is
wrong ("change the volume to 20, I'm" for "twenty five"). What the device would be asked to do
is the test that matters, so the beam's other readings of the same audio are read by the
offline router too (`settle`):

- the best reading asks nothing of the device but another reading does ("can you turn the sound
  out a bit" / "... down a bit"): that reading is taken, as unsure, so a change is asked back
  and a question about the device's state is answered; failing that, the reading the knowledge
  base knows best is answered ("how long does a filling last" over "... a feeling last");
- an unsure reading whose score is not too low is made sure when the readings that ask the
  device for the same changes hold most of the beam's probability (the doubt was about words
  that do not matter: "louder please" / "louder, please" / "lager please");
- a reading whose text shows a mishearing is unsure however high its score: a number followed
  by words that are not fillers ("20 times") or after an article ("for the 5"), a decoder that
  went round in circles, two choices of one setting ("dark and light mode").

Measured on the recognition set (bench/voice_recognition.py, `docs/benchmarks.md`).
"""

import dataclasses
import math
import re
from collections.abc import Sequence

from backend.chat.knowledge import KnowledgeBase
from backend.chat.llm.base import FunctionSpec
from backend.chat.offline import Intent, IntentDetector, is_dental, with_description_choices
from backend.chat.tools import reads_only
from backend.mcp_session import Tool, ToolNameMap
from backend.mcp_session.names import llm_functions
from backend.voice.recognition import Transcript
from backend.voice.recognition.embedded import looped
from backend.voice.recognition.vocabulary import choices_of

# Below this mean token log-probability, agreement of the other readings does not make a
# reading sure (the set's unrequested changes by agreement were all below it).
AGREEMENT_FLOOR = math.exp(-0.8)
READINGS_COMPARED = 4  # without shares: the beam's other readings that must agree
AGREEMENT_SHARE = 0.85  # the share of the beam's probability that must ask the same changes
# Words that may follow a spoken value without doubt on it ("30 percent please").
_AFTER_NUMBER = frozenset(
    [
        "please",
        "percent",
        "now",
        "thanks",
        "thank",
        "you",
        "for",
        "me",
        "again",
        "ok",
        "okay",
        "then",
    ]
)
_ARTICLES = frozenset(["the", "a", "an"])  # a value is never "the 5": a number half heard
_NUMBER = re.compile(r"\d+")
_WORD = re.compile(r"[a-z']+")


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceWords:
    """A device's functions as the offline router reads them, and which of them change it."""

    functions: tuple[FunctionSpec, ...]
    changing: frozenset[str]  # LLM names of the functions that do not only read
    choices: tuple[frozenset[str], ...] = ()  # each string setting's choices ("light", "dark")

    @classmethod
    def of(cls, tools: Sequence[Tool]) -> "DeviceWords":
        """The words of a device with these (model-visible) tools."""
        names = ToolNameMap(tool.name for tool in tools)
        functions = tuple(
            with_description_choices(FunctionSpec(f["name"], f["description"], f["parameters"]))
            for f in llm_functions(tools, names)
        )
        changing = frozenset(
            names.to_llm(tool.name) for tool in tools if not reads_only(tool.name, tool.annotations)
        )
        choices = []
        for function in functions:
            for prop in function.parameters.get("properties", {}).values():
                if isinstance(prop, dict) and prop.get("type") == "string":
                    found = frozenset(choices_of(prop, function.description))
                    if len(found) > 1:
                        choices.append(found)
        return cls(functions, changing, tuple(choices))


class Understanding:
    """Reads transcripts with the offline router (one detector, shared by all devices)."""

    def __init__(self) -> None:
        self._detector = IntentDetector()
        self._kb = KnowledgeBase.bundled()

    def intents(self, text: str, words: DeviceWords) -> list[Intent]:
        """The device calls the router finds in the text."""
        return self._detector.plan(text, list(words.functions)).intents

    def changes(self, text: str, words: DeviceWords) -> set[tuple[str, str, int | None]]:
        """The calls that would change the device, comparable between readings."""
        return {
            (i.llm_name, repr(sorted(i.arguments.items())), i.step.delta if i.step else None)
            for i in self.intents(text, words)
            if i.llm_name in words.changing
        }

    def settle(self, transcript: Transcript, words: DeviceWords) -> Transcript:
        """The reading to answer and whether to act on it unasked (see the module docstring).
        A transcript without other readings (viet-asr, a transcription server) is left as is."""
        if not transcript.alternatives or not transcript.text:
            return transcript
        if not self.intents(transcript.text, words):
            for other in transcript.alternatives:
                if self.intents(other, words):
                    return dataclasses.replace(transcript, text=other, sure=False)
            if transcript.language == "en":
                return dataclasses.replace(transcript, text=self._on_topic(transcript))
            return transcript
        sure = transcript.sure
        if not sure and (transcript.confidence or 0.0) >= AGREEMENT_FLOOR:
            sure = self.agreement(transcript, words) >= AGREEMENT_SHARE
        if sure and _doubtful(transcript.text, words):
            sure = False
        return dataclasses.replace(transcript, sure=sure)

    def _on_topic(self, transcript: Transcript) -> str:
        """The reading the assistant knows best: on its topic, then the closest to a
        knowledge-base entry ("how long does a filling last" over "... a feeling last");
        the best reading when none is closer."""

        def fit(reading: str) -> tuple[bool, float]:
            return is_dental(reading), max(self._kb.relevance(reading), default=0.0)

        return max((transcript.text, *transcript.alternatives), key=fit)

    def agreement(self, transcript: Transcript, words: DeviceWords) -> float:
        """The share of the engine's readings that ask the device for the same changes as
        the best one (without shares: 1 when the first few other readings all do, else 0)."""
        mine = self.changes(transcript.text, words)
        if not transcript.shares:
            others = transcript.alternatives[:READINGS_COMPARED]
            return float(all(self.changes(other, words) == mine for other in others))
        readings = (transcript.text, *transcript.alternatives)
        same = sum(
            share
            for reading, share in zip(readings, transcript.shares, strict=False)
            if self.changes(reading, words) == mine
        )
        return same / (sum(transcript.shares) or 1.0)


def _doubtful(text: str, words: DeviceWords) -> bool:
    """Whether the text itself shows a mishearing, whatever the scores say: a number half
    heard ("20 times", "for the 5"), a decoder that went round in circles, or two choices of
    one setting ("dark and light mode")."""
    if not _numbers_stand_alone(text) or looped(text):
        return True
    said = set(_WORD.findall(text.lower()))
    return any(len(said & choices) > 1 for choices in words.choices)


def _numbers_stand_alone(text: str) -> bool:
    """Whether every number is followed only by fillers ("30 please", not "20 times") and
    comes after no article."""
    for number in _NUMBER.finditer(text):
        after = _WORD.findall(text[number.end() :].lower())[:2]
        before = _WORD.findall(text[: number.start()].lower())[-1:]
        if any(word not in _AFTER_NUMBER for word in after) or set(before) & _ARTICLES:
            return False
    return True
