"""The spoken recognition set, made at run time: what users of a voice device say, in several
voices, clean and under a noise floor, as a stock device sends it (Opus) and as a PCM16 client
does. Shared by tests/test_voice_recognition.py and bench/voice_recognition.py.

Nothing here is a recording: eSpeak NG speaks each text in a fresh process (its output depends
on what it spoke before in the process), the noise is seeded, Opus is the stock device's
encoder settings (16 kHz, VOIP, complexity 0). The texts were written apart from the recognizer
and its prompt: several phrasings and word orders per tool of the simulated device, absolute
and relative values, questions about the device's state, dental questions, and speech that asks
nothing of the device (chit-chat, other languages, noise).
"""

import math
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from backend.voice.audio import UPLINK_RATE, frame_samples, split_frames

Kind = Literal["command", "state", "dental", "other"]
Condition = Literal["clean", "noisy"]
Codec = Literal["opus", "pcm16"]

VOICES = ("en-us", "en-gb+m3", "en-us+f3")
CONDITIONS: tuple[Condition, ...] = ("clean", "noisy")
CODECS: tuple[Codec, ...] = ("opus", "pcm16")
NOISE_SNR_DB = 25.0  # a room's noise floor under the speech
LEAD_MS = 300  # silence (or noise) before the speech, as after a button press
TAIL_MS = 1200  # after it: longer than the bridge's silence wait


@dataclass(frozen=True, slots=True)
class Phrase:
    """One thing a user says; `voice` overrides the English voices (other languages)."""

    text: str
    kind: Kind
    voice: str | None = None


COMMANDS = [
    # volume: absolute, relative, several word orders
    "set the volume to thirty",
    "volume seventy",
    "put the volume at fifty",
    "please lower the volume to ten",
    "I want the sound at sixty",
    "change the volume to twenty five",
    "the volume to forty please",
    "turn the volume up",
    "make it quieter",
    "can you turn the sound down a bit",
    "louder please",
    "mute the speaker",
    # screen brightness
    "set the brightness to eighty",
    "screen brightness forty five",
    "brightness to one hundred",
    "dim the screen",
    "make the screen brighter",
    # theme
    "switch to dark mode",
    "use the light theme",
    "change the theme to dark",
    "go to night mode",
    # LED
    "turn on the light",
    "turn the LED off",
    "switch off the lamp",
    "turn on the LED at full brightness",
    # reboot
    "reboot the device",
    "restart the device please",
]
STATE_QUESTIONS = [
    "what is the device status",
    "what is the volume now",
    "how loud is the speaker",
    "what is the screen brightness",
    "is the light on",
    "how much battery is left",
    "what firmware are you running",
    "show me the system information",
]
DENTAL = [
    "how often should I floss",
    "why do my gums bleed when I brush",
    "what is a root canal",
    "how often should I brush my teeth",
    "what causes bad breath",
    "is teeth whitening safe",
    "what should I do if a tooth gets knocked out",
    "how long do braces take",
    "what causes cavities",
    "how do I treat sensitive teeth",
    "when should I replace my toothbrush",
    "what is gingivitis",
    "how often should I see the dentist",
    "what are dental implants",
    "how do I stop grinding my teeth at night",
    "should I get my wisdom teeth removed",
    "how long does a filling last",
    "is mouthwash good for you",
    "can children use fluoride toothpaste",
    "what foods are bad for my teeth",
    "my gums are bleeding what should I do",
    "how do I get rid of plaque",
    "why are my teeth yellow",
    "what helps with a toothache",
]
OTHER = [
    Phrase("what is the weather like tomorrow", "other"),
    Phrase("tell me a joke", "other"),
    Phrase("who won the football game last night", "other"),
    Phrase("thank you very much", "other"),
    Phrase("what time is it", "other"),
    Phrase("xin chào, hôm nay bạn thế nào", "other", voice="vi"),
    Phrase("bonjour, comment allez vous", "other", voice="fr"),
    Phrase("", "other"),  # noise only: nothing said
]


def phrases() -> list[Phrase]:
    """The whole set, in a fixed order."""
    return [
        *(Phrase(text, "command") for text in COMMANDS),
        *(Phrase(text, "state") for text in STATE_QUESTIONS),
        *(Phrase(text, "dental") for text in DENTAL),
        *OTHER,
    ]


