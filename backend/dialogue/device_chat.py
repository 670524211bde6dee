"""Device turns: typed or spoken input becomes a chat turn, answered on the device.

A `listen` with `state: "detect"` and `text` (what the stock firmware sends for a wake word or
typed text; lone surrogates replaced by U+FFFD), or an utterance the voice loop recognized
(`start_turn`), starts a turn in that device's own conversation (`device_conversation_id`,
which survives reconnects and restarts), with that device's tools (`DeviceToolBox`, full
permission: the device asked). The answer goes back through the conversation API:

1. `stt {text}` at once (the device shows what it heard while the turn runs);
2. when the first sentence of the answer is complete: `llm {emotion}` and `tts start`. The
   emotion reflects what is known then: `sad` when a device tool failed or reported an error,
   `confused` when the request was refused as off-topic, `thinking` for an offline (no model)
   answer to a question, else `happy` (answers that come in one piece, the offline and refusal
   paths, are complete before they are spoken, so their outcome is always known);
3. one `tts sentence_start {text}` per sentence as the answer streams (never the sources
   section) — with audio when the voice loop is on (`Answer` is then a `SpokenAnswer`, paced
   frames between the sentence marks) — and `tts stop`. The sentences are the answer as a
   voice says it (`Token.spoken`): text for screens only, the offline note "(Offline mode:
   …)", is left out with or without audio (`tts sentence_start` is the stock device's caption
   of what it says, and a caption of something never said would puzzle), and a confirmed
   call is "Volume set to 30.", not "Done: self.audio_speaker.set_volume → true". The stored
   answer and the API's keep the text as written.

One turn at a time per device: a new turn while one runs **cancels** the old one (the user
spoke again, so the old answer is stale; its memory is not written) and, if it was already
speaking, its downlink stops at once and it sends `tts stop` before the new turn's `stt`. An
`abort` from the device cancels the running turn the same way; a device that goes away cancels
its turn silently.
"""

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import structlog

from backend.chat import (
    MAX_QUERY_CHARS,
    AskBeforeChanging,
    ChatEvent,
    ChatService,
    DeviceToolBox,
    Done,
    Sources,
    Token,
    ToolBox,
    ToolCompleted,
    ToolFailed,
    TurnRequest,
)
from backend.chat.language import detect_language
from backend.chat.text import NOT_AN_END, replace_surrogates, sentences
from backend.common import Lru
from backend.devices import DeviceRegistry
from backend.devices.conversation import Conversation as DeviceConversation
from backend.devices.conversation import ConversationHub, Unsubscribe
from backend.devices.state import EventKind
from backend.dialogue.timings import TurnTimings
from backend.errors import BridgeError
from backend.logs import DeviceBudgets, LogBudget
from backend.mcp_servers.hub import McpServerHub
from backend.metrics import record_voice_turn
from backend.protocol import Abort, Listen

log = structlog.get_logger("device_chat")

SORRY = "Sorry, something went wrong. Please try again."
LANGUAGES_KEPT = 10_000  # devices whose last turn's language is remembered
# A sentence end (as `backend.chat.text.sentences` splits) with more text after it.
_FOLLOWED_SENTENCE_END = re.compile(rf"(?:(?<=[.!?…]){NOT_AN_END}\s+|\n+)(?=\S)")
_MARKDOWN = re.compile(r"[*`#]+|^\s*[-•]\s+", re.MULTILINE)


# Stock firmware reports its wake word as `listen detect` text before every conversation.
WAKE_WORDS = frozenset(
    {"你好小智", "你好小志", "小智", "你好小明", "hi esp", "hey esp", "hi lexin", "ni hao xiao zhi",
     "xin chao xiao zhi", "hey xiaozhi", "hi xiaozhi", "alexa", "jarvis"}
)  # fmt: skip


