"""Speech recognition behind one small interface (`BRIDGE_ASR_*`).

A `Recognizer` opens one `RecognitionStream` per utterance. The voice session feeds it 16 kHz
PCM16 frames as they arrive (so recognition overlaps the user's speech) and awaits `finish()`
when the utterance ends. `Transcript.text` is "" when nothing was understood.
"""

import asyncio
import hashlib
import itertools
import multiprocessing
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import structlog

from backend.errors import BridgeError
from backend.voice.asr_phrases import command_phrases, spoken_numbers_to_digits
from backend.voice.audio import UPLINK_RATE, Clip, wav_bytes
from backend.voice.errors import VoiceUnavailable

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from backend.config import Settings


@dataclass(frozen=True, slots=True)
class RecognitionHints:
    """What the recognizer may expect: command phrases (from the device's tools and the offline
    router) and a language ("en", "vi") when one is known."""

    phrases: Sequence[str] = field(default_factory=tuple)
    language: str | None = None


@dataclass(frozen=True, slots=True)
class Transcript:
    """What a recognizer heard in one utterance, and which engine heard it."""

    text: str
    engine: str  # which engine produced the text, e.g. "pocketsphinx-grammar", "openai"
    language: str | None = None
    fallback_reason: str | None = None  # set when the configured provider failed


class RecognitionStream(Protocol):
    """One utterance being recognized as its audio arrives."""

    def feed(self, pcm: bytes) -> None:
        """One frame of 16 kHz mono PCM16; never blocks the event loop."""

    async def finish(self) -> Transcript:
        """The utterance is over: the text (raises nothing; "" when not understood)."""

    def cancel(self) -> None:
        """Drop the utterance (an abort, a closed link)."""


class Recognizer(Protocol):
    """A speech recognizer: opens one stream per utterance."""

    name: str

    def open(self, hints: RecognitionHints) -> RecognitionStream:
        """Start recognizing one utterance, with its phrase hints and language."""

    async def aclose(self) -> None:
        """Release the recognizer's resources (worker process, HTTP client)."""


# ---- shared --------------------------------------------------------------------------------------

log = structlog.get_logger("voice.asr")

DEFAULT_MAX_UTTERANCE_S = 20.0
_BYTES_PER_S = UPLINK_RATE * 2


class RecognitionFailed(BridgeError):
    """A recognizer could not give a transcript (unreachable, timed out, bad answer)."""


def _max_bytes(max_utterance_s: float) -> int:
    return int(max_utterance_s * _BYTES_PER_S)


# ---- pocketsphinx (embedded, in a worker process) ------------------------------------------------


