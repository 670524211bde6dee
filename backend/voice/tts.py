"""Speech synthesis behind one interface (`BRIDGE_TTS_*`).

`synthesize` yields PCM16 mono chunks at the requested rate as soon as they exist, so the first
frame of a sentence goes out before the sentence is fully synthesized.

The embedded engine is eSpeak NG, loaded in-process from the `espeakng-loader` wheel (library
and data inside, no apt step) through ctypes.
"""

import asyncio
import contextlib
import ctypes
import re
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import httpx
import structlog

from backend.chat.language import detect_language
from backend.common import clip
from backend.config import Settings
from backend.voice.audio import SAMPLE_BYTES, Clip
from backend.voice.errors import SpeechFailed, VoiceUnavailable

log = structlog.get_logger("voice.tts")


class Synthesizer(Protocol):
    """A text-to-speech engine."""

    name: str

    def synthesize(self, text: str, language: str, sample_rate: int) -> AsyncIterator[bytes]:
        """PCM16 chunks (any size) of `text` spoken in `language` ("vi", "en")."""

    async def aclose(self) -> None:
        """Release the engine's resources."""


# ---- eSpeak NG ----------------------------------------------------------------------------------

ESPEAK_RATE = 22050  # libespeak-ng has no sample-rate option
ESPEAK_BUFFER_MS = 60  # the synthesis callback receives about one downlink frame at a time
DEFAULT_VOICES = {"vi": "vi", "en": "en-us"}
# eSpeak names British English "en" (file gmw/en); "en-gb" is what callers expect to write.
_VOICE_ALIASES = {"en-gb": "en"}

_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_PARAM_RATE = 1
_DEFAULT_WPM = 175
_SynthCallback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)

# A sink takes one chunk of 22050 Hz PCM16 and says whether to go on (False aborts synthesis).
Sink = Callable[[bytes], bool]


class _Espeak:
    """The process-wide libespeak-ng. The library keeps global state (voice, parameters, one
    callback) and is not thread safe: every call happens under `lock`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._lib: Any = None
        self._sink: Sink | None = None
        # Kept referenced for the life of the process: the C side holds the pointer.
        self._callback = _SynthCallback(self._on_audio)

    def _load(self) -> Any:
        try:
            import espeakng_loader  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            raise VoiceUnavailable(
                "speech synthesis needs the 'espeakng-loader' package (pip install "
                "'esp32-mcp-bridge[voice]')"
            ) from None
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_SynthCallback]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        data_path = espeakng_loader.get_data_path().encode()
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, ESPEAK_BUFFER_MS, data_path, 0)
        if rate != ESPEAK_RATE:
            raise VoiceUnavailable(f"libespeak-ng failed to initialize (returned {rate})")
        lib.espeak_SetSynthCallback(self._callback)
        return lib

    def _on_audio(self, wav: Any, samples: int, _events: Any) -> int:
        if samples <= 0 or self._sink is None:
            return 0  # the end-of-synthesis call, or the list-terminator event
        chunk = ctypes.string_at(wav, samples * SAMPLE_BYTES)
        return 0 if self._sink(chunk) else 1

    def ensure_loaded(self) -> None:
        with self.lock:
            if self._lib is None:
                self._lib = self._load()

    def speak(self, text: str, voice: str, words_per_minute: int | None, sink: Sink) -> None:
        """Synthesize `text` with `voice` (an eSpeak voice name, "en-us+f3" for a variant),
        handing 22050 Hz chunks to `sink` as they are produced; returns when done or aborted.

        Raises:
            VoiceUnavailable: the package is missing or the voice does not exist.
        """
        with self.lock:
            if self._lib is None:
                self._lib = self._load()
            lib = self._lib
            if lib.espeak_SetVoiceByName(_espeak_name(voice).encode()) != 0:
                raise VoiceUnavailable(f"eSpeak has no voice {voice!r}")
            lib.espeak_SetParameter(_PARAM_RATE, words_per_minute or _DEFAULT_WPM, 0)
            encoded = text.encode()
            self._sink = sink
            try:
                lib.espeak_Synth(
                    encoded, len(encoded) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None
                )
            finally:
                self._sink = None


_ESPEAK = _Espeak()


class _Resampler:
    """Streamed 22050 Hz -> `rate` conversion of PCM16 chunks (nothing to do at 22050)."""

    def __init__(self, rate: int, source_rate: int = ESPEAK_RATE) -> None:
        self._stream: Any = None
        if rate != source_rate:
            import numpy  # noqa: F401  (soxr needs it; imported here so a missing one says so)
            import soxr  # type: ignore[import-untyped,unused-ignore]

            self._stream = soxr.ResampleStream(source_rate, rate, 1, dtype="int16", quality="HQ")

    def feed(self, pcm: bytes, last: bool = False) -> bytes:
        if self._stream is None:
            return pcm
        import numpy

        samples = numpy.frombuffer(pcm, dtype="<i2")
        return bytes(self._stream.resample_chunk(samples, last=last).astype("<i2").tobytes())


def _espeak_name(voice: str) -> str:
    """eSpeak's name of a voice, keeping a variant suffix: "en-gb+f3" -> "en+f3"."""
    base, plus, variant = voice.lower().partition("+")
    return _VOICE_ALIASES.get(base, base) + plus + variant


