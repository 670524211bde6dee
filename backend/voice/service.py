"""The voice loop wired to the device conversation API and the device chat.

`VoiceService` subscribes to what devices say (listen, audio, abort, end) and keeps a
`VoiceSession` for each device that has started listening (at most `voice_max_sessions`). A
recognized utterance becomes a device-chat turn (`DeviceChat.start_turn`); the chat asks this
service for each turn's `Answer` (`answer_for`), which speaks through the synthesizer with the
playout clock. Speech detected while the bridge speaks in realtime mode interrupts the answer
(barge-in). A channel that hears nothing for `voice_idle_close_s` is closed with a goodbye.

`VoiceUnavailableNotice` stands in when the voice packages are missing or voice is off: a
device that starts talking is told why it gets no spoken answer, and so is the operator's log.
"""

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import structlog

from backend.config import Settings
from backend.devices import DeviceRegistry
from backend.devices.conversation import Conversation, ConversationHub, Unsubscribe
from backend.errors import BridgeError
from backend.frontends.device_chat import Answer, DeviceChat
from backend.logs import DeviceBudgets, LogBudget
from backend.protocol import Abort, AudioFrame, Listen
from backend.voice.asr import RecognitionHints, Recognizer, Transcript
from backend.voice.session import SessionLimits, VoiceSession
from backend.voice.speech import Pacing, SpokenAnswer
from backend.voice.timings import TurnTimings
from backend.voice.tts import Synthesizer
from backend.voice.vad import SileroPool

log = structlog.get_logger("voice")

NOT_UNDERSTOOD = "Sorry, I did not catch that. Please say it again."
GOODBYE = "Goodbye."
BUSY = "Sorry, I cannot listen right now. Please try again in a moment."
IDLE_CHECK_S = 1.0
PHRASE_SETS_KEPT = 32  # grammar phrases of this many device models


