"""Speech synthesis behind one interface (`BRIDGE_TTS_*`).

`synthesize` yields PCM16 mono chunks at the requested rate as soon as they exist, so the first
frame of a sentence goes out before the sentence is fully synthesized.

The embedded engine is eSpeak NG, loaded in-process from the `espeakng-loader` wheel (library
and data inside, no apt step) through ctypes.
"""

import asyncio
import ctypes
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from backend.voice.audio import SAMPLE_BYTES, Clip
from backend.voice.errors import VoiceUnavailable


class Synthesizer(Protocol):
    name: str

    def synthesize(self, text: str, language: str, sample_rate: int) -> AsyncIterator[bytes]:
        """PCM16 chunks (any size) of `text` spoken in `language` ("vi", "en")."""

    async def aclose(self) -> None: ...


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
            import espeakng_loader  # type: ignore[import-untyped]
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
            import soxr  # type: ignore[import-untyped]

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

    Synthesis runs in one dedicated worker thread, not inline on the event loop. Measured here
    (tests/test_voice_tts.py, bench numbers in docs/voice.md): a 20-word sentence costs ~4 ms of
    C time, but a long sentence costs proportionally more and 50 devices answering at once would
    add up to tens of milliseconds of stalled loop, which the pacer's 10 ms jitter budget cannot
    absorb; a hop to the thread costs ~0.1 ms. The executor has a single thread because the
    library is serialized by its lock anyway: queued work waits in the executor instead of
    occupying the default pool's threads that other blocking calls need.
    """

    name = "espeak"

    def __init__(self, words_per_minute: int | None = None) -> None:
        self.words_per_minute = words_per_minute
        _ESPEAK.ensure_loaded()  # fail at startup, not at the first sentence
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="espeak")

    async def synthesize(self, text: str, language: str, sample_rate: int) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        stop = threading.Event()
        resampler = _Resampler(sample_rate)

        def hand_over(item: bytes | BaseException | None) -> None:
            loop.call_soon_threadsafe(chunks.put_nowait, item)

        def produce(pcm: bytes) -> bool:
            if stop.is_set():
                return False
            if out := resampler.feed(pcm):
                hand_over(out)
            return True

        def work() -> None:
            try:
                _ESPEAK.speak(text, espeak_voice(language), self.words_per_minute, produce)
                if not stop.is_set() and (tail := resampler.feed(b"", last=True)):
                    hand_over(tail)
                hand_over(None)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                hand_over(exc)

        loop.run_in_executor(self._executor, work)
        try:
            while (item := await chunks.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()  # a consumer that stops early (barge-in) aborts the C synthesis

    async def aclose(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
