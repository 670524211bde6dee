"""Which recognizer hears a device: built from the settings, chosen per utterance by language."""

import importlib.util
import os
from typing import TYPE_CHECKING

import structlog

from backend.voice.errors import VoiceUnavailable
from backend.voice.recognition import RecognitionHints, Recognizer, Transcript

if TYPE_CHECKING:
    from backend.config import Settings

log = structlog.get_logger("voice.asr")


class ByLanguage:
    """English to Whisper, Vietnamese to the Vietnamese recognizer when it is installed (else
    to Whisper too, which then hears English only). `hints.language` says which."""

    def __init__(self, english: Recognizer, vietnamese: Recognizer | None = None) -> None:
        self.english = english
        self.vietnamese = vietnamese
        self.name = english.name + (f"+{vietnamese.name}" if vietnamese is not None else "")

    def languages(self) -> tuple[str, ...]:
        """The languages heard."""
        return ("en", "vi") if self.vietnamese is not None else ("en",)

    def _for(self, language: str | None) -> Recognizer:
        if language == "vi" and self.vietnamese is not None:
            return self.vietnamese
        return self.english

    async def start(self) -> None:
        """Load every recognizer."""
        await self.english.start()
        if self.vietnamese is not None:
            await self.vietnamese.start()

    def backlog_s(self) -> float:
        """The English recognizer's backlog (the busiest by far)."""
        return self.english.backlog_s()

    async def recognize(self, pcm: bytes, hints: RecognitionHints) -> Transcript:
        """The utterance, heard by the recognizer of its language."""
        return await self._for(hints.language).recognize(pcm, hints)

    async def aclose(self) -> None:
        """Close every recognizer."""
        await self.english.aclose()
        if self.vietnamese is not None:
            await self.vietnamese.aclose()


def vietnamese_installed() -> bool:
    """Whether the Vietnamese recognizer's package (the `voice-vi` extra) is installed."""
    return importlib.util.find_spec("vietasr") is not None


def decoding_threads(configured: int | None) -> int:
    """`asr_threads`, or half the machine's cores (at least 1, at most 4)."""
    if configured is not None:
        return configured
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def _embedded(settings: "Settings") -> Recognizer:
    from backend.voice.recognition.embedded import WhisperRecognizer

    english = WhisperRecognizer(
        workers=settings.asr_workers,
        threads=decoding_threads(settings.asr_threads),
        queue_max=settings.asr_queue_max,
    )
    vietnamese: Recognizer | None = None
    if settings.asr_vietnamese and vietnamese_installed():
        from backend.voice.recognition.vietnamese import VietnameseRecognizer

        preload = settings.asr_language == "vi"
        vietnamese = VietnameseRecognizer(queue_max=settings.asr_queue_max, preload=preload)
    return ByLanguage(english, vietnamese)


def build_recognizer(settings: "Settings") -> Recognizer | None:
    """The recognizer `asr_provider` names (see `recognizer_from_settings`)."""
    from backend.voice.recognition.remote import FallbackRecognizer, OpenAITranscriber

    if settings.asr_provider == "none":
        return None
    if settings.asr_provider == "embedded":
        return _embedded(settings)
    remote = OpenAITranscriber.from_settings(settings)
    try:
        return FallbackRecognizer(remote, _embedded(settings))
    except VoiceUnavailable as exc:
        log.warning("asr_no_fallback", provider=remote.name, reason=str(exc))
        return remote
