"""The voice path of every device, stage by stage, wired to the conversation hub and the dialogue.

    uplink packets ─► Listener ─► Utterance ─► recognition ─► understanding ─► DeviceChat turn
    (hub: listen,     decode,      16 kHz PCM   bounded pool,   the readings   (backend/dialogue)
     audio, abort)    endpoint                  early guess     agree? sure?        │
                                                                                    ▼
    downlink frames ◄── SpokenAnswer (backend/voice/speech.py) ◄── sentences of the answer
                        synthesize, encode, playout clock

`VoiceService` keeps a `Listener` for each device that has started listening (at most
`voice_max_sessions`). A finished `Utterance` is recognized (one at a time per device: a newer
one replaces an older one still waiting) and handed to the dialogue as a turn; the dialogue asks
this service for each turn's spoken `Answer`. While the silence wait runs, the utterance as it
would end is recognized early when the recognizer is idle; if the utterance ends with the same
audio, that result is used and the wait costs nothing more.

What the user hears when recognition cannot help: "One moment." when their utterance waits
behind others for more than `ONE_MOMENT_S`; an apology when the queue is full; "Sorry, I did
not catch that" when nothing was understood. Speech detected while the bridge speaks in
realtime mode interrupts the answer (barge-in). A channel that hears nothing for
`voice_idle_close_s` is closed with a goodbye.

`VoiceUnavailableNotice` stands in when the voice packages are missing or voice is off: a
device that starts talking is told why it gets no spoken answer, and so is the operator's log.
"""

import asyncio
import contextlib
import ctypes
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from backend.common import Lru
from backend.config import Settings
from backend.devices import DeviceRegistry
from backend.devices.conversation import Conversation, ConversationHub, Unsubscribe
from backend.dialogue import Answer, DeviceChat, TurnTimings
from backend.errors import BridgeError
from backend.logs import DeviceBudgets, LogBudget
from backend.protocol import Abort, AudioFrame, Listen
from backend.voice.language import effective_language
from backend.voice.listener import Listener, ListenLimits, Utterance
from backend.voice.recognition import (
    RecognitionFailed,
    RecognitionHints,
    Recognizer,
    RecognizerBusy,
    Transcript,
)
from backend.voice.speech import Pacing, SpokenAnswer
from backend.voice.tts import Synthesizer
from backend.voice.understanding import DeviceWords, Understanding
from backend.voice.vad import SileroPool

log = structlog.get_logger("voice")

NOT_UNDERSTOOD = "Sorry, I did not catch that. Please say it again."
GOODBYE = "Goodbye."
BUSY = "Sorry, I cannot listen right now. Please try again in a moment."
TOO_BUSY = "Sorry, I am busy right now. Please say that again in a moment."
ONE_MOMENT = "One moment."
ONE_MOMENT_S = 1.0  # a wait for the recognizer longer than this is announced
IDLE_CHECK_S = 1.0
RELEASE_EVERY_S = 5.0  # freed heap handed back to the system at most this often


def _glibc() -> Any:
    """glibc, for `malloc_trim` (None elsewhere: musl and macOS return freed memory)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()
PROMPTS_KEPT = 32  # recognizer prompts of this many device models (tool sets)

PromptFor = Callable[[list[Any]], str]


class _Recognition:
    """One device's utterance being recognized: the task, and the audio it hears."""

    def __init__(self, pcm: bytes, task: "asyncio.Task[Transcript]") -> None:
        self.pcm = pcm
        self.task = task