class VoiceService:
    """The voice loop: a `VoiceSession` per talking device, spoken answers for the device chat."""

    def __init__(
        self,
        settings: Settings,
        hub: ConversationHub,
        registry: DeviceRegistry,
        device_chat: DeviceChat,
        recognizer: Recognizer,
        synthesizer: Synthesizer,
        phrases_for: Any = None,
    ) -> None:
        self.settings = settings
        self.hub = hub
        self.registry = registry
        self.device_chat = device_chat
        self.recognizer = recognizer
        self.synthesizer = synthesizer
        self._phrases_for = phrases_for
        self._phrases: dict[str, Any] = {}
        self.pool = SileroPool(settings.voice_max_sessions)
        self.pacing = Pacing(settings.voice_lead_frames, settings.voice_stop_margin_ms / 1000)
        self._limits = SessionLimits(
            settings.voice_silence_ms, settings.voice_max_utterance_s * 1000
        )
        self.sessions: dict[str, VoiceSession] = {}
        self.answers: deque[SpokenAnswer] = deque(maxlen=64)  # the last few, for benchmarks
        self._unsubscribe: list[Unsubscribe] = []
        self._logs = DeviceBudgets(burst=5)
        self._idle_task: asyncio.Task[None] | None = None
        device_chat.voice = self

    def start(self) -> None:
        """Subscribe to the devices' listen, audio, abort and end, and start the idle watch."""
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
        """Unsubscribe, stop the idle watch, close every session, the recognizer and the
        synthesizer."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        if self._idle_task is not None:
            self._idle_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle_task
        for session in self.sessions.values():
            session.close()
        self.sessions.clear()
        self.pool.close()
        await self.recognizer.aclose()
        await self.synthesizer.aclose()

    # ---- the device chat's side -------------------------------------------------------------

    def answer_for(self, conversation: Conversation, timings: TurnTimings) -> Answer | None:
        """The spoken `Answer` of a chat turn on this conversation (the chat calls it per turn)."""
        answer = SpokenAnswer(conversation, self.synthesizer, self.pacing, timings)
        self.answers.append(answer)
        return answer

    # ---- hub handlers -----------------------------------------------------------------------

    def _on_listen(self, conversation: Conversation, listen: Listen) -> None:
        device_id = conversation.device_id
        session = self.sessions.get(device_id)
        if listen.state == "start":
            session = session or self._open(conversation)
            if session is not None:
                session.start(listen.mode or "auto")
        elif session is not None:
            session.stop() if listen.state == "stop" else session.detect()

    def _on_audio(self, conversation: Conversation, frame: AudioFrame) -> None:
        session = self.sessions.get(conversation.device_id)
        if session is None:
            self._log(conversation.device_id).info(
                "audio without listen start dropped", device_id=conversation.device_id
            )
            return
        session.audio(frame.payload, self.device_chat.speaking(conversation.device_id))

    def _on_abort(self, conversation: Conversation, _abort: Abort) -> None:
        session = self.sessions.get(conversation.device_id)
        if session is not None:
            session.abort()

    def _on_ended(self, conversation: Conversation, _reason: str) -> None:
        session = self.sessions.pop(conversation.device_id, None)
        if session is not None:
            session.close()
        self._logs.flush(conversation.device_id)

    # ---- sessions ---------------------------------------------------------------------------

    def _open(self, conversation: Conversation) -> VoiceSession | None:
        device_id = conversation.device_id
        if len(self.sessions) >= self.settings.voice_max_sessions:
            self._log(device_id).warning(
                "voice session refused: too many talking devices",
                device_id=device_id,
                max_sessions=self.settings.voice_max_sessions,
            )
            self.device_chat.say(conversation, BUSY, "sad")
            return None
        session = VoiceSession(
            conversation,
            self.recognizer,
            self.pool,
            self._limits,
            hints=lambda: self._hints(device_id),
            on_utterance=self._on_utterance,
            on_speech=lambda: self._on_speech(device_id),
            log=self._log(device_id),
        )
        self.sessions[device_id] = session
        return session

    def _hints(self, device_id: str) -> RecognitionHints:
        language = self.settings.asr_language
        if self._phrases_for is None:
            return RecognitionHints((), language)
        try:
            tool_set = self.registry.require(device_id).tools
        except BridgeError:
            return RecognitionHints(self._phrases_for(()), language)
        phrases = self._phrases.get(tool_set.digest)
        if phrases is None:  # devices of one model share their tool set: computed once
            phrases = self._phrases_for(tool_set.tools)
            if len(self._phrases) >= PHRASE_SETS_KEPT:
                del self._phrases[next(iter(self._phrases))]  # the oldest
            self._phrases[tool_set.digest] = phrases
        return RecognitionHints(phrases, language)

    def _on_speech(self, device_id: str) -> None:
        session = self.sessions.get(device_id)
        realtime = session is not None and session.mode == "realtime"
        if realtime and self.device_chat.speaking(device_id):
            self.device_chat.interrupt(device_id, "interrupted by speech (barge-in)")

    def _on_utterance(
        self, conversation: Conversation, transcript: Transcript, timings: TurnTimings
    ) -> None:
        text = transcript.text.strip()
        device_id = conversation.device_id
        log.info(
            "utterance recognized",
            device_id=device_id,
            engine=transcript.engine,
            chars=len(text),
            fallback_reason=transcript.fallback_reason,
            **timings.report(),
        )
        if not text:
            self.device_chat.say(conversation, NOT_UNDERSTOOD, "confused")
            return
        self.device_chat.start_turn(conversation, text, timings)

    async def _close_idle_channels(self) -> None:
        idle_s = self.settings.voice_idle_close_s
        while True:
            await asyncio.sleep(min(IDLE_CHECK_S, idle_s))
            now = time.monotonic()
            for device_id, session in list(self.sessions.items()):
                busy = self.device_chat.running(device_id) is not None
                if busy:
                    session.last_heard = now
                elif session.listening and now - session.last_heard >= idle_s:
                    session.listening = False
                    self._goodbye(session.conversation)

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

    def start(self) -> None:
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