class _SphinxWorker:
    """The parent's handle on the worker process (backend/voice/asr_worker.py).

    `send` never blocks: commands go through a queue to a sender thread (a pipe write can block
    when the worker falls behind). A reader thread hands results to the streams' futures.
    """

    def __init__(self, lm_decoders: int) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process running threads
        parent, child = context.Pipe()
        from backend.voice import asr_worker

        self._process: BaseProcess = context.Process(
            target=asr_worker.main,
            args=(child, lm_decoders),
            name="asr-pocketsphinx",
            daemon=True,
        )
        self._process.start()
        child.close()
        self._conn: Connection = parent
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._futures: dict[int, Future[tuple[str, str, dict[str, Any]]]] = {}
        self._pongs: dict[int, Future[tuple[int, tuple[int, int]]]] = {}
        self._lock = threading.Lock()
        self._grammars: set[str] = set()
        self._ids = itertools.count(1)
        self.alive = True
        self._sender = threading.Thread(target=self._send_loop, name="asr-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="asr-read", daemon=True)
        self._sender.start()
        self._reader.start()

    def send(self, *command: Any) -> None:
        self._outbox.put(command)

    def grammar_key(self, phrases: tuple[str, ...]) -> str:
        key = "g" + hashlib.sha1("\n".join(phrases).encode()).hexdigest()[:16]
        if key not in self._grammars:
            self._grammars.add(key)
            self.send("grammar", key, list(phrases))
        return key

    def open(self, key: str | None) -> tuple[int, "Future[tuple[str, str, dict[str, Any]]]"]:
        sid = next(self._ids)
        future: Future[tuple[str, str, dict[str, Any]]] = Future()
        with self._lock:
            self._futures[sid] = future
        if not self.alive:
            future.set_exception(RecognitionFailed("the pocketsphinx worker has stopped"))
        self.send("open", sid, key)
        return sid, future

    def forget(self, sid: int) -> None:
        with self._lock:
            self._futures.pop(sid, None)

    async def ping(self) -> tuple[int, tuple[int, int]]:
        """(streams open in the worker, (LM decoders, grammar decoders) loaded)."""
        token = next(self._ids)
        future: Future[tuple[int, tuple[int, int]]] = Future()
        self._pongs[token] = future
        self.send("ping", token)
        return await asyncio.wrap_future(future)

    def _send_loop(self) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                self._conn.send(command)
            except (OSError, ValueError):
                return

    def _read_loop(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "pong":
                pong = self._pongs.pop(message[1], None)
                if pong is not None:
                    pong.set_result((message[2], message[3]))
                continue
            with self._lock:
                future = self._futures.pop(message[1], None)
            if future is None or future.done():
                continue
            if message[0] == "result":
                future.set_result((message[2], message[3], message[4]))
            else:
                future.set_exception(RecognitionFailed(message[2]))
        self._fail_all("the pocketsphinx worker has stopped")

    def _fail_all(self, reason: str) -> None:
        self.alive = False
        with self._lock:
            futures = list(self._futures.values())
            self._futures.clear()
        for future in futures:
            if not future.done():
                future.set_exception(RecognitionFailed(reason))

    def close(self) -> None:
        self.send("stop")
        self._outbox.put(None)
        self._sender.join(timeout=5)
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)
        self._conn.close()
        self._reader.join(timeout=5)


class _SphinxStream:
    def __init__(
        self, worker: _SphinxWorker, key: str | None, max_bytes: int, language: str | None
    ) -> None:
        self._worker = worker
        self._sid, self._result = worker.open(key)
        self._left = max_bytes
        self._language = language
        self._closed = False

    def feed(self, pcm: bytes) -> None:
        if self._closed or self._left <= 0:
            return  # past the bound: the utterance is cut here
        pcm = pcm[: self._left]
        self._left -= len(pcm)
        self._worker.send("feed", self._sid, pcm)

    async def finish(self) -> Transcript:
        if self._closed:
            return Transcript("", "pocketsphinx", fallback_reason="cancelled")
        self._closed = True
        began = time.perf_counter()
        self._worker.send("finish", self._sid)
        try:
            text, engine, detail = await asyncio.wrap_future(self._result)
        except RecognitionFailed as exc:
            log.warning("asr_failed", engine="pocketsphinx", reason=str(exc))
            return Transcript("", "pocketsphinx", fallback_reason=str(exc))
        except asyncio.CancelledError:
            self.cancel()
            raise
        text = spoken_numbers_to_digits(text)
        log.debug(
            "asr_final",
            engine=engine,
            text=text,
            finish_ms=round((time.perf_counter() - began) * 1000, 1),
            **detail,
        )
        return Transcript(text, engine, language="en")

    def cancel(self) -> None:
        if self._closed and self._result.done():
            return
        self._closed = True
        self._worker.forget(self._sid)
        self._result.cancel()
        self._worker.send("cancel", self._sid)


class PocketsphinxRecognizer:
    """The embedded recognizer (English): a JSGF grammar of the hint phrases decodes commands
    exactly, the general language model gives free-form English as best effort; both decode
    every utterance, the LM while the user speaks, the grammar in one pass at the end
    (backend/voice/asr_worker.py says why, and chooses between them).

    Decoding runs in one worker process, started at the first `open` (or `warm`) and shared by
    every stream: the models load there once, lazily (the first utterance overlaps the load).
    It holds at most `lm_decoders` general-LM decoders (~90 MB each) and one grammar decoder
    (~6 MB); grammars are compiled once per phrase set.
    """

    name = "pocketsphinx"

    def __init__(
        self,
        *,
        max_utterance_s: float = DEFAULT_MAX_UTTERANCE_S,
        lm_decoders: int = 2,
    ) -> None:
        require_pocketsphinx()
        self.max_bytes = _max_bytes(max_utterance_s)
        self._lm_decoders = lm_decoders
        self._worker: _SphinxWorker | None = None

    def _running_worker(self) -> _SphinxWorker:
        if self._worker is None or not self._worker.alive:
            if self._worker is not None:
                log.warning("asr_worker_restarted", engine="pocketsphinx")
                self._worker.close()
            self._worker = _SphinxWorker(self._lm_decoders)
        return self._worker

    def open(self, hints: RecognitionHints) -> RecognitionStream:
        """Start an utterance in the worker process, with a grammar of the hinted phrases if any."""
        worker = self._running_worker()
        phrases = tuple(hints.phrases)
        key = worker.grammar_key(phrases) if phrases else None
        return _SphinxStream(worker, key, self.max_bytes, hints.language)

    async def warm(self, hints: RecognitionHints | None = None) -> None:
        """Load the models now (one silent utterance), instead of during the first one."""
        stream = self.open(hints or RecognitionHints(("hello",)))
        stream.feed(bytes(3200))
        await stream.finish()

    async def stats(self) -> tuple[int, tuple[int, int]]:
        """(streams open in the worker, (LM decoders, grammar decoders) loaded)."""
        return await self._running_worker().ping()

    async def aclose(self) -> None:
        """Stop the worker process, if it was started."""
        if self._worker is not None:
            worker, self._worker = self._worker, None
            await asyncio.to_thread(worker.close)


def require_pocketsphinx() -> None:
    import importlib.util

    if importlib.util.find_spec("pocketsphinx") is None:
        raise VoiceUnavailable(
            "embedded speech recognition needs the 'pocketsphinx' package "
            "(pip install 'esp32-mcp-bridge[voice]')"
        )


# ---- OpenAI-compatible /v1/audio/transcriptions --------------------------------------------------


class _BufferedStream:
    """Keeps the utterance (bounded) for engines that take it whole."""

    def __init__(self, max_bytes: int) -> None:
        self.frames: list[bytes] = []
        self._left = max_bytes
        self.cancelled = False

    def feed(self, pcm: bytes) -> None:
        if self.cancelled or self._left <= 0:
            return
        pcm = pcm[: self._left]
        self._left -= len(pcm)
        self.frames.append(pcm)

    def audio(self) -> bytes:
        return b"".join(self.frames)


class _OpenAIStream(_BufferedStream):
    def __init__(self, owner: "OpenAITranscriber", hints: RecognitionHints) -> None:
        super().__init__(owner.max_bytes)
        self._owner = owner
        self._language = hints.language or owner.language
        self._task: asyncio.Task[Transcript] | None = None

    async def transcribe(self) -> Transcript:
        """The text, or RecognitionFailed with a one-line reason (never the key)."""
        if self.cancelled:
            raise RecognitionFailed("cancelled")
        self._task = asyncio.ensure_future(self._owner.transcribe(self.audio(), self._language))
        try:
            return await self._task
        except asyncio.CancelledError:
            if self.cancelled and not _cancelling():  # our cancel(), not the caller's
                raise RecognitionFailed("cancelled") from None
            raise
        finally:
            self._task = None

    async def finish(self) -> Transcript:
        try:
            return await self.transcribe()
        except RecognitionFailed as exc:
            if not self.cancelled:
                log.warning("asr_failed", engine="openai", reason=str(exc))
            return Transcript("", "openai", self._language, fallback_reason=str(exc))

    def cancel(self) -> None:
        self.cancelled = True
        self.frames.clear()
        if self._task is not None:
            self._task.cancel()


class OpenAITranscriber:
    """An OpenAI-compatible `POST {base}/v1/audio/transcriptions` server (OpenAI, Groq, a
    faster-whisper or whisper.cpp server, LocalAI): the only way to Vietnamese speech here.
    The utterance is sent whole as a 16 kHz mono WAV when it ends."""

    name = "openai"

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "whisper-1",
        api_key: str | None = None,
        language: str | None = None,
        timeout_s: float = 10.0,
        max_utterance_s: float = DEFAULT_MAX_UTTERANCE_S,
    ) -> None:
        self.url = base_url.rstrip("/").removesuffix("/v1") + "/v1/audio/transcriptions"
        self.model = model
        self.language = language
        self.timeout_s = timeout_s
        self.max_bytes = _max_bytes(max_utterance_s)
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
            max_utterance_s=settings.voice_max_utterance_s,
        )

    def open(self, hints: RecognitionHints) -> "_OpenAIStream":
        """Start an utterance; its audio is sent as one WAV when it ends."""
        return _OpenAIStream(self, hints)

    async def transcribe(self, pcm: bytes, language: str | None) -> Transcript:
        """Send one utterance (16 kHz PCM16) to the transcription API; raises on an HTTP or shape
        error."""
        data = {"model": self.model, "response_format": "json"}
        if language:
            data["language"] = language
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
        return Transcript(text.strip(), "openai", language)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _one_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:200]


