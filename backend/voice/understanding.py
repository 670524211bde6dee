"""What a transcript asks of the device, checked against the recognizer's other readings.

The recognizer's best reading alone is a poor judge of whether to act: a sentence can be read
with a low score because of one filler word, and read with a high one while its number is
wrong ("change the volume to 20, I'm" for "twenty five"). What the device would be asked to do
is the test that matters, so the beam's other readings of the same audio are read by the
offline router too (`settle`):

- the best reading asks nothing of the device but another reading does ("can you turn the sound
  out a bit" / "... down a bit"): that reading is taken, as unsure, so a change is asked back
  and a question about the device's state is answered; failing that, a reading on the
  assistant's topic is preferred to one off it ("how long does a filling last" to "... a
  feeling last");
- an unsure reading whose score is not too low is made sure when every other reading asks the
  device for the same changes (the doubt was about words that do not matter);
- a sure reading whose number is followed by words that are not fillers ("20 times") is made
  unsure: a number half heard is the likeliest wrong change.

Measured on the recognition set (bench/voice_recognition.py, `docs/benchmarks.md`).
"""

import dataclasses
import math
import re
from collections.abc import Sequence

from backend.chat.llm.base import FunctionSpec
from backend.chat.offline import Intent, IntentDetector, is_dental, with_description_choices
from backend.chat.tools import reads_only
from backend.mcp_session import Tool, ToolNameMap
from backend.mcp_session.names import llm_functions
from backend.voice.recognition import Transcript

# Below this mean token log-probability, agreement of the other readings does not make a
# reading sure (the set's unrequested changes by agreement were all below it).
AGREEMENT_FLOOR = math.exp(-0.8)
READINGS_COMPARED = 4  # the beam's other readings that must agree
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
_NUMBER = re.compile(r"\d+")
_WORD = re.compile(r"[a-z']+")


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceWords:
    """A device's functions as the offline router reads them, and which of them change it."""

    functions: tuple[FunctionSpec, ...]
    changing: frozenset[str]  # LLM names of the functions that do not only read

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
        return cls(functions, changing)


class Understanding:
    """Reads transcripts with the offline router (one detector, shared by all devices)."""

    def __init__(self) -> None:
        self._detector = IntentDetector()

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
            if transcript.language == "en" and not is_dental(transcript.text):
                for other in transcript.alternatives:
                    if is_dental(other):  # a question, on the assistant's topic
                        return dataclasses.replace(transcript, text=other)
            return transcript
        sure = transcript.sure
        if not sure and (transcript.confidence or 0.0) >= AGREEMENT_FLOOR:
            mine = self.changes(transcript.text, words)
            others = transcript.alternatives[:READINGS_COMPARED]
            sure = all(self.changes(other, words) == mine for other in others)
        if sure and not _numbers_stand_alone(transcript.text):
            sure = False
        return dataclasses.replace(transcript, sure=sure)


def _numbers_stand_alone(text: str) -> bool:
    """Whether every number is followed only by fillers ("30 please", not "20 times")."""
    for number in _NUMBER.finditer(text):
        after = _WORD.findall(text[number.end() :].lower())[:2]
        if any(word not in _AFTER_NUMBER for word in after):
            return False
    return True
