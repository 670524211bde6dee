"""The device conversation API: what the chat and voice pipelines use to talk with a device.

A pipeline never touches a transport or a session. It subscribes to what devices say
(`ConversationHub.on_listen`, `on_abort`, `on_audio`, `on_opened`, `on_ended`) and answers through
the `Conversation` it is handed, whose typed methods send `stt`, `llm`, `tts`, `alert`, `system`,
audio and `goodbye` with the current `session_id` filled in, over whichever transport carries
that device (WebSocket frames, or MQTT messages and UDP audio).

Handlers may be plain functions or coroutine functions; the session runs coroutines as tasks it
owns (cancelled when the link goes), so a slow handler never holds up the device's link.
"""

from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

import structlog

from backend.protocol import (
    Abort,
    Alert,
    AudioFrame,
    AudioParams,
    DeviceHello,
    Listen,
    Llm,
    ServerMessage,
    Stt,
    System,
    Tts,
)

log = structlog.get_logger("conversation")

HandlerResult = Awaitable[None] | None
ListenHandler = Callable[["Conversation", Listen], HandlerResult]
AbortHandler = Callable[["Conversation", Abort], HandlerResult]
OpenedHandler = Callable[["Conversation", DeviceHello], HandlerResult]
EndedHandler = Callable[["Conversation", str], None]
AudioHandler = Callable[["Conversation", AudioFrame], None]
Unsubscribe = Callable[[], None]


class ConversationOutbox(Protocol):
    """What a `Conversation` needs from the session that carries it."""

    @property
    def session_id(self) -> str:
        """The session id the device was handed in its hello reply."""

    @property
    def device_hello(self) -> DeviceHello | None:
        """The device's hello, or None before it said hello."""

    @property
    def downlink_audio(self) -> AudioParams:
        """The audio format the bridge sends to the device."""

    async def send_message(self, message: ServerMessage) -> None:
        """Send one JSON message over the device's transport."""

    async def send_audio(self, frame: AudioFrame) -> None:
        """Send one encoded audio frame over the device's audio channel."""

    async def end_conversation(self) -> None:
        """End the conversation the way the transport does it (goodbye, or closing a
        per-conversation link)."""


class Conversation:
    """One device's conversation as a pipeline sees it. Methods raise `LinkClosed` when the
    device is gone; nothing else."""

    __slots__ = ("_outbox", "device_id")

    def __init__(self, device_id: str, outbox: ConversationOutbox) -> None:
        self.device_id = device_id
        self._outbox = outbox

    @property
    def session_id(self) -> str:
        """The current session id, filled into every message sent."""
        return self._outbox.session_id

    @property
    def uplink_audio(self) -> AudioParams | None:
        """The device's microphone audio parameters from its hello (None before any hello)."""
        hello = self._outbox.device_hello
        return hello.audio_params if hello is not None else None

    @property
    def downlink_audio(self) -> AudioParams:
        """The downlink format and rate the server hello announced to this device."""
        return self._outbox.downlink_audio

    async def send_stt(self, text: str) -> None:
        """What the device heard (shown on its screen)."""
        await self._outbox.send_message(Stt(session_id=self.session_id, text=text))

    async def send_llm(self, emotion: str, text: str | None = None) -> None:
        """The assistant's emotion (an emoji name such as "happy") for the device's display."""
        await self._outbox.send_message(Llm(session_id=self.session_id, emotion=emotion, text=text))

    async def send_tts_start(self) -> None:
        """The device enters `speaking`; send this before any audio."""
        await self._send_tts("start")

    async def send_tts_sentence(self, text: str) -> None:
        """The sentence being spoken next (shown on the device's screen)."""
        await self._send_tts("sentence_start", text)

    async def send_tts_stop(self) -> None:
        """Speaking is over; the device goes back to listening (or idle in manual mode)."""
        await self._send_tts("stop")

    async def send_alert(self, status: str, message: str, emotion: str = "neutral") -> None:
        """Show an alert (status line, message, emotion) on the device."""
        await self._outbox.send_message(
            Alert(session_id=self.session_id, status=status, message=message, emotion=emotion)
        )

    async def send_system(self, command: str) -> None:
        """A system command such as "reboot"."""
        await self._outbox.send_message(System(session_id=self.session_id, command=command))

    async def send_audio(self, payload: bytes, timestamp_ms: int = 0) -> None:
        """One downlink Opus packet; the transport frames it for this device."""
        await self._outbox.send_audio(AudioFrame(payload, timestamp_ms))

    async def goodbye(self) -> None:
        """End the conversation: `goodbye` on MQTT, closing the link on WebSocket."""
        await self._outbox.end_conversation()

    async def _send_tts(
        self, state: Literal["start", "sentence_start", "stop"], text: str | None = None
    ) -> None:
        await self._outbox.send_message(Tts(session_id=self.session_id, state=state, text=text))


