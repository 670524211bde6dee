"""A spoken answer: sentences in, paced downlink audio out.

The device chat hands sentences to `say()` as the chat's answer streams in. A synthesis task
turns each into PCM (sentence N+1 is synthesized while N plays), cuts it into frames and
encodes them in the format and rate the server hello announced; a playout task sends them by
the `PlayoutClock`, with `tts sentence_start {text}` just before each sentence's first frame.
`finish()` sends `tts stop` only once the last frame is due to have played, plus a margin (the
stock device resets its decoder on `stop`, cutting whatever it still holds). `halt()` stops
the downlink at once (abort, barge-in): no frame leaves after it returns.

Between two sentences of an answer go `Pacing.sentence_pause_ms` of silent frames (300 ms: 5
frames of 60 ms), before the next sentence's mark: eSpeak ends a sentence with ~10 ms of
silence and starts the next within ~0-50 ms, so without it sentences ran together 40-50 ms
apart. None before the first sentence or after the last (the `tts stop` margin is apart), and
less when the next sentence came late and the device has been silent meanwhile.
"""

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import structlog

from backend.chat.language import detect_language
from backend.devices.conversation import Conversation
from backend.dialogue.timings import TurnTimings
from backend.errors import BridgeError
from backend.voice.audio import frame_bytes
from backend.voice.codec import downlink_encoder
from backend.voice.playout import PlayoutClock
from backend.voice.tts import Synthesizer, speakable

log = structlog.get_logger("voice.speech")

# Frames synthesized ahead of the playout clock: bounds memory per talker (~2.4 s of audio).
MAX_FRAMES_AHEAD = 40


@dataclass(slots=True)
class Pacing:
    """Playout pacing: frames sent ahead of due time, margin before `tts stop` in seconds,
    silence between two sentences in milliseconds."""

    lead_frames: int = 2
    stop_margin_s: float = 0.18
    sentence_pause_ms: int = 300


@dataclass(slots=True)
class PlayoutStats:
    """What the playout did, for logs and benchmarks."""

    frames: int = 0
    max_in_flight: int = 0
    # How long after its scheduled time each paced frame left (frames the clock allowed at once,
    # the lead and those after a re-base, are on time by definition and not counted).
    lateness_ms: list[float] = field(default_factory=list)


class _Sentence(str):
    """A sentence mark in the frame queue (told apart from audio packets, which are bytes)."""


_END = None