def is_wake_word(text: str) -> bool:
    """The text, without punctuation and case, is one of the stock wake words."""
    plain = "".join(ch for ch in text.casefold() if ch.isalnum() or ch.isspace()).strip()
    return " ".join(plain.split()) in WAKE_WORDS


def emotion_for(events: list[ChatEvent]) -> str:
    """The device's emotion for a finished turn."""
    done = next((event for event in events if isinstance(event, Done)), None)
    if any(
        isinstance(event, ToolFailed) or (isinstance(event, ToolCompleted) and event.is_error)
        for event in events
    ):
        return "sad"
    if done is not None and done.metadata.guardrail.verdict == "refused":
        return "confused"
    if done is not None and done.metadata.offline and done.metadata.sources:
        return "thinking"
    return "happy"


def spoken_sentences(events: list[ChatEvent]) -> list[str]:
    """The sentences to show/speak: the answer's tokens as said (not the sources, not text for
    screens only), without Markdown."""
    text = "".join(event.spoken for event in events if isinstance(event, Token))
    return sentences(_MARKDOWN.sub("", text))


class SentenceStream:
    """Complete sentences out of streamed text: a sentence is complete once text follows its
    end mark, so it can be spoken while the rest of the answer is still being written."""

    def __init__(self) -> None:
        self._text = ""

    def feed(self, text: str) -> list[str]:
        """Add streamed text; the sentences it completed (one that may go on is held back)."""
        self._text += text
        ends = list(_FOLLOWED_SENTENCE_END.finditer(self._text))
        if not ends:
            return []
        last = ends[-1]
        done, self._text = self._text[: last.start()], self._text[last.end() :]
        return sentences(_MARKDOWN.sub("", done))

    def flush(self) -> list[str]:
        """The text held back, as sentences (the answer ended)."""
        rest, self._text = self._text, ""
        return sentences(_MARKDOWN.sub("", rest))


class Answer(Protocol):
    """How a turn's answer reaches the device: text on its screen, or paced speech."""

    begun: bool
    stopped: bool  # `tts stop` went out: the device listens again

    async def begin(self, emotion: str) -> None:
        """The answer starts: show its emotion and start speaking."""

    async def say(self, sentence: str) -> None:
        """Speak (or show) one sentence of the answer."""

    async def finish(self) -> None:
        """The answer is complete: end it once everything said has played."""

    def halt(self) -> None:
        """Stop the downlink at once (abort, barge-in); nothing leaves after it returns."""

    async def stop(self) -> None:
        """Halt and tell the device the answer is over."""


class TextAnswer:
    """Sentences on the device's screen, no audio (no voice loop, or voice turned off)."""

    def __init__(self, conversation: DeviceConversation) -> None:
        self._conversation = conversation
        self.begun = False
        self.stopped = False

    async def begin(self, emotion: str) -> None:
        """Send the emotion and `tts start`."""
        self.begun = True
        await self._conversation.send_llm(emotion)
        await self._conversation.send_tts_start()

    async def say(self, sentence: str) -> None:
        """Send the sentence as `tts sentence_start` (the device shows it)."""
        await self._conversation.send_tts_sentence(sentence)

    async def finish(self) -> None:
        """Nothing plays: end at once."""
        await self.stop()

    def halt(self) -> None:
        """Nothing is queued to halt."""
        pass

    async def stop(self) -> None:
        """Send `tts stop` once if the answer began; a gone link is not an error."""
        if self.begun and not self.stopped:
            self.stopped = True
            with contextlib.suppress(BridgeError):
                await self._conversation.send_tts_stop()


class VoiceOutput(Protocol):
    """The voice loop's side of a turn: a spoken answer for the device, or None for text."""

    def answer_for(self, conversation: DeviceConversation, timings: TurnTimings) -> Answer | None:
        """A spoken answer for this turn, or None to answer in text."""


