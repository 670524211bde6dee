"""Speech recognition behind one small interface (`BRIDGE_ASR_*`, docs/voice.md).

A `Recognizer` hears one whole utterance at a time: the endpointing stage hands it the audio
(16 kHz PCM16, from a little before the speech to a little after) and it answers a
`Transcript`. Every decode is independent: nothing from an earlier utterance, or another
device, changes what the next one is heard as.

- `embedded` (default): Whisper tiny.en in decoding processes of its own (English);
- `vietnamese`: the embedded Vietnamese recognizer (`viet-asr`, the `voice-vi` extra), chosen
  per device by its language setting;
- `openai`: any OpenAI-compatible `/v1/audio/transcriptions` server, with Whisper behind it.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from backend.voice.recognition.errors import RecognitionFailed, RecognizerBusy

if TYPE_CHECKING:
    from backend.config import Settings


@dataclass(frozen=True, slots=True)
class RecognitionHints:
    """What the recognizer may expect: a prompt of the words this device's users say (its
    tools, the router's command words, the dental terms) and the device's language (None:
    let the recognizer choose)."""

    prompt: str = ""
    language: str | None = None


@dataclass(frozen=True, slots=True)
class Transcript:
    """What a recognizer heard in one utterance.

    `sure` is False when the recognizer doubts its own text (a low score, or likely no speech
    at all): the assistant then asks before it changes anything on the device.
    """

    text: str
    engine: str  # e.g. "whisper-tiny.en", "viet-asr", "openai"
    language: str | None = None
    confidence: float | None = None  # the engine's own score, mapped to 0..1 where it has one
    sure: bool = True
    fallback_reason: str | None = None  # set when the configured provider failed
    alternatives: tuple[str, ...] = ()  # other readings of the same audio, best first
    # the engine's share of its probability for each reading: text's first, then each
    # alternative's (empty when the engine gives none)
    shares: tuple[float, ...] = ()


class Recognizer(Protocol):
    """A speech recognizer of whole utterances."""

    name: str

    async def start(self) -> None:
        """Load the models (at the bridge's start, not at the first utterance)."""

    async def recognize(self, pcm: bytes, hints: RecognitionHints) -> Transcript:
        """The text of one utterance of 16 kHz PCM16 ("" when nothing was understood).

        Raises:
            RecognizerBusy: too many utterances wait; this one is refused at once.
            RecognitionFailed: the engine could not answer.
        """

    def backlog_s(self) -> float:
        """About how long a new utterance would wait before it is decoded."""

    async def aclose(self) -> None:
        """Release the recognizer's resources (processes, HTTP clients)."""


def recognizer_from_settings(settings: "Settings") -> Recognizer | None:
    """The recognizer `BRIDGE_ASR_PROVIDER` names, or None for "none".

    Raises:
        VoiceUnavailable: its packages are missing (the message names them).
    """
    from backend.voice.recognition.select import build_recognizer

    return build_recognizer(settings)


__all__ = [
    "RecognitionFailed",
    "RecognitionHints",
    "Recognizer",
    "RecognizerBusy",
    "Transcript",
    "recognizer_from_settings",
]