class ConversationSource(Protocol):
    """Where the hub finds the conversation of a live device (the registry)."""

    def conversation_of(self, device_id: str) -> Conversation:
        """The `Conversation` of a live device; raises a device-layer error otherwise."""


class ConversationHub:
    """Subscriptions to what every device says; the sessions dispatch into it."""

    def __init__(self, source: ConversationSource) -> None:
        self._source = source
        self._listen: list[ListenHandler] = []
        self._abort: list[AbortHandler] = []
        self._opened: list[OpenedHandler] = []
        self._ended: list[EndedHandler] = []
        self._audio: list[AudioHandler] = []

    def on_listen(self, handler: ListenHandler) -> Unsubscribe:
        """`listen` messages (start/stop/detect; `detect` with `text` is typed input)."""
        return _add(self._listen, handler)

    def on_abort(self, handler: AbortHandler) -> Unsubscribe:
        """Subscribe to the devices' `abort` messages (the user interrupted the reply)."""
        return _add(self._abort, handler)

    def on_opened(self, handler: OpenedHandler) -> Unsubscribe:
        """A conversation opened: the device's hello was answered."""
        return _add(self._opened, handler)

    def on_ended(self, handler: EndedHandler) -> Unsubscribe:
        """A conversation ended (goodbye, or the link went away); the reason is given."""
        return _add(self._ended, handler)

    def on_audio(self, handler: AudioHandler) -> Unsubscribe:
        """Uplink audio packets (called on the hot path: handlers must not block)."""
        return _add(self._audio, handler)

    def conversation(self, device_id: str) -> Conversation:
        """The live device's conversation; raises UnknownDevice or DeviceOffline."""
        return self._source.conversation_of(device_id)

    @property
    def wants_audio(self) -> bool:
        """Whether any audio handler is subscribed (sessions drop uplink audio otherwise)."""
        return bool(self._audio)

    # ---- dispatch (called by sessions) --------------------------------------------------------

    def listen_handlers(self) -> list[ListenHandler]:
        """A snapshot of the `listen` handlers, safe to iterate while they unsubscribe."""
        return list(self._listen)

    def abort_handlers(self) -> list[AbortHandler]:
        """A snapshot of the `abort` handlers."""
        return list(self._abort)

    def opened_handlers(self) -> list[OpenedHandler]:
        """A snapshot of the handlers told when a device's audio channel opens."""
        return list(self._opened)

    def dispatch_ended(self, conversation: Conversation, reason: str) -> None:
        """Tell every ended handler; one handler's exception is logged, not passed on."""
        for handler in list(self._ended):
            _call_quietly(handler, conversation, reason)

    def dispatch_audio(self, conversation: Conversation, frame: AudioFrame) -> None:
        """Hand one uplink frame to every audio handler; their exceptions are logged, not raised."""
        for handler in self._audio:
            _call_quietly(handler, conversation, frame)


def _add(handlers: list[Any], handler: Any) -> Unsubscribe:
    handlers.append(handler)

    def unsubscribe() -> None:
        if handler in handlers:
            handlers.remove(handler)

    return unsubscribe


def _call_quietly(handler: Callable[..., Any], *args: Any) -> None:
    try:
        handler(*args)
    except Exception:  # a pipeline's bug must not take a device link down
        log.exception("conversation handler failed", handler=getattr(handler, "__name__", "?"))
