"""Speech recognition behind one small interface (`BRIDGE_ASR_*`).

A `Recognizer` opens one `RecognitionStream` per utterance. The voice session feeds it 16 kHz
PCM16 frames as they arrive (so recognition overlaps the user's speech) and awaits `finish()`
when the utterance ends. `Transcript.text` is "" when nothing was understood.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RecognitionHints:
    """What the recognizer may expect: command phrases (from the device's tools and the offline
    router) and a language ("en", "vi") when one is known."""

    phrases: Sequence[str] = field(default_factory=tuple)
    language: str | None = None


@dataclass(frozen=True, slots=True)
class Transcript:
    text: str
    engine: str  # which engine produced the text, e.g. "pocketsphinx-grammar", "openai"
    language: str | None = None
    fallback_reason: str | None = None  # set when the configured provider failed


class RecognitionStream(Protocol):
    def feed(self, pcm: bytes) -> None:
        """One frame of 16 kHz mono PCM16; never blocks the event loop."""

    async def finish(self) -> Transcript:
        """The utterance is over: the text (raises nothing; "" when not understood)."""

    def cancel(self) -> None:
        """Drop the utterance (an abort, a closed link)."""


class Recognizer(Protocol):
    name: str

    def open(self, hints: RecognitionHints) -> RecognitionStream: ...

    async def aclose(self) -> None: ...
