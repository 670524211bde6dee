"""The stock-style voice client (simulator/voice_client.py) against fakes on loopback.

`FakeVoiceServer` is a real `websockets` server that speaks the xiaozhi protocol the way a
voice backend would: it answers the hello (Opus 24 kHz, or PCM16 16 kHz to a PCM16 hello),
asks the device's MCP server a few things, decodes the uplink with its own Opus decoder, and
answers a turn with `stt`, `llm`, `tts start`, `sentence_start`, N downlink frames at a chosen
pace and `tts stop`. The MQTT + UDP case runs against the bridge's own endpoint and UDP channel.
The playback model is also checked alone, on synthetic times.
"""

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import opuslib_next
import pytest
from websockets.asyncio.server import ServerConnection, serve

from backend.protocol.audio import decode_audio, encode_audio
from backend.server import Bridge
from backend.transports.mqtt_credentials import DerivedCredentials
from backend.voice.audio import Clip, read_wav
from simulator.voice_client import VoiceClientError, VoiceDevice, speak_turn
from simulator.voice_playback import Playback

DEVICE_ID = "a4:cf:12:34:56:78"
CLIENT_ID = "6c4a5a2e-2f0e-4a4e-9d59-3b2d1c0e9f11"
TOKEN = "voice-token"
FRAME_S = 0.06
SPEECH_RATE = 22050  # not 16 kHz: the client must resample
SPEECH_S = 1.0
TRAILING_MS = 300
# 1 s at 16 kHz is 16000 samples: 17 frames of 960 (the last padded), then 5 of silence.
SPEECH_FRAMES = math.ceil(16000 / 960)
UPLINK_FRAMES = SPEECH_FRAMES + TRAILING_MS // 60

Pace = Literal["paced", "burst", "stop_at_once"]


def tone(rate: int, seconds: float, hz: float = 440.0) -> bytes:
    samples = np.arange(int(rate * seconds))
    return (np.sin(2 * np.pi * hz * samples / rate) * 8000).astype(np.int16).tobytes()


SPEECH = Clip(tone(SPEECH_RATE, SPEECH_S), SPEECH_RATE)


def rms(pcm: bytes) -> float:
    samples = np.frombuffer(pcm, dtype=np.int16).astype(np.float64)
    return float(np.sqrt(np.mean(samples**2))) if len(samples) else 0.0