class SpokenAnswer:
    """One answer spoken to a device (see the module docstring)."""

    def __init__(
        self,
        conversation: Conversation,
        synthesizer: Synthesizer,
        pacing: Pacing,
        timings: TurnTimings,
    ) -> None:
        self._conversation = conversation
        self._synthesizer = synthesizer
        self._pacing = pacing
        self.timings = timings
        params = conversation.downlink_audio
        self._rate = params.sample_rate
        self._frame_ms = params.frame_duration
        self._frame_bytes = frame_bytes(params.sample_rate, params.frame_duration)
        self._encoder = downlink_encoder(params)
        self._sentences: asyncio.Queue[str | None] = asyncio.Queue()
        self._items: asyncio.Queue[bytes | _Sentence | None] = asyncio.Queue(MAX_FRAMES_AHEAD)
        self._clock = PlayoutClock(params.frame_duration / 1000, pacing.lead_frames)
        self.stats = PlayoutStats()
        self._tasks: list[asyncio.Task[None]] = []
        self.begun = False
        self.stopped = False

    # ---- what the device chat calls ---------------------------------------------------------

    async def begin(self, emotion: str) -> None:
        """`llm {emotion}` and `tts start` (the device enters speaking), then the tasks start."""
        self.begun = True
        await self._conversation.send_llm(emotion)
        await self._conversation.send_tts_start()
        loop = asyncio.get_running_loop()
        device = self._conversation.device_id
        self._tasks = [
            loop.create_task(self._synthesize(), name=f"voice-synth {device}"),
            loop.create_task(self._play(), name=f"voice-play {device}"),
        ]

    async def say(self, sentence: str) -> None:
        """Queue a sentence to speak (as `speakable` reads it); one with nothing to read is
        skipped."""
        text = speakable(sentence)
        if text:
            self._sentences.put_nowait(text)

    async def finish(self) -> None:
        """Wait for the last frame to be due, plus the margin, then `tts stop`."""
        self._sentences.put_nowait(None)
        if self._tasks:
            await self._tasks[1]
        last_due = self._clock.last_due
        if last_due is not None:
            self.timings.mark("last_frame_due", last_due)
            delay = last_due + self._pacing.stop_margin_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        await self._send_stop()

    def halt(self) -> None:
        """Stop the downlink now (abort, barge-in); `stop()` then says `tts stop`."""
        for task in self._tasks:
            task.cancel()

    async def stop(self) -> None:
        """Halt at once and send `tts stop` if speech had begun; link errors are ignored."""
        self.halt()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.begun:
            with contextlib.suppress(BridgeError):
                await self._send_stop()

    async def _send_stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await self._conversation.send_tts_stop()
            self.timings.mark("stopped")

    # ---- synthesis: sentences to encoded frames ---------------------------------------------

    async def _synthesize(self) -> None:
        try:
            first = True
            while (sentence := await self._sentences.get()) is not None:
                if not first:
                    await self._pause()
                first = False
                await self._items.put(_Sentence(sentence))
                await self._synthesize_sentence(sentence)
        except Exception:  # a bug here must not leave the playout waiting forever
            log.exception("synthesis failed", device_id=self._conversation.device_id)
        await self._items.put(_END)

    async def _pause(self) -> None:
        """Silent frames between two sentences (see the module docstring)."""
        pause_s = self._pacing.sentence_pause_ms / 1000
        last_due = self._clock.last_due
        if last_due is not None and self._items.empty():  # the playout ran dry: already silent
            pause_s -= max(0.0, time.perf_counter() - last_due)
        silence = bytes(self._frame_bytes)
        for _ in range(max(0, round(pause_s * 1000 / self._frame_ms))):
            await self._items.put(self._encoder.encode(silence))

    async def _synthesize_sentence(self, sentence: str) -> None:
        pending = bytearray()
        size = self._frame_bytes
        language = detect_language(sentence)
        try:
            async for chunk in self._synthesizer.synthesize(sentence, language, self._rate):
                self.timings.mark("first_audio")
                pending += chunk
                while len(pending) >= size:
                    await self._items.put(self._encoder.encode(bytes(pending[:size])))
                    del pending[:size]
                    await asyncio.sleep(0)  # a whole sentence in one chunk must not stall the loop
        except BridgeError as exc:  # the synthesizer logged why; the next sentence may work
            log.info("sentence not spoken", device_id=self._conversation.device_id, error=str(exc))
        if pending:
            pending += bytes(size - len(pending))
            await self._items.put(self._encoder.encode(bytes(pending)))

    # ---- playout: frames out on the clock ---------------------------------------------------

    async def _play(self) -> None:
        conversation, clock, stats = self._conversation, self._clock, self.stats
        while (item := await self._items.get()) is not _END:
            if isinstance(item, _Sentence):
                await conversation.send_tts_sentence(str(item))
                continue
            now = time.perf_counter()
            send_at = clock.send_at(now)
            if send_at > now:
                await asyncio.sleep(send_at - now)
                now = time.perf_counter()
                stats.lateness_ms.append((now - send_at) * 1000)
            await conversation.send_audio(item, clock.sent * self._frame_ms)
            clock.mark_sent(now)
            stats.frames += 1
            stats.max_in_flight = max(stats.max_in_flight, clock.in_flight(now))
            self.timings.mark("first_frame_sent", now)