@dataclass(frozen=True, slots=True)
class Case:
    """One phrase in one voice, condition and codec."""

    phrase: Phrase
    voice: str
    condition: Condition
    codec: Codec

    @property
    def name(self) -> str:
        """A short id for reports: "set the volume to thirty / en-us / noisy / opus"."""
        said = self.phrase.text or "(noise)"
        return f"{said} / {self.voice} / {self.condition} / {self.codec}"


def rotated_cases() -> list[Case]:
    """Each phrase once, the voices, conditions and codecs taken in turn, so that every
    combination occurs (the tests' set)."""
    combos = [(v, n, c) for v in VOICES for n in CONDITIONS for c in CODECS]
    return [
        Case(phrase, phrase.voice or voice, condition, codec)
        for phrase, (voice, condition, codec) in zip(phrases(), _cycle(combos, 7), strict=False)
    ]


def all_cases() -> list[Case]:
    """Every phrase in every voice, condition and codec (the benchmark's set)."""
    cases = []
    for voice in VOICES:
        for condition in CONDITIONS:
            for codec in CODECS:
                for phrase in phrases():
                    if phrase.voice is None or voice == VOICES[0]:
                        cases.append(Case(phrase, phrase.voice or voice, condition, codec))
    return cases


def _cycle(
    items: list[tuple[str, Condition, Codec]], step: int
) -> Iterator[tuple[str, Condition, Codec]]:
    """The items in a stride that visits all of them before repeating (len is 12, step 7)."""
    index = 0
    while True:
        yield items[index % len(items)]
        index += step


# ---- audio ---------------------------------------------------------------------------------------


def render_cases(cases: list[Case]) -> list[bytes]:
    """16 kHz PCM16 of each case as a device's microphone hears it: lead, speech, tail, and
    noise under all of it when noisy (a device then sends it in its codec)."""
    from testkit.asr_helpers import render_fresh

    unique = sorted({(c.phrase.text, c.voice) for c in cases if c.phrase.text})
    speech = dict(zip(unique, render_fresh(list(unique)), strict=True))
    return [_heard(case, speech.get((case.phrase.text, case.voice), b"")) for case in cases]


def device_path(case: Case, pcm: bytes) -> bytes:
    """What the bridge decodes from the case's codec: Opus and back, or PCM16 as it is."""
    return opus_round_trip(pcm) if case.codec == "opus" else pcm


def _heard(case: Case, speech: bytes) -> bytes:
    lead = bytes(LEAD_MS * UPLINK_RATE // 1000 * 2)
    tail = bytes(TAIL_MS * UPLINK_RATE // 1000 * 2)
    pcm = lead + (speech or bytes(UPLINK_RATE * 2)) + tail
    if case.condition == "noisy" or not speech:
        pcm = _with_noise(pcm, speech, seed=zlib.crc32(case.name.encode()))
    return pcm


def _with_noise(pcm: bytes, speech: bytes, seed: int) -> bytes:
    """Gaussian noise NOISE_SNR_DB under the speech's level (a fixed low floor with no speech)."""
    import numpy as np

    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    voiced = np.frombuffer(speech, dtype="<i2").astype(np.float64) if speech else np.zeros(1)
    loud = voiced[np.abs(voiced) > 300]
    level = math.sqrt(float(np.mean(loud**2))) if loud.size else 3000.0
    noise = np.random.default_rng(seed).normal(0, level / 10 ** (NOISE_SNR_DB / 20), len(samples))
    return np.clip(samples + noise, -32768, 32767).astype("<i2").tobytes()


def opus_round_trip(pcm: bytes) -> bytes:
    """16 kHz PCM16 through the stock device's Opus encoder (VOIP, complexity 0) and back."""
    import opuslib_next

    encoder = opuslib_next.Encoder(UPLINK_RATE, 1, opuslib_next.APPLICATION_VOIP)
    encoder.complexity = 0
    decoder = opuslib_next.Decoder(UPLINK_RATE, 1)
    samples = frame_samples(UPLINK_RATE)
    return b"".join(
        decoder.decode(encoder.encode(frame, samples), samples)
        for frame in split_frames(pcm, UPLINK_RATE)
    )


def shuffled(cases: list[Case], seed: int) -> list[Case]:
    """The cases in another order (for order independence)."""
    order = list(cases)
    random.Random(seed).shuffle(order)
    return order