@dataclass
class FakeVoiceServer:
    """One connection at a time; what it saw is kept for the test to check."""

    downlink_frames: int = 20
    pace: Pace = "paced"
    lead: int = 3  # frames sent at once before pacing starts
    send_stop: bool = True
    headers: dict[str, str] = field(default_factory=dict)
    hello: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    mcp_replies: dict[int, dict[str, Any]] = field(default_factory=dict)
    uplink_pcm: list[bytes] = field(default_factory=list)
    port: int = 0

    async def handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        self.headers = {name.lower(): value for name, value in ws.request.headers.raw_items()}
        version = int(self.headers["protocol-version"])
        self.hello = json.loads(await ws.recv())
        audio_format = self.hello["audio_params"]["format"]
        rate = 16000 if audio_format == "pcm16" else 24000
        await ws.send(json.dumps(server_hello(audio_format, rate)))
        await self.ask_mcp(ws)
        decoder = opuslib_next.Decoder(16000, 1)
        async for message in ws:
            if isinstance(message, str):
                self.on_text(json.loads(message))
                if self.messages[-1].get("state") == "stop":
                    await self.answer(ws, version, audio_format, rate)
                continue
            payload = decode_audio(version, message).payload
            pcm = payload if audio_format == "pcm16" else decoder.decode(payload, 960)
            self.uplink_pcm.append(bytes(pcm))
            if len(self.uplink_pcm) == UPLINK_FRAMES and self.listen_mode() != "manual":
                await self.answer(ws, version, audio_format, rate)

    def on_text(self, message: dict[str, Any]) -> None:
        if message.get("type") == "mcp":
            self.mcp_replies[message["payload"]["id"]] = message["payload"]
        else:
            self.messages.append(message)

    def listen_mode(self) -> str | None:
        starts = [m for m in self.messages if m.get("state") == "start"]
        return starts[-1].get("mode") if starts else None

    async def ask_mcp(self, ws: ServerConnection) -> None:
        requests = [
            ("initialize", {"protocolVersion": "2024-11-05", "capabilities": {}}),
            ("tools/list", {"cursor": ""}),
            ("tools/call", {"name": "self.audio_speaker.set_volume", "arguments": {"volume": 30}}),
            ("tools/call", {"name": "self.audio_speaker.set_volume", "arguments": {"volume": 101}}),
        ]
        for request_id, (method, params) in enumerate(requests, start=1):
            payload = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
            await ws.send(json.dumps({"type": "mcp", "payload": payload}))

    async def answer(
        self, ws: ServerConnection, version: int, audio_format: str, rate: int
    ) -> None:
        for message in [
            {"type": "stt", "text": "set the volume to thirty"},
            {"type": "llm", "emotion": "happy"},
            {"type": "tts", "state": "start"},
            {"type": "tts", "state": "sentence_start", "text": "Volume set to thirty."},
        ]:
            await ws.send(json.dumps({"session_id": "s-1", **message}))
        frames = downlink_frames(audio_format, rate, self.downlink_frames)
        loop = asyncio.get_running_loop()
        started = loop.time()
        for index, frame in enumerate(frames):
            if self.pace == "paced":
                due = started + max(0, index - self.lead + 1) * FRAME_S
                await asyncio.sleep(max(0.0, due - loop.time()))
            await ws.send(encode_audio(version, frame))
        if not self.send_stop:
            return
        if self.pace != "stop_at_once":
            played = min(len(frames), 40) * FRAME_S  # a burst beyond 40 frames is dropped
            await asyncio.sleep(max(0.0, started + played + 0.15 - loop.time()))
        await ws.send(json.dumps({"session_id": "s-1", "type": "tts", "state": "stop"}))


def server_hello(audio_format: str, rate: int) -> dict[str, Any]:
    return {
        "type": "hello",
        "transport": "websocket",
        "session_id": "s-1",
        "audio_params": {
            "format": audio_format,
            "sample_rate": rate,
            "channels": 1,
            "frame_duration": 60,
        },
    }


def downlink_frames(audio_format: str, rate: int, count: int) -> list[bytes]:
    size = rate * 60 // 1000
    pcm = tone(rate, count * FRAME_S, hz=300)
    chunks = [pcm[i * size * 2 : (i + 1) * size * 2] for i in range(count)]
    if audio_format == "pcm16":
        return chunks
    encoder = opuslib_next.Encoder(rate, 1, opuslib_next.APPLICATION_AUDIO)
    return [bytes(encoder.encode(chunk, size)) for chunk in chunks]