class DeviceChat:
    """Subscribes to the conversation hub; one chat turn task per device at a time."""

    def __init__(
        self,
        hub: ConversationHub,
        registry: DeviceRegistry,
        chat: ChatService,
        servers: McpServerHub | None = None,
        voice: VoiceOutput | None = None,
    ) -> None:
        self.hub = hub
        self.registry = registry
        self.chat = chat
        self.servers = servers  # external MCP servers: those bound to a device or to all join
        self.voice = voice
        self._turns: dict[str, asyncio.Task[None]] = {}
        self._answers: dict[str, Answer] = {}
        # The language of each device's last turn (outlives its links: a stock device connects
        # anew for each conversation); the voice path's "auto" language reads it.
        self._languages: Lru[str, str] = Lru(LANGUAGES_KEPT)
        self._unsubscribe: list[Unsubscribe] = []
        # Per device: a device that keeps detecting and aborting costs a few lines, then counts.
        self._logs = DeviceBudgets(burst=5)  # outlives links: reconnecting buys no fresh burst

    def start(self) -> None:
        """Subscribe to the devices' listen, abort and end messages."""
        self._unsubscribe = [
            self.hub.on_listen(self._on_listen),
            self.hub.on_abort(self._on_abort),
            self.hub.on_ended(self._on_ended),
        ]

    async def stop(self) -> None:
        """Unsubscribe and cancel the turns in progress."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        turns = list(self._turns.values())
        for task in turns:
            task.cancel()
        await asyncio.gather(*turns, return_exceptions=True)
        self._turns.clear()

    def running(self, device_id: str) -> asyncio.Task[None] | None:
        """The device's running turn, if any (for tests and diagnostics)."""
        task = self._turns.get(device_id)
        return task if task is not None and not task.done() else None

    def speaking(self, device_id: str) -> bool:
        """The device's answer has begun, its `tts stop` has not gone out, and its turn still
        runs. A device answers `tts stop` with `listen start` and speech at once, while the
        turn may still be logging: that speech is a question, not echo."""
        answer = self._answers.get(device_id)
        return (
            answer is not None
            and answer.begun
            and not answer.stopped
            and self.running(device_id) is not None
        )

    def start_turn(
        self,
        conversation: DeviceConversation,
        text: str,
        timings: TurnTimings | None = None,
        *,
        unsure: bool = False,
        language: str | None = None,
    ) -> asyncio.Task[None]:
        """Answer `text` (typed or recognized) on the device, replacing its running turn.
        `unsure`: the recognizer doubted the words, so nothing on the device changes without
        the user's "yes" (`AskBeforeChanging`). `language`: the language the recognizer heard
        it in, which the device's next utterance is heard in when its setting is "auto" (None:
        guessed from the text, as for typed turns; an English recognizer's garbled reading of
        other speech must not switch the device to another recognizer)."""
        return self._replace_turn(
            conversation, lambda: self._turn(conversation, text, timings, unsure, language)
        )

    def language_of(self, device_id: str) -> str | None:
        """The language of the device's last turn ("en", "vi"), None before its first."""
        return self._languages.get(device_id)

    def _note_language(self, device_id: str, text: str, heard_in: str | None) -> None:
        self._languages.put(device_id, heard_in or detect_language(text))

    def say(
        self, conversation: DeviceConversation, text: str, emotion: str = "neutral"
    ) -> asyncio.Task[None]:
        """Speak a fixed line outside the chat (an apology, a goodbye), as a turn of its own."""
        return self._replace_turn(conversation, lambda: self._announce(conversation, text, emotion))

    def interrupt(self, device_id: str, why: str) -> None:
        """Stop the device's running turn now: its downlink stops before this returns."""
        task = self.running(device_id)
        if task is None:
            return
        answer = self._answers.get(device_id)
        if answer is not None:
            answer.halt()
        self._log(device_id).info(f"device turn {why}", device_id=device_id)
        task.cancel()

    # ---- hub handlers (plain functions: the turn runs in a task owned here) -----------------

    def _on_listen(self, conversation: DeviceConversation, listen: Listen) -> None:
        # A device's text is repaired, not refused: a lone surrogate (from a JSON "\ud800"
        # escape) becomes U+FFFD, so the echo, the memory and the model all get valid text.
        text = replace_surrogates((listen.text or "").strip())
        if listen.state != "detect" or not text or is_wake_word(text):
            return  # a wake word is how the device says "I am listening", not a question
        device_id = conversation.device_id
        if len(text) > MAX_QUERY_CHARS:  # no speech recogniser hears that much at once
            self._log(device_id).warning(
                "device question too long; ignored", device_id=device_id, chars=len(text)
            )
            return
        self.start_turn(conversation, text)

    def _on_abort(self, conversation: DeviceConversation, _abort: Abort) -> None:
        self.interrupt(conversation.device_id, "aborted by the device")

    def _on_ended(self, conversation: DeviceConversation, _reason: str) -> None:
        device_id = conversation.device_id
        answer = self._answers.get(device_id)
        if answer is not None:
            answer.halt()
        task = self.running(device_id)
        if task is not None:
            task.cancel()
        self._logs.flush(device_id)

    def _log(self, device_id: str) -> LogBudget:
        return self._logs.get(device_id, log)

    def _replace_turn(
        self, conversation: DeviceConversation, work: Callable[[], Coroutine[Any, Any, None]]
    ) -> asyncio.Task[None]:
        device_id = conversation.device_id
        previous = self.running(device_id)
        if previous is not None:
            self.interrupt(device_id, "replaced by a new one")
        task = asyncio.get_running_loop().create_task(
            self._after(previous, work), name=f"device-turn {device_id}"
        )
        self._turns[device_id] = task
        task.add_done_callback(lambda done: self._forget(device_id, done))
        return task

    @staticmethod
    async def _after(
        previous: asyncio.Task[None] | None, work: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        # `work` is made here, not by the caller: a turn cancelled before it starts (its device
        # left, another turn replaced it) leaves no coroutine that was never awaited.
        if previous is not None:
            await asyncio.wait([previous])  # it sends its own `tts stop` when it was speaking
        await work()

    def _forget(self, device_id: str, task: asyncio.Task[None]) -> None:
        if self._turns.get(device_id) is task:
            del self._turns[device_id]
            self._answers.pop(device_id, None)

    def _answer(self, conversation: DeviceConversation, timings: TurnTimings) -> Answer:
        spoken = self.voice.answer_for(conversation, timings) if self.voice is not None else None
        answer: Answer = spoken if spoken is not None else TextAnswer(conversation)
        self._answers[conversation.device_id] = answer
        return answer

    # ---- one turn ---------------------------------------------------------------------------

    async def _turn(
        self,
        conversation: DeviceConversation,
        text: str,
        timings: TurnTimings | None,
        unsure: bool = False,
        language: str | None = None,
    ) -> None:
        device_id = conversation.device_id
        structlog.contextvars.bind_contextvars(device_id=device_id)
        timings = timings if timings is not None else TurnTimings()
        began = time.perf_counter()
        answer = self._answer(conversation, timings)
        outcome = "cancelled"
        conversation_id: str | None = None
        try:
            await conversation.send_stt(text)
            device = self.registry.require(device_id)
            conversation_id = await self._conversation_id(device_id)
            toolbox: ToolBox | None = DeviceToolBox(device, actor=f"device:{device_id}")
            if self.servers is not None:
                toolbox = self.servers.toolbox_for(None, device_id, toolbox)
            if unsure and toolbox is not None:
                toolbox = AskBeforeChanging(toolbox)
            self._note_language(device_id, text, language)
            request = TurnRequest(
                text=text,
                device_id=device_id,
                conversation_id=conversation_id,
                language=language if language in ("en", "vi") else None,
            )
            events, spoken = await self._speak_stream(request, toolbox, answer, timings)
            done = next((event for event in events if isinstance(event, Done)), None)
            conversation_id = done.metadata.conversation_id if done is not None else None
            if not answer.begun:
                await answer.begin(emotion_for(events))
            await answer.finish()
            outcome = emotion_for(events)
            self._report(device_id, conversation_id, outcome, spoken, began, timings)
        except asyncio.CancelledError:
            await answer.stop()
            raise
        except BridgeError as exc:  # the link closed, the device went offline...
            outcome = "device gone"
            answer.halt()
            log.info("device turn ended early", device_id=device_id, error=str(exc))
        except Exception:
            outcome = "failed"
            log.exception("device turn failed", device_id=device_id)
            await answer.stop()
            await self._apologise(conversation, answer.begun)
        finally:
            if outcome == "cancelled":
                log.info(
                    "device turn cancelled",
                    step="device_turn",
                    device_id=device_id,
                    conversation_id=conversation_id,
                    duration_ms=round((time.perf_counter() - began) * 1000, 3),
                )

    async def _speak_stream(
        self, request: TurnRequest, toolbox: ToolBox | None, answer: Answer, timings: TurnTimings
    ) -> tuple[list[ChatEvent], int]:
        """Run the chat turn, speaking each sentence once the next token or tool event shows
        it complete (so an answer that comes in one piece is spoken knowing its outcome)."""
        events: list[ChatEvent] = []
        stream = SentenceStream()
        ready: list[str] = []
        spoken = 0
        async for event in self.chat.run_turn(request, toolbox):
            events.append(event)
            if isinstance(event, Sources | Done):
                continue  # the end of the answer: its outcome decides the emotion
            await self._say_lines(answer, events, ready)
            spoken += len(ready)
            ready = []
            if isinstance(event, Token):
                timings.mark("first_token")
                ready = stream.feed(event.spoken)
        ready += stream.flush()
        await self._say_lines(answer, events, ready)
        return events, spoken + len(ready)

    @staticmethod
    async def _say_lines(answer: Answer, events: list[ChatEvent], lines: list[str]) -> None:
        for line in lines:
            if not answer.begun:
                await answer.begin(emotion_for(events))
            await answer.say(line)

    def _report(
        self,
        device_id: str,
        conversation_id: str | None,
        emotion: str,
        spoken: int,
        began: float,
        timings: TurnTimings,
    ) -> None:
        report = timings.report()
        log.info(
            "device turn",
            step="device_turn",
            device_id=device_id,
            conversation_id=conversation_id,
            emotion=emotion,
            sentences=spoken,
            duration_ms=round((time.perf_counter() - began) * 1000, 3),
            **report,
        )
        if "end_of_speech_ms" in report:
            record_voice_turn(report)
            self.registry.emit(EventKind.VOICE_TURN, device_id, **report)

    async def _announce(self, conversation: DeviceConversation, text: str, emotion: str) -> None:
        answer = self._answer(conversation, TurnTimings())
        try:
            await answer.begin(emotion)
            await answer.say(text)
            await answer.finish()
        except asyncio.CancelledError:
            await answer.stop()
            raise
        except BridgeError:
            answer.halt()

    async def _conversation_id(self, device_id: str) -> str | None:
        """The device's conversation, settled first so every log line of the turn has it
        (None when memory is unavailable: the turn then runs without it)."""
        try:
            return await self.chat.memory.device_conversation_id(device_id)
        except BridgeError as exc:
            log.warning("device conversation unavailable", device_id=device_id, error=str(exc))
            return None

    async def _apologise(self, conversation: DeviceConversation, speaking: bool) -> None:
        with contextlib.suppress(BridgeError):
            if not speaking:
                await conversation.send_llm("sad")
                await conversation.send_tts_start()
            await conversation.send_tts_sentence(SORRY)
            await conversation.send_tts_stop()
