"""A stock-style xiaozhi voice device: it speaks a clip to the bridge and records what it hears.

Used by the voice tests, the benchmarks and `esp32-bridge simulate`. It behaves like stock
firmware 2.4 (docs: ../shared/reference/xiaozhi-protocol.md): the stock headers and hello,
16 kHz mono 60 ms Opus uplink (VOIP, complexity 0, DTX) or raw PCM16, `listen` messages, and MCP
answered by a small stock tool set (`simulator.device_mcp`). Downlink audio goes through a model
of the device's speaker (`simulator.voice_playback.Playback`: audio only while speaking, a
40-frame queue, the rest dropped, cut at `tts stop`).

    async with VoiceDevice.websocket(url, token, device_id, client_id, version=3) as device:
        reply = await speak_turn(device, clip)            # listen start, speech, wait tts stop
        reply.audio, reply.kinds, reply.counters, reply.stop_margin_ms

    VoiceDevice.websocket(url, token, device_id, client_id, version=1,
                          audio_format="opus"|"pcm16", downlink_sample_rate=None)
    VoiceDevice.mqtt(url, device_id, password, username=None, client_id=None,
                     topic_prefix="xiaozhi", audio_format="opus", downlink_sample_rate=None)
    await device.listen_start(mode="auto"|"manual"|"realtime"); listen_stop(); listen_detect(text)
    await device.abort(reason=None)
    await device.send_speech(clip, realtime=True, trailing_silence_ms=900)
    reply = await device.wait_turn(timeout_s=30)          # VoiceReply, at the next `tts stop`
    device.events / device.frames                         # (monotonic time, message / payload)
    device.server_hello, device.server_audio, device.mcp (tool calls), device.replies
    device.save_wav(path)  (what the speaker played)      device.save_events(path)  (JSON lines)

A turn is everything received from the end of the previous turn (or the connection) up to and
including the next `tts stop`; each turn has its own playback model.
"""

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import opuslib_next
import soxr

from backend.transports.mqtt_topics import build_client_id, device_key
from backend.voice.audio import FRAME_MS, UPLINK_RATE, Clip, frame_samples, split_frames, wav_bytes
from simulator.device_mcp import DeviceMcp
from simulator.voice_links import Link, MqttUdpLink, WebSocketLink
from simulator.voice_playback import Playback, PlaybackCounters

AudioFormat = Literal["opus", "pcm16"]
ListenMode = Literal["auto", "manual", "realtime"]
HELLO_TIMEOUT_S = 10.0  # the firmware's wait for the server hello
DEFAULT_DOWNLINK_RATE = 24000  # the firmware's default when the hello names no rate
MAX_OPUS_FRAME_MS = 120
Event = tuple[float, dict[str, Any]]
Frame = tuple[float, bytes]


class VoiceClientError(Exception):
    """The server did not do what a stock device waits for (hello, `tts stop`, ...)."""


@dataclass(frozen=True)
class ServerAudio:
    """The downlink audio the server hello announced (firmware defaults when absent)."""

    format: str = "opus"
    sample_rate: int = DEFAULT_DOWNLINK_RATE
    frame_duration: int = FRAME_MS

    @classmethod
    def from_hello(cls, hello: dict[str, Any]) -> "ServerAudio":
        params = hello.get("audio_params")
        params = params if isinstance(params, dict) else {}
        rate, duration = params.get("sample_rate"), params.get("frame_duration")
        return cls(
            str(params.get("format") or "opus"),
            rate if isinstance(rate, int) and rate > 0 else DEFAULT_DOWNLINK_RATE,
            duration if isinstance(duration, int) and duration > 0 else FRAME_MS,
        )


# ---- audio -------------------------------------------------------------------------------------


def to_uplink_rate(clip: Clip) -> Clip:
    """The clip at 16 kHz (the microphone's rate)."""
    if clip.sample_rate == UPLINK_RATE:
        return clip
    samples = np.frombuffer(clip.pcm, dtype=np.int16)
    resampled = soxr.resample(samples, clip.sample_rate, UPLINK_RATE)
    return Clip(np.asarray(resampled, dtype=np.int16).tobytes(), UPLINK_RATE)


