"""Typed input from a device becomes a chat turn, answered on the device's screen.

A `listen` with `state: "detect"` and `text` (what the stock firmware sends for a wake word or
typed text; lone surrogates replaced by U+FFFD) starts a turn in that device's own
conversation (`device_conversation_id`, which survives reconnects and restarts), with that
device's tools (`DeviceToolBox`, full permission: the device asked). The answer goes back
through the conversation API, in this order:

1. `stt {text}` at once (the device shows what it heard while the turn runs);
2. when the turn is complete: `llm {emotion}`, chosen by outcome: `sad` when a device tool
   failed or reported an error, `confused` when the request was refused as off-topic,
   `thinking` for an offline (no model) answer to a question, else `happy`;
3. `tts start`, one `tts sentence_start {text}` per sentence of the spoken answer (the tokens;
   never the sources section), `tts stop`.

The answer is spoken once the turn is complete rather than sentence by sentence, so the emotion
can reflect the outcome; there is no audio yet, only text on the screen.

One turn at a time per device: a new detect while a turn runs **cancels** the old turn (the user
spoke again, so the old answer is stale; its memory is not written) and, if it was already
speaking, sends it `tts stop` before the new turn's `stt`. An `abort` from the device cancels the
running turn the same way; a device that goes away cancels its turn silently.
"""

import asyncio
import contextlib
import re
import time

import structlog

from backend.chat import (
    MAX_QUERY_CHARS,
    ChatEvent,
    ChatService,
    DeviceToolBox,
    Done,
    Token,
    ToolCompleted,
    ToolFailed,
    TurnRequest,
)
from backend.chat.text import replace_surrogates, sentences
from backend.devices import DeviceRegistry
from backend.devices.conversation import Conversation as DeviceConversation
from backend.devices.conversation import ConversationHub, Unsubscribe
from backend.errors import BridgeError
from backend.logs import DeviceBudgets, LogBudget
from backend.protocol import Abort, Listen

log = structlog.get_logger("device_chat")

SORRY = "Sorry, something went wrong. Please try again."
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
    """The sentences to show/speak: the answer's tokens (not the sources), without Markdown."""
    text = "".join(event.text for event in events if isinstance(event, Token))
    return sentences(_MARKDOWN.sub("", text))


class DeviceChat:
    """Subscribes to the conversation hub; one chat turn task per device at a time."""

    def __init__(self, hub: ConversationHub, registry: DeviceRegistry, chat: ChatService) -> None:
        self.hub = hub
        self.registry = registry
        self.chat = chat
        self._turns: dict[str, asyncio.Task[None]] = {}
        self._unsubscribe: list[Unsubscribe] = []
        # Per device: a device that keeps detecting and aborting costs a few lines, then counts.
        self._logs = DeviceBudgets(burst=5)  # outlives links: reconnecting buys no fresh burst

    def start(self) -> None:
        self._unsubscribe = [
            self.hub.on_listen(self._on_listen),
            self.hub.on_abort(self._on_abort),
            self.hub.on_ended(self._on_ended),
        ]

    async def stop(self) -> None:
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
        previous = self._turns.get(device_id)
        if previous is not None and not previous.done():
            self._log(device_id).info("device turn replaced by a new one", device_id=device_id)
            previous.cancel()
        task = asyncio.get_running_loop().create_task(
            self._turn(conversation, text, previous), name=f"device-turn {device_id}"
        )
        self._turns[device_id] = task
        task.add_done_callback(lambda done: self._forget(device_id, done))

    def _on_abort(self, conversation: DeviceConversation, _abort: Abort) -> None:
        task = self.running(conversation.device_id)
        if task is not None:
            device_id = conversation.device_id
            self._log(device_id).info("device turn aborted by the device", device_id=device_id)
            task.cancel()

    def _on_ended(self, conversation: DeviceConversation, _reason: str) -> None:
        task = self.running(conversation.device_id)
        if task is not None:
            task.cancel()
        self._logs.flush(conversation.device_id)

    def _log(self, device_id: str) -> LogBudget:
        return self._logs.get(device_id, log)

    def _forget(self, device_id: str, task: asyncio.Task[None]) -> None:
        if self._turns.get(device_id) is task:
            del self._turns[device_id]

    # ---- one turn ---------------------------------------------------------------------------

    async def _turn(
        self,
        conversation: DeviceConversation,
        text: str,
        previous: asyncio.Task[None] | None,
    ) -> None:
        device_id = conversation.device_id
        if previous is not None:
            await asyncio.wait([previous])  # it sends its own `tts stop` when it was speaking
        structlog.contextvars.bind_contextvars(device_id=device_id)
        began = time.perf_counter()
        speaking = False
        outcome = "cancelled"
        conversation_id: str | None = None
        try:
            await conversation.send_stt(text)
            device = self.registry.require(device_id)
            conversation_id = await self._conversation_id(device_id)
            request = TurnRequest(
                text=text,
                device_id=device_id,
                conversation_id=conversation_id,
                toolbox=DeviceToolBox(device, actor=f"device:{device_id}"),
            )
            events = [event async for event in self.chat.run_turn(request)]
            done = next((event for event in events if isinstance(event, Done)), None)
            conversation_id = done.metadata.conversation_id if done is not None else None
            emotion = emotion_for(events)
            lines = spoken_sentences(events)
            await conversation.send_llm(emotion)
            await conversation.send_tts_start()
            speaking = True
            for line in lines:
                await conversation.send_tts_sentence(line)
            await conversation.send_tts_stop()
            speaking = False
            outcome = emotion
            log.info(
                "device turn",
                step="device_turn",
                device_id=device_id,
                conversation_id=conversation_id,
                emotion=emotion,
                sentences=len(lines),
                duration_ms=round((time.perf_counter() - began) * 1000, 3),
            )
        except asyncio.CancelledError:
            if speaking:
                with contextlib.suppress(BridgeError):
                    await conversation.send_tts_stop()
            raise
        except BridgeError as exc:  # the link closed, the device went offline...
            outcome = "device gone"
            log.info("device turn ended early", device_id=device_id, error=str(exc))
        except Exception:
            outcome = "failed"
            log.exception("device turn failed", device_id=device_id)
            await self._apologise(conversation, speaking)
        finally:
            if outcome == "cancelled":
                log.info(
                    "device turn cancelled",
                    step="device_turn",
                    device_id=device_id,
                    conversation_id=conversation_id,
                    duration_ms=round((time.perf_counter() - began) * 1000, 3),
                )

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