# ---- fallback ------------------------------------------------------------------------------------


class _FallbackStream(_BufferedStream):
    def __init__(self, owner: "FallbackRecognizer", hints: RecognitionHints) -> None:
        super().__init__(owner.max_bytes)
        self._owner = owner
        self._hints = hints
        self._primary = owner.primary.open(hints)

    def feed(self, pcm: bytes) -> None:
        super().feed(pcm)
        self._primary.feed(pcm)

    async def finish(self) -> Transcript:
        try:
            transcript = await self._primary.transcribe()
        except RecognitionFailed as exc:
            if self.cancelled:
                return Transcript("", self._owner.name, fallback_reason="cancelled")
            self._owner.outage(str(exc))
            return await self._embedded(str(exc))
        self._owner.recovered()
        return transcript

    async def _embedded(self, reason: str) -> Transcript:
        stream = self._owner.embedded.open(self._hints)
        for frame in self.frames:
            stream.feed(frame)
        self.frames.clear()
        transcript = await stream.finish()
        return Transcript(
            transcript.text,
            transcript.engine,
            transcript.language,
            fallback_reason=f"{self._owner.primary.name}: {reason}",
        )

    def cancel(self) -> None:
        self.cancelled = True
        self.frames.clear()
        self._primary.cancel()


class FallbackRecognizer:
    """A remote primary with the embedded recognizer behind it: the utterance is kept (bounded)
    while the primary hears it, and recognized by the embedded one if the primary fails. The
    reason is logged once per outage, not per utterance."""

    def __init__(self, primary: OpenAITranscriber, embedded: Recognizer) -> None:
        self.primary = primary
        self.embedded = embedded
        self.name = f"{primary.name}+{embedded.name}"
        self.max_bytes = primary.max_bytes
        self._outage: str | None = None

    def open(self, hints: RecognitionHints) -> RecognitionStream:
        """Start an utterance on the provider, falling back to the embedded recognizer if it
        fails."""
        return _FallbackStream(self, hints)

    def outage(self, reason: str) -> None:
        """The provider failed: log the outage once, until it recovers."""
        if self._outage is None:
            log.warning(
                "asr_provider_down",
                provider=self.primary.name,
                reason=reason,
                fallback=self.embedded.name,
            )
        self._outage = reason

    def recovered(self) -> None:
        """The provider answered again: log that once."""
        if self._outage is not None:
            log.info("asr_provider_back", provider=self.primary.name)
        self._outage = None

    async def aclose(self) -> None:
        """Close both recognizers."""
        await self.primary.aclose()
        await self.embedded.aclose()


# ---- configuration -------------------------------------------------------------------------------


def recognizer_from_settings(settings: "Settings") -> Recognizer | None:
    """The recognizer `BRIDGE_ASR_PROVIDER` names: "embedded" (pocketsphinx), "openai" (with
    pocketsphinx as its fallback when installed), or None for "none".

    Raises:
        VoiceUnavailable: "embedded" without the pocketsphinx package.
    """
    max_s = settings.voice_max_utterance_s
    if settings.asr_provider == "none":
        return None
    if settings.asr_provider == "embedded":
        return PocketsphinxRecognizer(max_utterance_s=max_s)
    remote = OpenAITranscriber.from_settings(settings)
    try:
        return FallbackRecognizer(remote, PocketsphinxRecognizer(max_utterance_s=max_s))
    except VoiceUnavailable as exc:
        log.warning("asr_no_fallback", provider=remote.name, reason=str(exc))
        return remote


__all__ = [
    "FallbackRecognizer",
    "OpenAITranscriber",
    "PocketsphinxRecognizer",
    "RecognitionFailed",
    "RecognitionHints",
    "RecognitionStream",
    "Recognizer",
    "Transcript",
    "command_phrases",
    "recognizer_from_settings",
]