def espeak_voice(language: str) -> str:
    """The eSpeak voice for a language tag ("vi", "en", "vi-VN", "en_US"); English otherwise."""
    primary = language.replace("_", "-").split("-")[0].lower()
    return DEFAULT_VOICES.get(primary, DEFAULT_VOICES["en"])


def render(
    text: str,
    language: str = "en",
    sample_rate: int = 16000,
    voice: str | None = None,
    words_per_minute: int | None = None,
) -> Clip:
    """The whole of `text` spoken by eSpeak, as one clip at `sample_rate` (blocking; for tests,
    benches and the simulator). `voice` overrides the language's voice, e.g. "en-gb", "en-us+f3".
    """
    resampler = _Resampler(sample_rate)
    parts: list[bytes] = []

    def collect(chunk: bytes) -> bool:
        parts.append(resampler.feed(chunk))
        return True

    _ESPEAK.speak(text, voice or espeak_voice(language), words_per_minute, collect)
    parts.append(resampler.feed(b"", last=True))
    return Clip(b"".join(parts), sample_rate)


class EspeakSynthesizer:
    """eSpeak NG in-process: the offline default, and the fallback of the remote providers.

    Synthesis runs in one dedicated worker thread, not inline on the event loop. Measured on
    this 2-core machine: a 21-word sentence (5.1 s of speech) takes 6-12 ms to synthesize and
    resample (60 words: ~35 ms), more than voice.md's 4 ms, and all of it would stall every
    device's pacer (jitter budget 10 ms), once per sentence per talking device. The hop to the
    thread costs ~0.08 ms and the first chunk reaches the loop ~1 ms after the call; with 50
    syntheses at once the loop's longest stall stayed under 10 ms. The executor has one thread
    because the library is serialized by its lock anyway: queued sentences wait there instead
    of occupying the default pool's threads that other blocking calls need.
    """

    name = "espeak"

    def __init__(
        self, words_per_minute: int | None = None, voices: Mapping[str, str] | None = None
    ) -> None:
        """`voices` overrides the voice of a language, e.g. {"en": "en-us+f3"}."""
        self.words_per_minute = words_per_minute
        self.voices = dict(voices or {})
        _ESPEAK.ensure_loaded()  # fail at startup, not at the first sentence
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="espeak")

    async def synthesize(self, text: str, language: str, sample_rate: int) -> AsyncIterator[bytes]:
        """Speak `text` with eSpeak NG on a worker thread, resampled to `sample_rate`."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        stop = threading.Event()
        resampler = _Resampler(sample_rate)

        def hand_over(item: bytes | BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed while we synthesized
                loop.call_soon_threadsafe(chunks.put_nowait, item)

        def produce(pcm: bytes) -> bool:
            if stop.is_set():
                return False
            if out := resampler.feed(pcm):
                hand_over(out)
            return True

        def work() -> None:
            try:
                voice = self.voices.get(language) or espeak_voice(language)
                _ESPEAK.speak(text, voice, self.words_per_minute, produce)
                if not stop.is_set() and (tail := resampler.feed(b"", last=True)):
                    hand_over(tail)
                hand_over(None)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                hand_over(exc)

        def closed(future: "asyncio.Future[None]") -> None:
            if future.cancelled():  # aclose() dropped it before it ran
                chunks.put_nowait(VoiceUnavailable("the eSpeak synthesizer is closed"))

        try:
            loop.run_in_executor(self._executor, work).add_done_callback(closed)
        except RuntimeError:  # the executor is shut down
            raise VoiceUnavailable("the eSpeak synthesizer is closed") from None
        try:
            while (item := await chunks.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()  # a consumer that stops early (barge-in) aborts the C synthesis

    async def aclose(self) -> None:
        """Stop the worker thread (a sentence being rendered is dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


# ---- OpenAI-compatible /v1/audio/speech -----------------------------------------------------

OPENAI_PCM_RATE = 24000  # `response_format: "pcm"` is raw s16le mono at 24 kHz


class _WavHeader:
    """Skips a streamed WAV body's header (RIFF, `fmt `, any other chunks) and reads its rate.

    Streaming servers write a placeholder data size, so the `data` chunk runs to the end of the
    body whatever its header says."""

    def __init__(self) -> None:
        self._buffer = b""
        self.sample_rate: int | None = None
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """Header bytes are swallowed; returns what follows the start of `data`, once found."""
        self._buffer += data
        if len(self._buffer) < 12:
            return b""
        if self._buffer[:4] != b"RIFF" or self._buffer[8:12] != b"WAVE":
            raise SpeechFailed("the speech server's WAV body has no RIFF/WAVE header")
        position = 12
        while len(self._buffer) >= position + 8:
            kind, size = struct.unpack_from("<4sI", self._buffer, position)
            body_start = position + 8
            if kind == b"data":
                if self.sample_rate is None:
                    raise SpeechFailed("the speech server's WAV body has no fmt chunk")
                self.done = True
                rest, self._buffer = self._buffer[body_start:], b""
                return rest
            if len(self._buffer) < body_start + size:
                return b""  # the rest of this chunk has not arrived yet
            if kind == b"fmt ":
                self._read_format(self._buffer[body_start : body_start + size])
            position = body_start + size + (size & 1)  # chunks are padded to even sizes
        return b""

    def _read_format(self, fmt: bytes) -> None:
        if len(fmt) < 16:
            raise SpeechFailed("the speech server's WAV fmt chunk is truncated")
        _codec, channels, rate, _byte_rate, _align, bits = struct.unpack_from("<HHIIHH", fmt)
        if channels != 1 or bits != 16:
            raise SpeechFailed(f"the speech server sent {channels}-channel {bits}-bit WAV")
        self.sample_rate = rate


class _PcmBody:
    """Turns the body's pieces (any sizes, odd ones included) into whole samples at `rate`."""

    def __init__(self, rate: int, wav: bool) -> None:
        self._rate = rate
        self._header = _WavHeader() if wav else None
        self._resampler: _Resampler | None = None if wav else _Resampler(rate, OPENAI_PCM_RATE)
        self._carry = b""  # an odd trailing byte waits for its partner

    def feed(self, data: bytes) -> bytes:
        if self._header is not None and not self._header.done:
            data = self._header.feed(data)
            if not self._header.done:
                return b""
            self._resampler = _Resampler(self._rate, self._header.sample_rate or self._rate)
        data = self._carry + data
        whole = len(data) - len(data) % SAMPLE_BYTES
        self._carry = data[whole:]
        if not whole or self._resampler is None:
            return b""
        return self._resampler.feed(data[:whole])

    def finish(self) -> bytes:
        return self._resampler.feed(b"", last=True) if self._resampler is not None else b""


class OpenAISpeech:
    """`POST {base}/v1/audio/speech` (OpenAI, speaches, LocalAI, Kokoro/Piper servers), with
    `response_format: "pcm"`, streamed: each piece of the body is yielded as it arrives.

    `timeout_s` bounds the connection and every wait for the next piece of the body. Raises
    `SpeechFailed` (never with the API key in it); the caller decides what speaks instead.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str = "tts-1",
        voice: str = "alloy",
        speed: float = 1.0,
        timeout_s: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.voice = voice
        self.speed = speed
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s))

    @property
    def url(self) -> str:
        """The `/v1/audio/speech` URL under the base URL (with or without its `/v1`)."""
        base = self.base_url
        return f"{base}/audio/speech" if base.endswith("/v1") else f"{base}/v1/audio/speech"

    def body(self, text: str) -> dict[str, Any]:
        """The request body for one sentence: raw PCM (`response_format: pcm`) in the configured
        voice and speed."""
        return {
            "model": self.model,
            "input": text,
            "voice": self.voice,
            "response_format": "pcm",
            "speed": self.speed,
        }

    async def synthesize(self, text: str, language: str, sample_rate: int) -> AsyncIterator[bytes]:
        """Stream the sentence from the speech API; raises SpeechFailed on an HTTP or link error."""
        # The API has no language field: the voice (or the server's model) reads the text as is.
        try:
            async with self._client.stream("POST", self.url, json=self.body(text)) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise SpeechFailed(
                        f"{self.name} speech answered HTTP {response.status_code}: "
                        f"{clip(response.text, 160)}"
                    )
                pcm = _PcmBody(sample_rate, wav=_is_wav(response))
                async for piece in response.aiter_raw():
                    if out := pcm.feed(piece):
                        yield out
                if tail := pcm.finish():
                    yield tail
        except httpx.HTTPError as exc:
            kind = type(exc).__name__
            raise SpeechFailed(
                f"{self.name} speech at {self.base_url} failed ({kind}: {exc})"
            ) from None

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()


def _is_wav(response: httpx.Response) -> bool:
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind in {"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"}


# ---- fallback -------------------------------------------------------------------------------


class FallbackSynthesizer:
    """The primary (a remote provider) speaks; when it fails before its first audio, the
    fallback (eSpeak) speaks that sentence instead.

    The log says why once per outage (the first failure) and once when the primary is back,
    never per sentence. During an outage the primary is retried at most every `retry_after_s`,
    so a dead or slow server costs one timeout, not one per sentence. A failure after audio
    started ends that sentence where it broke (repeating it from the start would be worse)."""

    def __init__(
        self,
        primary: Synthesizer,
        fallback: Synthesizer,
        *,
        retry_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.name = f"{primary.name}+{fallback.name}"
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._down_since: float | None = None  # when the current outage began
        self._last_failure = 0.0
        self._failed_sentences = 0

    @property
    def primary_down(self) -> bool:
        """Whether the primary engine is considered down (its sentences go to the fallback)."""
        return self._down_since is not None

    async def synthesize(self, text: str, language: str, sample_rate: int) -> AsyncIterator[bytes]:
        """Speak with the primary, or the fallback while it is down or when it fails before any
        audio."""
        if self._skip_primary():
            self._failed_sentences += 1
        else:
            started = False
            try:
                async with _closing(self.primary.synthesize(text, language, sample_rate)) as chunks:
                    async for chunk in chunks:
                        started = True
                        yield chunk
            except SpeechFailed as exc:
                self._failed(str(exc), mid_sentence=started)
                if started:
                    return
            else:
                self._recovered()
                return
        async with _closing(self.fallback.synthesize(text, language, sample_rate)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _skip_primary(self) -> bool:
        if self._down_since is None:
            return False
        return self._clock() - self._last_failure < self.retry_after_s

    def _failed(self, reason: str, *, mid_sentence: bool) -> None:
        self._failed_sentences += 1
        self._last_failure = self._clock()
        if self._down_since is not None:
            return
        self._down_since = self._last_failure
        log.warning(
            "tts.provider_failed",
            provider=self.primary.name,
            fallback=self.fallback.name,
            reason=reason,
            mid_sentence=mid_sentence,
            retry_after_s=self.retry_after_s,
        )

    def _recovered(self) -> None:
        if self._down_since is None:
            return
        log.info(
            "tts.provider_recovered",
            provider=self.primary.name,
            outage_s=round(self._clock() - self._down_since, 1),
            sentences_by_fallback=self._failed_sentences,
        )
        self._down_since = None
        self._failed_sentences = 0

    async def aclose(self) -> None:
        """Close both engines."""
        await self.primary.aclose()
        await self.fallback.aclose()


@contextlib.asynccontextmanager
async def _closing(stream: AsyncIterator[bytes]) -> AsyncIterator[AsyncIterator[bytes]]:
    """Close an engine's stream as soon as its consumer stops (a barge-in), so an HTTP body or
    an eSpeak synthesis ends now rather than when the garbage collector finds it."""
    try:
        yield stream
    finally:
        if (aclose := getattr(stream, "aclose", None)) is not None:
            await aclose()


# ---- configuration --------------------------------------------------------------------------


def synthesizer_from_settings(settings: Settings) -> Synthesizer | None:
    """The synthesizer `BRIDGE_TTS_PROVIDER` names: "embedded" (eSpeak), "openai" (the remote
    server with eSpeak as its fallback) or None for "none".

    Raises:
        VoiceUnavailable: espeakng-loader (or soxr/numpy) is not installed.
    """
    kind = settings.tts_provider
    if kind == "none":
        return None
    espeak = EspeakSynthesizer()
    if kind == "embedded":
        return espeak
    key = settings.tts_api_key.get_secret_value() if settings.tts_api_key else None
    remote = OpenAISpeech(
        settings.tts_base_url,
        api_key=key or None,
        model=settings.tts_model,
        voice=settings.tts_voice,
        speed=settings.tts_speed,
        timeout_s=settings.tts_timeout_s,
    )
    return FallbackSynthesizer(remote, espeak)


# ---- what is read aloud ---------------------------------------------------------------------

_URL = r"(?:https?://|www\.)[^\s<>()\[\]]+[^\s<>()\[\].,;:!?'\"]"
_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"```[^\n]*"), " "),  # code fences (their content is kept)
    (re.compile(r"!?\[([^\]]*)\]\((?:[^()\s]|\([^()\s]*\))*\)"), r"\1"),  # [text](url) -> text
    (re.compile(r"<(?:https?://|www\.)[^>]*>"), " "),  # <https://...> autolinks
    (re.compile(_URL), " "),  # bare URLs
    (re.compile(r"\[\^?\d+(?:\s*[,–-]\s*\d+)*\]"), ""),  # citations [1], [2, 3], [^4]
    (re.compile(r"</?[A-Za-z][^>]*>"), " "),  # stray HTML tags
    (re.compile(r"^\s*(?:[-*_]\s*){3,}$", re.MULTILINE), " "),  # horizontal rules
    (re.compile(r"(\*\*|__|~~)(?=\S)(.+?)(?<=\S)\1"), r"\2"),  # bold, strikethrough
    (re.compile(r"(?<![\w*])[*_](?=\S)(.+?)(?<=\S)[*_](?![\w*])"), r"\1"),  # italics
    (re.compile(r"`+"), ""),  # inline code marks
    (re.compile(r"\s*\|\s*"), ", "),  # table cells
    (re.compile(r"\(\s*\)|\[\s*\]"), " "),  # brackets emptied by the rules above
]


_BLOCK_MARKER = re.compile(r"^\s{0,3}(?:#{1,6}|>+|[-*+]|\d+[.)])\s+")

# Numbers, units and abbreviations as they are said, per language: "55%" -> "55 percent",
# "2-3 minutes" -> "2 to 3 minutes", "1,450 ppm" -> "1450 parts per million", "°C" ->
# "degrees", "e.g." -> "for example", "vs" -> "versus". A remote speech server reads "%" and
# "ppm" as it likes, and eSpeak reads "ppm" letter by letter.
_EAR_WORDS: Mapping[str, Mapping[str, str]] = {
    "en": {
        **{"%": "percent", "-": "to", "°": "degrees", "°F": "degrees Fahrenheit"},
        **{"ppm": "parts per million", "e.g.": "for example", "i.e.": "that is", "vs": "versus"},
    },
    "vi": {
        **{"%": "phần trăm", "-": "đến", "°": "độ", "°F": "độ F", "ppm": "phần triệu"},
        **{"e.g.": "ví dụ", "i.e.": "tức là", "vs": "so với"},
    },
}
# Digit groups: "1,450" in English, "1.450" in Vietnamese (whose decimal mark is the comma).
_THOUSANDS = {
    "en": re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d]|[.,]\d)"),
    "vi": re.compile(r"(?<![\d.,])\d{1,3}(?:\.\d{3})+(?![\d]|[.,]\d)"),
}
_RANGE = re.compile(r"(?<![\w.,-])(\d+(?:[.,]\d+)?)\s*[-–]\s*(\d+(?:[.,]\d+)?)(?![\w-]|[.,]\d)")
_PERCENT = re.compile(r"(\d)\s*%")
_DEGREES = re.compile(r"(\d)\s*°\s*([CF])?(?![A-Za-z])")
_PPM = re.compile(r"(\d)\s*ppm\b", re.IGNORECASE)
_FOR_EXAMPLE = re.compile(r"\be\.\s?g\.", re.IGNORECASE)
_THAT_IS = re.compile(r"\bi\.\s?e\.", re.IGNORECASE)
_VERSUS = re.compile(r"\bvs\b\.?", re.IGNORECASE)


def for_the_ear(text: str, language: str) -> str:
    """Numbers, units and abbreviations of `text` as they are said in `language`."""
    words = _EAR_WORDS.get(language, _EAR_WORDS["en"])
    digits = _THOUSANDS.get(language, _THOUSANDS["en"])
    text = digits.sub(lambda found: re.sub(r"[.,]", "", found.group(0)), text)
    text = _RANGE.sub(rf"\1 {words['-']} \2", text)
    text = _PERCENT.sub(rf"\1 {words['%']}", text)
    text = _DEGREES.sub(
        lambda found: f"{found.group(1)} {words['°F' if found.group(2) == 'F' else '°']}", text
    )
    text = _PPM.sub(rf"\1 {words['ppm']}", text)
    text = _FOR_EXAMPLE.sub(words["e.g."], text)
    text = _THAT_IS.sub(words["i.e."], text)
    return _VERSUS.sub(words["vs"], text)


def speakable(text: str, language: str | None = None) -> str:
    """`text` as it should be read aloud: no URLs, no Markdown marks, no citation numbers
    like `[1]`, numbers and units in words where they are written short (`for_the_ear`, in
    `language`, detected when None), whitespace collapsed. Sources are never read; the chat
    sends them apart.

    A heading or list item becomes a phrase of its own (a period is added), so the voice pauses
    between items instead of running them together."""
    lines = []
    for line in text.splitlines():
        if marked := _BLOCK_MARKER.match(line):
            line = line[marked.end() :].rstrip()
            if line and line[-1] not in ".!?:;,":
                line += "."
        lines.append(line)
    text = "\n".join(lines)
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    text = for_the_ear(text, language or detect_language(text))
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"\s+([.,;:!?])", r"\1", text)  # "see . Then" left by a removed link
    text = re.sub(r"[,;:]+(?=[.!?])", "", text)  # "More:." once the URL is gone
    text = re.sub(r"([,;:])[,;:]+", r"\1", text)
    return text.strip(" ,;:")