def speech_frames(clip: Clip, trailing_silence_ms: int) -> list[bytes]:
    """60 ms PCM16 frames of the clip at 16 kHz, then whole frames of silence."""
    frames = split_frames(to_uplink_rate(clip).pcm, UPLINK_RATE)
    silence = bytes(frame_samples(UPLINK_RATE) * 2)
    return frames + [silence] * -(-trailing_silence_ms // FRAME_MS)


class UplinkEncoder:
    """Encodes 60 ms PCM16 frames like the stock device (Opus VOIP, complexity 0, DTX)."""

    def __init__(self, audio_format: AudioFormat) -> None:
        self.audio_format = audio_format
        self._opus: Any = None
        if audio_format == "opus":
            self._opus = opuslib_next.Encoder(UPLINK_RATE, 1, opuslib_next.APPLICATION_VOIP)
            self._opus.complexity = 0
            self._opus.dtx = 1

    def encode(self, pcm: bytes) -> bytes:
        if self._opus is None:
            return pcm
        return bytes(self._opus.encode(pcm, len(pcm) // 2))


def decode_downlink(server_audio: ServerAudio, payloads: list[bytes]) -> list[bytes]:
    """Each payload as PCM16 at the server hello's rate (a fresh decoder, as at `tts start`)."""
    if server_audio.format != "opus":
        return list(payloads)
    decoder = opuslib_next.Decoder(server_audio.sample_rate, 1)
    most = frame_samples(server_audio.sample_rate, MAX_OPUS_FRAME_MS)
    decoded: list[bytes] = []
    for payload in payloads:
        try:
            decoded.append(bytes(decoder.decode(payload, most)))
        except opuslib_next.OpusError:
            decoded.append(b"")  # an undecodable packet plays nothing
    return decoded


# ---- turns -------------------------------------------------------------------------------------


@dataclass
class _Turn:
    events: list[Event] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    playback: Playback = field(default_factory=Playback)
    stopped_at: float | None = None


@dataclass
class VoiceReply:
    """One turn as the device lived it. Times are the device clock's (monotonic seconds)."""

    events: list[Event]  # text messages except MCP, in arrival order, ending with `tts stop`
    frames: list[Frame]  # downlink payloads (framing/encryption removed) with arrival times
    audio: Clip  # every frame of the turn, decoded
    heard: Clip  # only what the playback model played to the end
    counters: PlaybackCounters
    max_in_flight: int  # the most frames the 40-frame queue held: how far ahead the server ran
    tts_stop_at: float
    last_frame_end: float | None  # when the last accepted frame would have finished playing

    @property
    def stop_margin_ms(self) -> float | None:
        """`tts stop` time minus the last frame's end; negative means the answer was cut off."""
        if self.last_frame_end is None:
            return None
        return (self.tts_stop_at - self.last_frame_end) * 1000

    @property
    def kinds(self) -> list[str]:
        """The events as "stt", "llm", "tts start", "tts sentence_start", "tts stop", ..."""
        return [_kind(message) for _, message in self.events]

    @property
    def transcript(self) -> str | None:
        return next((m.get("text") for _, m in self.events if m.get("type") == "stt"), None)

    @property
    def sentences(self) -> list[str]:
        return [
            str(m.get("text"))
            for _, m in self.events
            if m.get("type") == "tts" and m.get("state") == "sentence_start"
        ]


def _kind(message: dict[str, Any]) -> str:
    kind = str(message.get("type"))
    return f"{kind} {message.get('state')}" if kind == "tts" else kind


# ---- the device --------------------------------------------------------------------------------


class VoiceDevice:
    """A stock voice device on one link; an async context manager (connect + hello, close)."""

    def __init__(
        self,
        link: Link,
        hello: dict[str, Any],
        *,
        audio_format: AudioFormat = "opus",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = link
        self.hello = hello
        self.audio_format = audio_format
        self.clock = clock
        self.mcp = DeviceMcp()
        self.session_id = ""
        self.server_hello: dict[str, Any] | None = None
        self.server_audio = ServerAudio()
        self.events: list[Event] = []
        self.frames: list[Frame] = []
        self.replies: list[VoiceReply] = []
        self.closed_reason: str | None = None
        self.connected_at = 0.0
        self._turn = _Turn()
        self._finished: deque[_Turn] = deque()
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- construction ----

    @classmethod
    def websocket(
        cls,
        url: str,
        token: str | None,
        device_id: str,
        client_id: str | None = None,
        *,
        version: int = 1,
        audio_format: AudioFormat = "opus",
        downlink_sample_rate: int | None = None,
    ) -> "VoiceDevice":
        link = WebSocketLink(url, token, device_id, client_id or str(uuid.uuid4()), version)
        hello = _hello(version, "websocket", audio_format, downlink_sample_rate)
        return cls(link, hello, audio_format=audio_format)

    @classmethod
    def mqtt(
        cls,
        url: str,
        device_id: str,
        password: str,
        *,
        username: str | None = None,
        client_id: str | None = None,
        topic_prefix: str = "xiaozhi",
        subscribe: bool = False,
        audio_format: AudioFormat = "opus",
        downlink_sample_rate: int | None = None,
    ) -> "VoiceDevice":
        """`url` is mqtt://host:port; the login defaults to the bridge's (username = device
        key); `subscribe=True` subscribes to `<prefix>/<key>/down` for brokers that do not push."""
        key = device_key(device_id)
        link = MqttUdpLink(
            url,
            build_client_id(device_id, client_id or str(uuid.uuid4())),
            username or key,
            password,
            publish_topic=f"{topic_prefix}/{key}/up",
            subscribe_topic=f"{topic_prefix}/{key}/down" if subscribe else None,
        )
        hello = _hello(3, "udp", audio_format, downlink_sample_rate)
        return cls(link, hello, audio_format=audio_format)

    async def __aenter__(self) -> "VoiceDevice":
        try:
            await self.connect()
        except BaseException:
            await self.link.close()
            raise
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def connect(self) -> dict[str, Any]:
        """Open the link, send the hello, wait for the server hello (and its UDP channel)."""
        self.connected_at = self.clock()
        await self.link.open(self)
        self.session_id = ""
        await self._send(self.hello)
        hello: dict[str, Any] = await self._wait_for(
            lambda: self.server_hello, HELLO_TIMEOUT_S, "server hello"
        )
        await self.link.open_audio(hello)
        return hello

    async def close(self) -> None:
        """Goodbye on MQTT (as the stock device does on a device-initiated close), then close."""
        if isinstance(self.link, MqttUdpLink) and self.server_hello and self.closed_reason is None:
            await self._send({"type": "goodbye"})
        await self.link.close()
        for task in list(self._tasks):
            task.cancel()

    # ---- device -> server ----

    async def listen_start(self, mode: ListenMode = "auto") -> None:
        await self._send({"type": "listen", "state": "start", "mode": mode})

    async def listen_stop(self) -> None:
        await self._send({"type": "listen", "state": "stop"})

    async def listen_detect(self, text: str) -> None:
        await self._send({"type": "listen", "state": "detect", "text": text})

    async def abort(self, reason: str | None = None) -> None:
        message: dict[str, Any] = {"type": "abort"}
        if reason is not None:
            message["reason"] = reason
        await self._send(message)

    async def send_speech(
        self, clip: Clip, *, realtime: bool = True, trailing_silence_ms: int = 900
    ) -> int:
        """Stream the clip (then silence) as 60 ms frames; returns how many frames were sent.
        Real time runs on an absolute schedule, so a late send does not delay the next ones."""
        encoder = UplinkEncoder(self.audio_format)
        frames = speech_frames(clip, trailing_silence_ms)
        loop = asyncio.get_running_loop()
        started = loop.time()
        for index, pcm in enumerate(frames):
            if realtime:
                await asyncio.sleep(max(0.0, started + index * FRAME_MS / 1000 - loop.time()))
            await self.link.send_audio(encoder.encode(pcm))
        return len(frames)

    async def send_mcp(self, payload: dict[str, Any]) -> None:
        await self._send({"type": "mcp", "payload": payload})

    # ---- server -> device ----

    async def wait_turn(self, timeout_s: float = 30.0) -> VoiceReply:
        """The next finished turn (up to its `tts stop`); VoiceClientError after `timeout_s`."""
        turn = await self._wait_for(
            lambda: self._finished[0] if self._finished else None, timeout_s, "`tts stop`"
        )
        self._finished.popleft()
        reply = self._reply(turn)
        self.replies.append(reply)
        return reply

    def on_text(self, text: str) -> None:
        now = self.clock()
        try:
            message = json.loads(text)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            message = {"type": "<unparsable>", "raw": text[:200]}
        self.events.append((now, message))
        self._dispatch(now, message)
        self._changed.set()

    def on_audio(self, payload: bytes) -> None:
        now = self.clock()
        self.frames.append((now, payload))
        self._turn.frames.append((now, payload))
        self._turn.playback.offer(now)
        self._changed.set()

    def on_closed(self, reason: str) -> None:
        self.closed_reason = reason
        self._changed.set()

    def _dispatch(self, now: float, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "mcp":
            self._answer_mcp(message.get("payload"))
            return
        if kind == "hello" and self.server_hello is None:
            self.server_hello = message
            self.server_audio = ServerAudio.from_hello(message)
            session_id = message.get("session_id")
            self.session_id = session_id if isinstance(session_id, str) else ""
            return
        self._turn.events.append((now, message))
        if kind == "tts" and message.get("state") == "start":
            self._turn.playback.start(now)
        elif kind == "tts" and message.get("state") == "stop":
            self._turn.playback.stop(now)
            self._turn.stopped_at = now
            self._finished.append(self._turn)
            self._turn = _Turn()

    def _answer_mcp(self, payload: Any) -> None:
        reply = self.mcp.handle(payload)
        if reply is None:
            return
        task = asyncio.get_running_loop().create_task(self.send_mcp(reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _reply(self, turn: _Turn) -> VoiceReply:
        assert turn.stopped_at is not None
        payloads = [payload for _, payload in turn.frames]
        decoded = decode_downlink(self.server_audio, payloads)
        rate = self.server_audio.sample_rate
        heard = b"".join(decoded[index] for index in sorted(turn.playback.played))
        return VoiceReply(
            events=turn.events,
            frames=turn.frames,
            audio=Clip(b"".join(decoded), rate),
            heard=Clip(heard, rate),
            counters=turn.playback.counters,
            max_in_flight=turn.playback.max_in_flight,
            tts_stop_at=turn.stopped_at,
            last_frame_end=turn.playback.last_frame_end,
        )

    # ---- records ----

    def save_wav(self, path: Path) -> None:
        """What the speaker played in the finished turns, as one WAV file."""
        rate = self.replies[0].heard.sample_rate if self.replies else self.server_audio.sample_rate
        path.write_bytes(wav_bytes(Clip(b"".join(r.heard.pcm for r in self.replies), rate)))

    def save_events(self, path: Path) -> None:
        """One JSON object per line: {"t": seconds since connect, "event": {...}} for text,
        {"t": ..., "frame_bytes": n} for audio, in arrival order."""
        rows: list[tuple[float, dict[str, Any]]] = [
            (t, {"event": message}) for t, message in self.events
        ]
        rows += [(t, {"frame_bytes": len(payload)}) for t, payload in self.frames]
        rows.sort(key=lambda row: row[0])
        lines = [
            json.dumps({"t": round(t - self.connected_at, 6), **row}, ensure_ascii=False)
            for t, row in rows
        ]
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")

    # ---- internals ----

    async def _send(self, message: dict[str, Any]) -> None:
        """Compact JSON with `session_id` first, as the firmware builds it (not for the hello)."""
        if message.get("type") != "hello":
            message = {"session_id": self.session_id, **message}
        await self.link.send_text(json.dumps(message, separators=(",", ":"), ensure_ascii=False))

    async def _wait_for(self, found: Callable[[], Any], timeout_s: float, what: str) -> Any:
        try:
            async with asyncio.timeout(timeout_s):
                while (value := found()) is None:
                    if self.closed_reason is not None:
                        raise VoiceClientError(f"no {what}: {self.closed_reason}. {self._seen()}")
                    self._changed.clear()
                    await self._changed.wait()
                return value
        except TimeoutError:
            raise VoiceClientError(f"no {what} within {timeout_s:g} s. {self._seen()}") from None

    def _seen(self) -> str:
        kinds = [_kind(message) for _, message in self.events]
        return f"Received {len(self.events)} messages {kinds} and {len(self.frames)} frames."


def _hello(
    version: int, transport: str, audio_format: AudioFormat, downlink_sample_rate: int | None
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "format": audio_format,
        "sample_rate": UPLINK_RATE,
        "channels": 1,
        "frame_duration": FRAME_MS,
    }
    if downlink_sample_rate is not None:
        params["downlink_sample_rate"] = downlink_sample_rate  # non-standard; the bridge honours it
    return {
        "type": "hello",
        "version": version,
        "features": {"mcp": True},
        "transport": transport,
        "audio_params": params,
    }


async def speak_turn(
    device: VoiceDevice,
    clip: Clip,
    mode: ListenMode = "auto",
    *,
    realtime: bool = True,
    trailing_silence_ms: int = 900,
    timeout_s: float = 30.0,
) -> VoiceReply:
    """One spoken turn: listen start, the speech, listen stop in manual mode, the reply."""
    await device.listen_start(mode)
    await device.send_speech(clip, realtime=realtime, trailing_silence_ms=trailing_silence_ms)
    if mode == "manual":
        await device.listen_stop()
    return await device.wait_turn(timeout_s)