@contextlib.asynccontextmanager
async def running(server: FakeVoiceServer) -> AsyncIterator[str]:
    async with serve(server.handle, "127.0.0.1", 0) as ws_server:
        port = next(iter(ws_server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}/xiaozhi/v1/"


def device_for(url: str, **kwargs: Any) -> VoiceDevice:
    return VoiceDevice.websocket(url, TOKEN, DEVICE_ID, CLIENT_ID, **kwargs)


def assert_uplink_is_the_speech(server: FakeVoiceServer) -> None:
    assert len(server.uplink_pcm) == UPLINK_FRAMES
    assert sum(len(pcm) for pcm in server.uplink_pcm) == UPLINK_FRAMES * 960 * 2
    speech = b"".join(server.uplink_pcm[2 : SPEECH_FRAMES - 2])  # clear of codec ramps
    silence = b"".join(server.uplink_pcm[SPEECH_FRAMES + 2 :])
    assert rms(speech) > 1000 > 50 > rms(silence), (rms(speech), rms(silence))


# ---- WebSocket turns -----------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2, 3])
async def test_paced_turn_is_heard_whole(version: int) -> None:
    server = FakeVoiceServer(downlink_frames=20, pace="paced")
    async with running(server) as url, device_for(url, version=version) as device:
        await device.listen_start("auto")
        sent = await device.send_speech(SPEECH, realtime=False, trailing_silence_ms=TRAILING_MS)
        reply = await device.wait_turn(timeout_s=20)

    assert sent == UPLINK_FRAMES
    assert_uplink_is_the_speech(server)
    assert server.headers["protocol-version"] == str(version)
    assert server.headers["authorization"] == f"Bearer {TOKEN}"
    assert server.headers["device-id"] == DEVICE_ID and server.headers["client-id"] == CLIENT_ID
    assert server.hello["audio_params"] == {
        "format": "opus",
        "sample_rate": 16000,
        "channels": 1,
        "frame_duration": 60,
    }
    assert server.messages[0] == {
        "session_id": "s-1",
        "type": "listen",
        "state": "start",
        "mode": "auto",
    }
    assert reply.kinds == ["stt", "llm", "tts start", "tts sentence_start", "tts stop"]
    assert reply.transcript == "set the volume to thirty"
    assert reply.sentences == ["Volume set to thirty."]
    assert len(reply.frames) == 20
    assert reply.audio.sample_rate == 24000 and reply.audio.duration_ms == 20 * 60
    assert reply.heard.duration_ms == 20 * 60
    assert rms(reply.audio.pcm) > 1000
    counters = reply.counters
    assert (counters.accepted, counters.dropped_overflow, counters.cut_at_stop) == (20, 0, 0)
    assert counters.dropped_outside_speaking == 0
    assert 0 < reply.max_in_flight < 40
    assert reply.stop_margin_ms is not None and reply.stop_margin_ms > 0


async def test_a_burst_of_60_frames_overflows_the_40_frame_queue() -> None:
    server = FakeVoiceServer(downlink_frames=60, pace="burst")
    async with running(server) as url, device_for(url, version=3) as device:
        reply = await speak_turn(device, SPEECH, realtime=False, trailing_silence_ms=TRAILING_MS)

    assert reply.audio.duration_ms == 60 * 60  # everything that arrived, decoded
    assert reply.heard.duration_ms == 40 * 60  # what the speaker played
    assert reply.max_in_flight == 40
    assert reply.counters.accepted == 40
    assert reply.counters.dropped_overflow == 20
    assert reply.counters.cut_at_stop == 0


async def test_tts_stop_right_after_the_last_frame_cuts_the_end() -> None:
    server = FakeVoiceServer(downlink_frames=10, pace="stop_at_once")
    async with running(server) as url, device_for(url, version=1) as device:
        reply = await speak_turn(device, SPEECH, realtime=False, trailing_silence_ms=TRAILING_MS)

    assert reply.audio.duration_ms == 10 * 60
    assert reply.counters.accepted == 10 and reply.counters.dropped_overflow == 0
    assert reply.counters.cut_at_stop > 0
    assert reply.heard.duration_ms == (10 - reply.counters.cut_at_stop) * 60
    assert reply.stop_margin_ms is not None and reply.stop_margin_ms < 0


async def test_pcm16_device_gets_pcm16_and_speaks_in_real_time_in_manual_mode() -> None:
    server = FakeVoiceServer(downlink_frames=5, pace="paced")
    async with running(server) as url, device_for(url, audio_format="pcm16") as device:
        reply = await speak_turn(device, SPEECH, "manual", trailing_silence_ms=TRAILING_MS)

    assert server.hello["audio_params"]["format"] == "pcm16"
    assert_uplink_is_the_speech(server)
    assert [m.get("state") for m in server.messages] == ["start", "stop"]
    assert server.messages[0]["mode"] == "manual"
    assert device.server_audio.format == "pcm16" and device.server_audio.sample_rate == 16000
    assert reply.audio.sample_rate == 16000 and reply.audio.duration_ms == 5 * 60
    assert all(len(payload) == 1920 for _, payload in reply.frames)


async def test_downlink_sample_rate_is_asked_in_the_hello() -> None:
    server = FakeVoiceServer(downlink_frames=1, pace="burst")
    async with running(server) as url, device_for(url, downlink_sample_rate=16000):
        pass
    assert server.hello["audio_params"]["downlink_sample_rate"] == 16000


async def test_mcp_is_answered_like_a_stock_device() -> None:
    server = FakeVoiceServer(downlink_frames=1, pace="burst")
    async with running(server) as url, device_for(url) as device:
        await speak_turn(device, SPEECH, realtime=False, trailing_silence_ms=TRAILING_MS)

    replies = server.mcp_replies
    assert replies[1]["result"]["protocolVersion"] == "2024-11-05"
    names = [tool["name"] for tool in replies[2]["result"]["tools"]]
    assert names == ["self.get_device_status", "self.audio_speaker.set_volume"]
    assert "nextCursor" not in replies[2]["result"]
    assert replies[3]["result"]["content"] == [{"type": "text", "text": "true"}]
    assert replies[4]["error"] == {"message": "Value exceeds maximum allowed: 100"}
    assert device.mcp.volume == 30
    assert device.mcp.calls[0] == ("self.audio_speaker.set_volume", {"volume": 30})


async def test_listen_detect_abort_and_the_other_messages() -> None:
    server = FakeVoiceServer(downlink_frames=1, pace="burst")
    async with running(server) as url, device_for(url) as device:
        await device.listen_detect("hi esp")
        await device.abort()
        await device.abort("wake_word_detected")
        await device.listen_start("realtime")
        await device.send_speech(SPEECH, realtime=False, trailing_silence_ms=TRAILING_MS)
        await device.wait_turn(timeout_s=20)

    assert server.messages[:4] == [
        {"session_id": "s-1", "type": "listen", "state": "detect", "text": "hi esp"},
        {"session_id": "s-1", "type": "abort"},
        {"session_id": "s-1", "type": "abort", "reason": "wake_word_detected"},
        {"session_id": "s-1", "type": "listen", "state": "start", "mode": "realtime"},
    ]


async def test_no_tts_stop_fails_with_what_was_received() -> None:
    server = FakeVoiceServer(downlink_frames=3, pace="burst", send_stop=False)
    async with running(server) as url, device_for(url) as device:
        await device.listen_start("auto")
        await device.send_speech(SPEECH, realtime=False, trailing_silence_ms=TRAILING_MS)
        with pytest.raises(VoiceClientError) as caught:
            await device.wait_turn(timeout_s=1)
    text = str(caught.value)
    assert "no `tts stop` within 1 s" in text
    assert "'tts start'" in text and "'stt'" in text and "3 frames" in text


async def test_records_are_saved_as_wav_and_json_lines(tmp_path: Path) -> None:
    server = FakeVoiceServer(downlink_frames=4, pace="burst")
    async with running(server) as url, device_for(url) as device:
        reply = await speak_turn(device, SPEECH, realtime=False, trailing_silence_ms=TRAILING_MS)
    device.save_wav(tmp_path / "heard.wav")
    device.save_events(tmp_path / "events.jsonl")

    heard = read_wav(tmp_path / "heard.wav")
    assert heard.sample_rate == 24000 and heard.pcm == reply.heard.pcm
    assert heard.duration_ms == 4 * 60
    rows = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert rows[0]["event"]["type"] == "hello"
    assert [row["t"] for row in rows] == sorted(row["t"] for row in rows)
    assert sum(1 for row in rows if "frame_bytes" in row) == 4
    assert rows[-1]["event"] == {"session_id": "s-1", "type": "tts", "state": "stop"}


# ---- the playback model alone, on synthetic times ----------------------------------------------


def test_playback_drops_outside_speaking_and_beyond_40_queued() -> None:
    playback = Playback()
    assert not playback.offer(0.0)  # before tts start
    playback.start(0.0)
    accepted = [playback.offer(1.0) for _ in range(45)]
    assert accepted == [True] * 40 + [False] * 5
    assert playback.max_in_flight == 40
    # One frame has played 60 ms after the first arrived: room for exactly one more.
    assert playback.offer(1.06) and not playback.offer(1.06)
    c = playback.counters
    assert (c.accepted, c.dropped_outside_speaking, c.dropped_overflow) == (41, 1, 6)


def test_playback_cuts_what_has_not_finished_at_stop() -> None:
    playback = Playback()
    playback.start(0.0)
    for index in range(5):
        playback.offer(index * FRAME_S)  # paced: each one plays as it arrives
    assert playback.max_in_flight == 1
    playback.stop(4 * FRAME_S + 0.01)  # during the last frame
    assert playback.counters.cut_at_stop == 1
    assert playback.played == [0, 1, 2, 3]
    assert not playback.offer(1.0)  # after stop: not speaking
    assert playback.counters.dropped_outside_speaking == 1


def test_playback_restarts_on_arrival_after_an_underrun() -> None:
    playback = Playback()
    playback.start(0.0)
    playback.offer(0.0)
    playback.offer(0.0)  # plays 0.06..0.12
    playback.offer(1.0)  # the queue ran dry: plays 1.0..1.06
    assert playback.last_frame_end == pytest.approx(1.06)
    playback.stop(1.06)
    assert playback.counters.cut_at_stop == 0 and playback.played == [0, 1, 2]


# ---- MQTT + UDP against the bridge's own endpoint ---------------------------------------------

SECRET = "voice-client-mqtt-secret-0123456789"


async def test_mqtt_hello_opens_udp_and_the_bridge_accepts_uplink(
    bridge_factory: Any, tmp_path: Path
) -> None:
    bridge: Bridge = await bridge_factory(
        mqtt_url="embedded",
        mqtt_host="127.0.0.1",
        mqtt_port=0,
        mqtt_secret=SECRET,
        udp_host="127.0.0.1",
        udp_port=0,
    )
    assert bridge.mqtt is not None
    uplink: list[bytes] = []
    bridge.conversations.on_audio(lambda _conversation, frame: uplink.append(frame.payload))
    password = DerivedCredentials(SECRET.encode()).issue(DEVICE_ID).password
    short = Clip(tone(16000, 0.3), 16000)

    device = VoiceDevice.mqtt(bridge.mqtt.device_url, DEVICE_ID, password, client_id=CLIENT_ID)
    async with device:
        hello = device.server_hello
        assert hello is not None and hello["transport"] == "udp"
        assert isinstance(hello.get("session_id"), str) and device.session_id == hello["session_id"]
        udp = device.link.udp  # type: ignore[attr-defined]
        assert udp.params.port == bridge.mqtt.udp.port and udp.params.nonce[0] == 0x01
        # The bridge ran MCP discovery over MQTT: the device answered it.
        await bridge.registry.wait_for_state(DEVICE_ID, timeout_s=10)
        sent = await device.send_speech(short, realtime=True, trailing_silence_ms=0)
        async with asyncio.timeout(10):
            while len(uplink) < sent:  # noqa: ASYNC110 - the bridge's callback has no event
                await asyncio.sleep(0.01)
    assert sent == 5 and udp.sent == 5
    decoder = opuslib_next.Decoder(16000, 1)
    assert sum(len(decoder.decode(payload, 960)) for payload in uplink) == 5 * 960 * 2
