"""Stage 1 of the voice path: one device's uplink packets in, whole utterances out.

A `Listener` follows the device's `listen` messages, decodes its packets (Opus or PCM16, any
frame length) to 16 kHz PCM16 and runs the speech detector over everything heard since
`listen start`, in every mode:

- `auto` and `realtime`: the detector ends the utterance after the silence wait;
- `manual`: the utterance ends at `listen stop` (push-to-talk).

Either way the utterance handed on is cut the same way from the same audio: from `PREROLL_MS`
before the detector's onset (the detector decides a little after the first syllable starts) to
`TAIL_MS` after the last speech, so auto and manual mode hear the same audio, and the
recognizer never gets a clipped first or last syllable. A manual utterance in which the
detector found no speech is handed on whole (the user pressed the button: they spoke).

While the silence wait runs, `on_pause` gets the utterance as it would end now: the next stage
may start recognizing it early (if speech resumes, that guess is dropped).

Audio outside a `listen start` is dropped undecoded (a wake word's pre-roll, a device that
streams without asking); so is audio while the bridge speaks, except in realtime mode (the
stock device sends none then; what comes is echo). Everything held is bounded.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from backend.devices.conversation import Conversation
from backend.dialogue.timings import TurnTimings
from backend.logs import LogBudget
from backend.voice.audio import UPLINK_RATE
from backend.voice.codec import UplinkDecoder, uplink_decoder
from backend.voice.errors import AudioDecodeError
from backend.voice.vad import SileroPool, SpeechDetector, VadEvent

Mode = Literal["auto", "manual", "realtime"]

BYTES_PER_MS = UPLINK_RATE * 2 // 1000
PREROLL_MS = 480  # before the detector's onset (it decides 60-150 ms into the speech)
TAIL_MS = 180  # after the detector's first silent window (it lags the speech by ~150 ms)
MIN_SPEECH_MS = 120  # from onset to silence: shorter is a click or a cough, not a turn
PAUSE_MS = 240  # silence after which the utterance is offered for early recognition


@dataclass(frozen=True, slots=True)
class Utterance:
    """The audio of one utterance (16 kHz PCM16) and how it ended."""

    pcm: bytes
    why: str  # "end of speech", "listen stop", "length limit"
    timings: TurnTimings = field(default_factory=TurnTimings)

    @property
    def duration_ms(self) -> float:
        """How long the audio plays."""
        return len(self.pcm) / BYTES_PER_MS


@dataclass(slots=True)
class ListenLimits:
    """When an utterance ends: after `silence_ms` of silence, or at `max_utterance_ms`."""

    silence_ms: int
    max_utterance_ms: float


class Listener:
    """One device's uplink while it talks (see the module docstring)."""

    def __init__(
        self,
        conversation: Conversation,
        pool: SileroPool,
        limits: ListenLimits,
        *,
        on_utterance: Callable[[Utterance], None],
        on_speech: Callable[[], None],
        on_pause: Callable[[Utterance], None],
        log: LogBudget,
    ) -> None:
        self.conversation = conversation
        self._pool = pool
        self._limits = limits
        self._on_utterance = on_utterance
        self._on_speech = on_speech
        self._on_pause = on_pause
        self._log = log
        self.mode: Mode = "auto"
        self.listening = False
        self._decoder: UplinkDecoder | None = None
        self._detector: SpeechDetector | None = None
        self._audio = bytearray()  # since listen start (while idle in auto: the pre-roll only)
        self._onset: int | None = None  # byte offset of the first speech onset
        self._silence_at: int | None = None  # byte offset where the last silence began
        self._offered = False  # the current pause was offered for early recognition
        self.last_heard = time.monotonic()
        self.bad_packets = 0
        self.dropped_not_listening = 0

    # ---- listen messages --------------------------------------------------------------------

    def start(self, mode: Mode) -> None:
        """`listen start`: forget anything heard, then listen in `mode`."""
        self._forget()
        # A fresh decoder: the state the last utterance's packets left in it (and how many of
        # its tail were decoded before the answer began, a race) must not change this one's audio.
        self._decoder = None
        self.mode, self.listening = mode, True
        self.last_heard = time.monotonic()
        if self._detector is None:
            self._detector = SpeechDetector(self._limits.silence_ms, self._pool)
        else:
            self._detector.reset()

    def stop(self) -> None:
        """`listen stop`: in manual mode the utterance is over; otherwise it is dropped."""
        was_listening, self.listening = self.listening, False
        if was_listening and self.mode == "manual" and self._audio:
            self._finish("listen stop", whole_if_silent=True)
        self._forget()

    def detect(self) -> None:
        """A wake word: whatever was heard so far is its pre-roll, not a question."""
        self._forget()

    def abort(self) -> None:
        """The device aborted: drop the utterance being heard."""
        self._forget()

    def close(self) -> None:
        """Stop listening and give the detector back."""
        self.listening = False
        self._forget()
        if self._detector is not None:
            self._detector.close()
            self._detector = None

    # ---- audio ------------------------------------------------------------------------------

    def audio(self, payload: bytes, speaking: bool) -> None:
        """One uplink packet."""
        if not self.listening or (speaking and self.mode != "realtime"):
            self.dropped_not_listening += 1
            if self.dropped_not_listening == 1 and not self.listening:
                self._log.info(
                    "audio without listen start dropped", device_id=self.conversation.device_id
                )
            return
        pcm = self._decode(payload)
        if pcm is None or self._detector is None:
            return
        if self._onset is None and self.mode != "manual":
            del self._audio[: max(0, len(self._audio) - PREROLL_MS * BYTES_PER_MS)]
        at = len(self._audio)
        self._audio += pcm
        event = self._detector.feed(pcm)
        self._follow(event, at)
        if event is VadEvent.SPEECH_END and self.mode != "manual":
            self._finish("end of speech")
        elif self._onset is not None:
            self._offer_pause()
            self._enforce_length()
        elif self.mode == "manual":
            self._enforce_length()

    def _follow(self, event: VadEvent | None, at: int) -> None:
        """Track where speech started and where the current silence began."""
        assert self._detector is not None
        if event is VadEvent.SPEECH_START:
            self.last_heard = time.monotonic()
            if self._onset is None:
                self._onset = at
            self._silence_at, self._offered = None, False
            self._on_speech()
        elif event is VadEvent.SPEECH_END or self._detector.in_silence:
            if self._silence_at is None and self._onset is not None:
                self._silence_at = at
        elif self._detector.speaking:
            self._silence_at, self._offered = None, False

    def _decode(self, payload: bytes) -> bytes | None:
        try:
            if self._decoder is None:
                hello_params = self.conversation.uplink_audio
                if hello_params is None:
                    raise AudioDecodeError("audio before the hello")
                self._decoder = uplink_decoder(hello_params)
            return self._decoder.decode(payload)
        except AudioDecodeError as exc:
            self.bad_packets += 1
            self._log.warning(
                "uplink audio dropped",
                device_id=self.conversation.device_id,
                error=str(exc),
                bad_packets=self.bad_packets,
            )
            return None

    def _offer_pause(self) -> None:
        if self.mode == "manual" or self._offered or self._silence_at is None:
            return
        if len(self._audio) - self._silence_at >= PAUSE_MS * BYTES_PER_MS:
            self._offered = True
            self._on_pause(Utterance(self._clip(), "pause"))

    def _enforce_length(self) -> None:
        start = self._start()
        if len(self._audio) - start < self._limits.max_utterance_ms * BYTES_PER_MS:
            return
        self._log.info(
            "utterance cut at its length limit",
            device_id=self.conversation.device_id,
            max_ms=self._limits.max_utterance_ms,
        )
        self._finish("length limit", whole_if_silent=True)
        self._forget()
        if self._detector is not None:
            self._detector.reset()

    # ---- utterances -------------------------------------------------------------------------

    def _start(self) -> int:
        if self._onset is None:
            return 0
        return max(0, self._onset - PREROLL_MS * BYTES_PER_MS)

    def _clip(self) -> bytes:
        """The utterance as it stands: pre-roll, speech, and the tail of the silence."""
        end = len(self._audio)
        if self._silence_at is not None:
            end = min(end, self._silence_at + TAIL_MS * BYTES_PER_MS)
        return bytes(self._audio[self._start() : end])

    def _finish(self, why: str, *, whole_if_silent: bool = False) -> None:
        if self._onset is None:
            if whole_if_silent and len(self._audio) >= MIN_SPEECH_MS * BYTES_PER_MS:
                self._hand_on(bytes(self._audio), why, silence_ms=None)
            self._forget()
            return
        speech_end = self._silence_at if self._silence_at is not None else len(self._audio)
        if speech_end - self._onset >= MIN_SPEECH_MS * BYTES_PER_MS:
            waited = (len(self._audio) - speech_end) / BYTES_PER_MS
            self._hand_on(self._clip(), why, silence_ms=waited if why != "listen stop" else None)
        self._forget()

    def _hand_on(self, pcm: bytes, why: str, silence_ms: float | None) -> None:
        timings = TurnTimings(silence_wait_ms=silence_ms)
        timings.mark("end_of_speech")
        self._on_utterance(Utterance(pcm, why, timings))

    def _forget(self) -> None:
        self._audio.clear()
        self._onset = self._silence_at = None
        self._offered = False
