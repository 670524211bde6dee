"""An OpenAI-compatible transcription server, with the embedded recognizer behind it.

`POST {base}/v1/audio/transcriptions` (multipart: the utterance as a 16 kHz mono WAV, `model`,
`language`, `response_format=json`) fits OpenAI, Groq, faster-whisper and whisper.cpp servers
and LocalAI. When the server fails or times out, the embedded recognizer hears the same
utterance; the outage is logged once, not per utterance, and never with the key.
"""

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING

import httpx
import structlog

from backend.voice.audio import UPLINK_RATE, Clip, wav_bytes
from backend.voice.recognition import RecognitionHints, Recognizer, Transcript
from backend.voice.recognition.errors import RecognitionFailed
from backend.voice.recognition.vocabulary import normalized

if TYPE_CHECKING:
    from backend.config import Settings

log = structlog.get_logger("voice.asr")


class OpenAITranscriber:
    """An OpenAI-compatible `/v1/audio/transcriptions` server (see the module docstring)."""

    name = "openai"

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "whisper-1",
        api_key: str | None = None,
        language: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.url = base_url.rstrip("/").removesuffix("/v1") + "/v1/audio/transcriptions"
        self.model = model
        self.language = language
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout_s)

    @classmethod
    def from_settings(cls, settings: "Settings") -> "OpenAITranscriber":
        """A transcriber for the `asr_*` settings."""
        key = settings.asr_api_key.get_secret_value() if settings.asr_api_key else None
        return cls(
            settings.asr_base_url,
            model=settings.asr_model,
            api_key=key,
            language=settings.asr_language,
            timeout_s=settings.asr_timeout_s,
        )

    async def start(self) -> None:
        """Nothing to load."""

    def backlog_s(self) -> float:
        """Unknown: the server queues."""
        return 0.0

    async def recognize(self, pcm: bytes, hints: RecognitionHints) -> Transcript:
        """Send one utterance; raises RecognitionFailed with a one-line reason (never the key)."""
        language = hints.language or self.language
        data = {"model": self.model, "response_format": "json"}
        if language:
            data["language"] = language
        if hints.prompt:
            data["prompt"] = hints.prompt
        files = {"file": ("utterance.wav", wav_bytes(Clip(pcm, UPLINK_RATE)), "audio/wav")}
        try:
            async with asyncio.timeout(self.timeout_s):  # the whole exchange, not per read
                response = await self._client.post(self.url, data=data, files=files)
        except TimeoutError:
            raise RecognitionFailed(f"no answer within {self.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise RecognitionFailed(f"{type(exc).__name__}: {_one_line(exc)}") from None
        if response.status_code != 200:
            raise RecognitionFailed(f"HTTP {response.status_code}")
        try:
            text = response.json()["text"]
        except (ValueError, KeyError, TypeError):
            raise RecognitionFailed("the answer is not JSON with a 'text'") from None
        if not isinstance(text, str):
            raise RecognitionFailed("the answer's 'text' is not a string")
        return Transcript(normalized(text.strip()), self.name, language)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()


def _one_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:200]


class FallbackRecognizer:
    """A remote primary with the embedded recognizer behind it (see the module docstring)."""

    def __init__(self, primary: OpenAITranscriber, embedded: Recognizer) -> None:
        self.primary = primary
        self.embedded = embedded
        self.name = f"{primary.name}+{embedded.name}"
        self._outage: str | None = None

    async def start(self) -> None:
        """Load the embedded recognizer."""
        await self.embedded.start()

    def backlog_s(self) -> float:
        """The embedded recognizer's backlog while the provider is down, else none."""
        return self.embedded.backlog_s() if self._outage is not None else 0.0

    async def recognize(self, pcm: bytes, hints: RecognitionHints) -> Transcript:
        """The provider's text, or the embedded recognizer's when the provider fails."""
        try:
            transcript = await self.primary.recognize(pcm, hints)
        except RecognitionFailed as exc:
            self._down(str(exc))
            heard = await self.embedded.recognize(pcm, hints)
            # all of the embedded transcript (its doubt, its other readings), with the reason
            return replace(heard, fallback_reason=f"{self.primary.name}: {exc}")
        if self._outage is not None:
            log.info("asr_provider_back", provider=self.primary.name)
            self._outage = None
        return transcript

    def _down(self, reason: str) -> None:
        if self._outage is None:
            log.warning(
                "asr_provider_down",
                provider=self.primary.name,
                reason=reason,
                fallback=self.embedded.name,
            )
        self._outage = reason

    async def aclose(self) -> None:
        """Close both recognizers."""
        await self.primary.aclose()
        await self.embedded.aclose()