class VoiceService:
    """The voice path: a `Listener` per talking device, recognition, spoken answers."""

    def __init__(
        self,
        settings: Settings,
        hub: ConversationHub,
        registry: DeviceRegistry,
        device_chat: DeviceChat,
        recognizer: Recognizer,
        synthesizer: Synthesizer,
        prompt_for: PromptFor | None = None,
    ) -> None:
        self.settings = settings
        self.hub = hub
        self.registry = registry
        self.device_chat = device_chat
        self.recognizer = recognizer
        self.synthesizer = synthesizer
        self._prompt_for = prompt_for
        self._prompts: Lru[str, str] = Lru(PROMPTS_KEPT)
        self.understanding = Understanding()
        self._device_words: Lru[str, DeviceWords] = Lru(PROMPTS_KEPT)
        self.pool = SileroPool(settings.voice_max_sessions)
        self.pacing = Pacing(settings.voice_lead_frames, settings.voice_stop_margin_ms / 1000)
        self._limits = ListenLimits(
            settings.voice_silence_ms, settings.voice_max_utterance_s * 1000
        )
        self.listeners: dict[str, Listener] = {}
        self._recognizing: dict[str, _Recognition] = {}  # per device: the latest utterance
        self._early: dict[str, _Recognition] = {}  # per device: a guess made during the pause
        self.answers: deque[SpokenAnswer] = deque(maxlen=64)  # the last few, for benchmarks
        self.languages: Callable[[str], str | None] = lambda _device_id: None
        self._unsubscribe: list[Unsubscribe] = []
        self._logs = DeviceBudgets(burst=5)
        self._idle_task: asyncio.Task[None] | None = None
        self._released_at = -RELEASE_EVERY_S
        device_chat.voice = self

    async def start(self) -> None:
        """Load the models, subscribe to the devices and start the idle watch."""
        await self.recognizer.start()
        self._unsubscribe = [
            self.hub.on_listen(self._on_listen),
            self.hub.on_audio(self._on_audio),
            self.hub.on_abort(self._on_abort),
            self.hub.on_ended(self._on_ended),
        ]
        self.pool.warm()
        self._idle_task = asyncio.get_running_loop().create_task(
            self._close_idle_channels(), name="voice-idle"
        )

    async def stop(self) -> None:
        """Unsubscribe, stop the idle watch, close every listener and the engines."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        if self._idle_task is not None:
            self._idle_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle_task
        for listener in self.listeners.values():
            listener.close()
        self.listeners.clear()
        pending = [r.task for r in (*self._recognizing.values(), *self._early.values())]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.pool.close()
        await self.recognizer.aclose()
        await self.synthesizer.aclose()

    # ---- the dialogue's side ----------------------------------------------------------------

    def answer_for(self, conversation: Conversation, timings: TurnTimings) -> Answer | None:
        """The spoken `Answer` of a turn on this conversation (the dialogue calls it per turn)."""
        answer = SpokenAnswer(conversation, self.synthesizer, self.pacing, timings)
        self.answers.append(answer)
        return answer

    # ---- hub handlers -----------------------------------------------------------------------

    def _on_listen(self, conversation: Conversation, listen: Listen) -> None:
        listener = self.listeners.get(conversation.device_id)
        if listen.state == "start":
            listener = listener or self._open(conversation)
            if listener is not None:
                listener.start(listen.mode or "auto")
        elif listener is not None:
            listener.stop() if listen.state == "stop" else listener.detect()

    def _on_audio(self, conversation: Conversation, frame: AudioFrame) -> None:
        listener = self.listeners.get(conversation.device_id)
        if listener is None:
            self._log(conversation.device_id).info(
                "audio without listen start dropped", device_id=conversation.device_id
            )
            return
        listener.audio(frame.payload, self.device_chat.speaking(conversation.device_id))

    def _on_abort(self, conversation: Conversation, _abort: Abort) -> None:
        listener = self.listeners.get(conversation.device_id)
        if listener is not None:
            listener.abort()
        self._cancel_recognition(conversation.device_id)

    def _on_ended(self, conversation: Conversation, _reason: str) -> None:
        listener = self.listeners.pop(conversation.device_id, None)
        if listener is not None:
            listener.close()
            if not self.listeners:
                self._release_memory()
        self._cancel_recognition(conversation.device_id)
        self._logs.flush(conversation.device_id)

    def _release_memory(self) -> None:
        """The last talker left: hand the heap it freed back to the system. glibc keeps freed
        blocks for reuse, so after 50 talkers the bridge stayed 44 MB above its baseline with
        nothing live in it (bench/voice.py); at most once per `RELEASE_EVERY_S`."""
        now = time.monotonic()
        if now - self._released_at < RELEASE_EVERY_S or _LIBC is None:
            return
        self._released_at = now
        _LIBC.malloc_trim(0)

    # ---- listeners --------------------------------------------------------------------------

    def _open(self, conversation: Conversation) -> Listener | None:
        device_id = conversation.device_id
        if len(self.listeners) >= self.settings.voice_max_sessions:
            self._log(device_id).warning(
                "voice session refused: too many talking devices",
                device_id=device_id,
                max_sessions=self.settings.voice_max_sessions,
            )
            self.device_chat.say(conversation, BUSY, "sad")
            return None
        listener = Listener(
            conversation,
            self.pool,
            self._limits,
            on_utterance=lambda utterance: self._on_utterance(conversation, utterance),
            on_speech=lambda: self._on_speech(device_id),
            on_pause=lambda utterance: self._on_pause(conversation, utterance),
            log=self._log(device_id),
        )
        self.listeners[device_id] = listener
        return listener

    def _on_speech(self, device_id: str) -> None:
        self._drop_early(device_id)  # the pause was not the end
        listener = self.listeners.get(device_id)
        realtime = listener is not None and listener.mode == "realtime"
        if realtime and self.device_chat.speaking(device_id):
            self.device_chat.interrupt(device_id, "interrupted by speech (barge-in)")

    # ---- recognition ------------------------------------------------------------------------

    def hints(self, device_id: str) -> RecognitionHints:
        """The prompt and language the recognizer hears this device's utterances with: the
        device's setting (`languages`, None for "auto"), else the bridge's `asr_language`, else
        the language of its last turn, else English."""
        language = effective_language(
            self.languages(device_id),
            self.settings.asr_language,
            self.device_chat.language_of(device_id),
        )
        return RecognitionHints(self._prompt(device_id), language)

    def _prompt(self, device_id: str) -> str:
        if self._prompt_for is None:
            return ""
        try:
            tool_set = self.registry.require(device_id).tools
        except BridgeError:
            return self._prompt_for([])
        prompt = self._prompts.get(tool_set.digest)
        if prompt is None:  # devices of one model share their tool set: built once
            prompt = self._prompt_for(list(tool_set.tools))
            self._prompts.put(tool_set.digest, prompt)
        return prompt

    def _settled(self, device_id: str, transcript: Transcript) -> Transcript:
        """The transcript checked against its other readings (`understanding.settle`)."""
        try:
            device = self.registry.require(device_id)
        except BridgeError:
            return transcript
        words = self._device_words.get(device.tools.digest)
        if words is None:
            words = DeviceWords.of(device.tool_list(include_user_only=False))
            self._device_words.put(device.tools.digest, words)
        return self.understanding.settle(transcript, words)

    def _on_pause(self, conversation: Conversation, utterance: Utterance) -> None:
        """The user paused: recognize what was said so far, if the recognizer is idle."""
        device_id = conversation.device_id
        if self.recognizer.backlog_s() > 0 or device_id in self._early:
            return
        task = self._recognize_task(device_id, utterance.pcm, "early")
        self._early[device_id] = _Recognition(utterance.pcm, task)

    def _on_utterance(self, conversation: Conversation, utterance: Utterance) -> None:
        device_id = conversation.device_id
        self._cancel_recognition(device_id, keep_early=True)
        early = self._early.pop(device_id, None)
        if early is not None and early.pcm == utterance.pcm:
            task = early.task  # the pause was the end: its guess is the answer
        else:
            if early is not None:
                early.task.cancel()
            long_wait = self.recognizer.backlog_s() > ONE_MOMENT_S
            task = self._recognize_task(device_id, utterance.pcm, "final")
            if long_wait:  # after the task's first step: a full queue refuses it there
                asyncio.get_running_loop().call_soon(self._one_moment, conversation, task)
        self._recognizing[device_id] = _Recognition(utterance.pcm, task)
        task.add_done_callback(lambda done: self._heard(conversation, utterance, done))

    def _one_moment(self, conversation: Conversation, task: "asyncio.Task[Transcript]") -> None:
        """A long wait is announced only for an utterance the recognizer took: a refused one
        hears the apology alone."""
        if not task.done():
            self.device_chat.say(conversation, ONE_MOMENT, "thinking")

    def _recognize_task(self, device_id: str, pcm: bytes, kind: str) -> "asyncio.Task[Transcript]":
        hints = self.hints(device_id)
        return asyncio.get_running_loop().create_task(
            self.recognizer.recognize(pcm, hints), name=f"voice-asr-{kind} {device_id}"
        )

    def _heard(
        self, conversation: Conversation, utterance: Utterance, task: "asyncio.Task[Transcript]"
    ) -> None:
        device_id = conversation.device_id
        current = self._recognizing.get(device_id)
        if current is not None and current.task is task:
            del self._recognizing[device_id]
        if task.cancelled():
            return
        timings = utterance.timings
        timings.mark("recognized")
        error = task.exception()
        if isinstance(error, RecognizerBusy):
            self._log(device_id).warning(
                "utterance refused: the recognizer is busy", device_id=device_id
            )
            self.device_chat.say(conversation, TOO_BUSY, "sad")
            return
        if isinstance(error, RecognitionFailed):
            self._log(device_id).warning(
                "utterance not recognized", device_id=device_id, error=str(error)
            )
            self.device_chat.say(conversation, NOT_UNDERSTOOD, "confused")
            return
        if error is not None:
            log.error("recognition failed", device_id=device_id, exc_info=error)
            self.device_chat.say(conversation, NOT_UNDERSTOOD, "confused")
            return
        self._answer(conversation, task.result(), utterance)

    def _answer(
        self, conversation: Conversation, transcript: Transcript, utterance: Utterance
    ) -> None:
        best = transcript.text
        transcript = self._settled(conversation.device_id, transcript)
        text = transcript.text.strip()
        log.info(
            "utterance recognized",
            device_id=conversation.device_id,
            engine=transcript.engine,
            language=transcript.language,
            chars=len(text),
            sure=transcript.sure,
            other_reading=transcript.text != best,
            confidence=transcript.confidence,
            audio_ms=round(utterance.duration_ms),
            ended_by=utterance.why,
            fallback_reason=transcript.fallback_reason,
            **utterance.timings.report(),
        )
        if not text:
            self.device_chat.say(conversation, NOT_UNDERSTOOD, "confused")
            return
        self.device_chat.start_turn(
            conversation,
            text,
            utterance.timings,
            unsure=not transcript.sure,
            language=transcript.language,
        )

    def _cancel_recognition(self, device_id: str, *, keep_early: bool = False) -> None:
        current = self._recognizing.pop(device_id, None)
        if current is not None:
            current.task.cancel()
        if not keep_early:
            self._drop_early(device_id)

    def _drop_early(self, device_id: str) -> None:
        early = self._early.pop(device_id, None)
        if early is not None:
            early.task.cancel()

    # ---- idle channels ----------------------------------------------------------------------

    async def _close_idle_channels(self) -> None:
        idle_s = self.settings.voice_idle_close_s
        while True:
            await asyncio.sleep(min(IDLE_CHECK_S, idle_s))
            now = time.monotonic()
            for device_id, listener in list(self.listeners.items()):
                busy = (
                    self.device_chat.running(device_id) is not None
                    or device_id in self._recognizing
                )
                if busy:
                    listener.last_heard = now
                elif listener.listening and now - listener.last_heard >= idle_s:
                    listener.listening = False
                    self._goodbye(listener.conversation)

    def _goodbye(self, conversation: Conversation) -> None:
        log.info("voice channel idle; closing", device_id=conversation.device_id)
        turn = self.device_chat.say(conversation, GOODBYE, "neutral")

        def end(task: asyncio.Task[None]) -> None:
            if not task.cancelled():
                asyncio.get_running_loop().create_task(_end_quietly(conversation))

        turn.add_done_callback(end)

    def _log(self, device_id: str) -> LogBudget:
        return self._logs.get(device_id, log)


async def _end_quietly(conversation: Conversation) -> None:
    with contextlib.suppress(BridgeError):
        await conversation.goodbye()


class VoiceUnavailableNotice:
    """Tells a device that starts talking (and the operator, once) why it gets no voice."""

    def __init__(self, hub: ConversationHub, reason: str) -> None:
        self.hub = hub
        self.reason = reason
        self._told: set[str] = set()
        self._unsubscribe: list[Unsubscribe] = []
        self._logged = False

    async def start(self) -> None:
        """Subscribe to the devices' listen messages."""
        self._unsubscribe = [
            self.hub.on_listen(self._on_listen),
            self.hub.on_ended(
                lambda conversation, _reason: self._told.discard(conversation.device_id)
            ),
        ]

    async def stop(self) -> None:
        """Unsubscribe."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()

    async def _on_listen(self, conversation: Conversation, listen: Listen) -> None:
        if listen.state != "start" or conversation.device_id in self._told:
            return
        self._told.add(conversation.device_id)
        if not self._logged:
            self._logged = True
            log.warning("a device started talking but voice is unavailable", reason=self.reason)
        with contextlib.suppress(BridgeError):
            await conversation.send_alert("voice unavailable", self.reason, "sad")
