"""Shared pieces of the speech-recognition tests: the device path (Opus 16 kHz VOIP at the stock
device's complexity 0, then decoded) and the routing judge (does the offline router do with the
recognized text what it does with the text that was spoken?)."""

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from backend.chat.llm import FunctionSpec
from backend.chat.offline import IntentDetector, is_dental, with_description_choices
from backend.chat.search import KnowledgeBase
from backend.chat.tools import DeviceToolBox
from backend.voice.recognition.vocabulary import spoken_numbers_to_digits
from backend.voice.audio import UPLINK_RATE, frame_samples, split_frames
from simulator.in_process import FirmwareDevice

# Two English voices of eSpeak NG (different accent and speaker variant).
VOICES = ("en-us", "en-gb+m3")
_ROOT = Path(__file__).resolve().parent.parent
# eSpeak's output for a text depends on everything it synthesized before in the process (its
# pitch flutter runs on across utterances; neither a seed nor re-initializing resets it), so a
# set rendered after other tests' speech differed from run to run ("thirty" heard as "13" in
# one run of three). Rendered in a fresh process, in a fixed order, it is the same every time.
_RENDER_ALL = """
import json, sys
from backend.voice.tts import render
for text, voice in json.loads(sys.stdin.read()):
    pcm = render(text, voice=voice).pcm
    sys.stdout.buffer.write(len(pcm).to_bytes(4, "big") + pcm)
"""


def render_fresh(items: list[tuple[str, str | None]]) -> list[bytes]:
    """16 kHz PCM16 of each (text, eSpeak voice), rendered in a new process in this order:
    the same bytes on every run, whatever this process synthesized before."""
    done = subprocess.run(
        [sys.executable, "-c", _RENDER_ALL],
        input=json.dumps(items).encode(),
        capture_output=True,
        cwd=_ROOT,
        timeout=120,
        check=True,
    )
    out, clips = done.stdout, []
    while out:
        size = int.from_bytes(out[:4], "big")
        clips.append(out[4 : 4 + size])
        out = out[4 + size :]
    assert len(clips) == len(items), done.stderr[-2000:]
    return clips


def device_path_frames(pcm: bytes) -> list[bytes]:
    """60 ms frames as the bridge gets them from a stock device: Opus VOIP, complexity 0."""
    import opuslib_next

    encoder = opuslib_next.Encoder(UPLINK_RATE, 1, opuslib_next.APPLICATION_VOIP)
    encoder.complexity = 0
    decoder = opuslib_next.Decoder(UPLINK_RATE, 1)
    samples = frame_samples(UPLINK_RATE)
    return [
        decoder.decode(encoder.encode(frame, samples), samples)
        for frame in split_frames(pcm, UPLINK_RATE)
    ]


def device_functions() -> list[FunctionSpec]:
    return [with_description_choices(s) for s in DeviceToolBox(FirmwareDevice()).functions()]


def words(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9']+", text.lower()))


@dataclass(frozen=True)
class Utterance:
    text: str
    category: str  # "command" or "dental"


class RoutingJudge:
    def __init__(self) -> None:
        self.functions = device_functions()
        self.detector = IntentDetector()
        self.kb = KnowledgeBase.bundled()

    def _calls(self, text: str) -> list[tuple[str, dict[str, object]]]:
        plan = self.detector.plan(text, self.functions)
        return [(intent.llm_name, intent.arguments) for intent in plan.intents]

    def _topic(self, text: str) -> str | None:
        results = self.kb.search(text, 1, language="en")
        return results[0].title if results else None

    def routed_right(self, spoken: Utterance, heard: str) -> bool:
        """A command: the exact phrase, or the same tool calls with the same arguments. A dental
        question: dental to the guardrail and the same top knowledge-base entry."""
        if words(heard) == words(spoken_numbers_to_digits(spoken.text.lower())):
            return True
        if spoken.category == "command":
            wanted = self._calls(spoken_numbers_to_digits(spoken.text.lower()))
            return bool(wanted) and self._calls(heard) == wanted
        return is_dental(heard) and self._topic(heard) == self._topic(spoken.text)
