"""One device's uplink while it talks: listen state, decoding, end of utterance.

A `VoiceSession` follows the device's `listen` messages. In `auto` and `realtime` mode the
speech detector finds each utterance (with `PREROLL_FRAMES` of audio before its onset, so the
first syllable is not lost) and the recognizer hears it as it arrives; in `manual` mode all
audio between `listen start` and `listen stop` is the utterance. Audio outside a `listen start`
is dropped undecoded (a wake word's pre-roll, or a device that streams without asking).
Everything it holds is bounded: the pre-roll, the utterance (`max_utterance_s`), the
recognizer's input.
"""

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from backend.devices.conversation import Conversation
from backend.logs import LogBudget
from backend.voice.asr import RecognitionHints, RecognitionStream, Recognizer, Transcript
from backend.voice.audio import FRAME_MS
from backend.voice.codec import UplinkDecoder, uplink_decoder
from backend.voice.errors import AudioDecodeError
from backend.voice.timings import TurnTimings
from backend.voice.vad import SileroPool, SpeechDetector, VadEvent

PREROLL_FRAMES = 8  # 480 ms before the detector's onset goes to the recognizer
# The recognizer hears at most this much of the silence that ended an utterance, not the whole
# hangover: less to decode when the turn waits (the grammar decodes in one pass at the end).
# It was first added because the streamed grammar turned the tail into an extra word ("forty" ->
# "forty eight"); that is now fixed in the decoder (asr_worker: 100 % with 600 ms of tail).
TAIL_FRAMES = 3
MAX_HELD_FRAMES = 50  # 3 s: silence held back longer than that is fed after all
MIN_UTTERANCE_MS = 240  # shorter (a click, a cough) is not worth a turn

Mode = Literal["auto", "manual", "realtime"]
UtteranceHandler = Callable[[Conversation, Transcript, TurnTimings], None]


@dataclass(slots=True)
class SessionLimits:
    """When an utterance ends: after `silence_ms` of silence, or at `max_utterance_ms`."""

    silence_ms: int
    max_utterance_ms: float


class VoiceSession:
    """One device's uplink while it talks (see the module docstring)."""

    def __init__(
        self,
        conversation: Conversation,
        recognizer: Recognizer,
        pool: SileroPool,
        limits: SessionLimits,
        hints: Callable[[], RecognitionHints],
        on_utterance: UtteranceHandler,
        on_speech: Callable[[], None],
        log: LogBudget,
    ) -> None:
        self.conversation = conversation
        self._recognizer = recognizer
        self._pool = pool
        self._limits = limits
        self._hints = hints
        self._on_utterance = on_utterance
        self._on_speech = on_speech
        self._log = log
        self.mode: Mode = "auto"
        self.listening = False
        self._decoder: UplinkDecoder | None = None
        self._detector: SpeechDetector | None = None
        self._preroll: deque[bytes] = deque(maxlen=PREROLL_FRAMES)
        self._held: list[bytes] = []  # silence inside an utterance, until speech resumes or ends
        self._stream: RecognitionStream | None = None
        self._utterance_ms = 0.0
        self._pending: set[asyncio.Task[None]] = set()
        self.last_heard = time.monotonic()
        self.bad_packets = 0
        self.dropped_not_listening = 0

    # ---- listen messages --------------------------------------------------------------------

    def start(self, mode: Mode) -> None:
        """`listen start`: drop any utterance, then listen in `mode` (manual opens the stream at
        once)."""
        self._drop_utterance()
        self.mode, self.listening = mode, True
        self.last_heard = time.monotonic()
        if mode == "manual":
            self._open_stream()
        elif self._detector is None:
            self._detector = SpeechDetector(self._limits.silence_ms, self._pool)
        else:
            self._detector.reset()

    def stop(self) -> None:
        """`listen stop`: in manual mode the utterance is over; otherwise it is dropped."""
        self.listening = False
        if self.mode == "manual" and self._stream is not None:
            self._finish("listen stop")
        else:
            self._drop_utterance()

    def detect(self) -> None:
        """A wake word: whatever was heard so far is its pre-roll, not a question."""
        self._drop_utterance()

    def abort(self) -> None:
        """The device aborted: drop the utterance being heard."""
        self._drop_utterance()

    def close(self) -> None:
        """Stop listening, give the detector back and cancel the pending recognitions."""
        self.listening = False
        self._drop_utterance()
        if self._detector is not None:
            self._detector.close()
            self._detector = None
        for task in self._pending:
            task.cancel()

    # ---- audio ------------------------------------------------------------------------------

    def audio(self, payload: bytes, speaking: bool) -> None:
        """One uplink packet. While the bridge speaks only realtime mode listens (the stock
        device sends no audio then in other modes; what comes is echo)."""
        if not self.listening or (speaking and self.mode != "realtime"):
            self.dropped_not_listening += 1
            if self.dropped_not_listening == 1 and not self.listening:
                self._log.info(
                    "audio without listen start dropped",
                    device_id=self.conversation.device_id,
                )
            return
        pcm = self._decode(payload)
        if pcm is None:
            return
        if self.mode == "manual":
            self._feed(pcm)
            return
        assert self._detector is not None
        event = self._detector.feed(pcm)
        if event is VadEvent.SPEECH_START:
            self.last_heard = time.monotonic()
            self._on_speech()
            self._open_stream()
            for earlier in self._preroll:
                self._feed(earlier)
            self._preroll.clear()
        if self._stream is None:
            self._preroll.append(pcm)
        elif event is VadEvent.SPEECH_END:
            self._feed_held(TAIL_FRAMES)
            self._finish("end of speech", silence_ms=self._limits.silence_ms)
        elif self._detector.in_silence:
            self._held.append(pcm)  # fed only if speech resumes: see TAIL_FRAMES
            if len(self._held) > MAX_HELD_FRAMES:  # scores hovering between the thresholds
                self._feed(self._held.pop(0))
        else:
            self._feed_held(len(self._held))
            self._feed(pcm)

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

    def _feed(self, pcm: bytes) -> None:
        if self._stream is None:
            return
        self._stream.feed(pcm)
        self._utterance_ms += FRAME_MS
        if self._utterance_ms >= self._limits.max_utterance_ms:
            self._log.info(
                "utterance cut at its length limit",
                device_id=self.conversation.device_id,
                max_ms=self._limits.max_utterance_ms,
            )
            self._finish("length limit")
            if self._detector is not None:
                self._detector.reset()

    # ---- utterances -------------------------------------------------------------------------

    def _open_stream(self) -> None:
        self._drop_utterance()
        self._stream = self._recognizer.open(self._hints())
        self._utterance_ms = 0.0

    def _drop_utterance(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        self._preroll.clear()
        self._held.clear()
        self._utterance_ms = 0.0

    def _feed_held(self, count: int) -> None:
        for pcm in list(self._held)[:count]:
            self._feed(pcm)
        self._held.clear()

    def _finish(self, why: str, silence_ms: float | None = None) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            return
        if self._utterance_ms < MIN_UTTERANCE_MS:
            stream.cancel()
            return
        timings = TurnTimings(silence_wait_ms=silence_ms)
        timings.mark("end_of_speech")
        task = asyncio.get_running_loop().create_task(
            self._recognize(stream, timings), name=f"voice-asr {self.conversation.device_id}"
        )
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _recognize(self, stream: RecognitionStream, timings: TurnTimings) -> None:
        try:
            transcript = await stream.finish()
        except asyncio.CancelledError:
            stream.cancel()
            raise
        timings.mark("recognized")
        self._on_utterance(self.conversation, transcript, timings)
