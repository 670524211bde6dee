"""A voice turn held by the real firmware (firmware/main.py on the MicroPython unix port, fake
HAL: a WAV file as the microphone, a WAV file as the speaker) with a fake bridge played by a
`websockets` server on loopback: the device says hello in PCM16, streams the WAV's samples in
order after `listen start`, shows stt/llm/sentence texts, plays the downlink frames with its
volume applied, and listens again once `tts stop` has drained its queue."""

import asyncio
import json
import secrets
import struct
import wave
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request

from tests.firmware_helpers import needs_micropython, running_firmware, serving

pytestmark = [pytest.mark.micropython, needs_micropython]

PCM16_HELLO = {"format": "pcm16", "sample_rate": 16000, "channels": 1, "frame_duration": 60}
MIC_FRAME = 1920  # 60 ms at 16 kHz, 16-bit mono
MIC_FRAMES = 8
MIC_TAIL_SAMPLES = 100  # the file ends inside a ninth frame, which the device pads with zeros
DEFAULT_VOLUME = 70
WAIT_S = 20


class VoiceLink:
    """The bridge's side of one device connection: everything the device sent, in order."""

    def __init__(self, connection: ServerConnection, hello: dict[str, Any], version: int):
        self.connection = connection
        self.hello = hello
        self.version = version
        self.session_id = secrets.token_hex(8)
        self.inbox: asyncio.Queue[str | bytes] = asyncio.Queue()

    async def send_json(self, **message: Any) -> None:
        await self.connection.send(json.dumps({"session_id": self.session_id, **message}))

    async def send_audio(self, pcm: bytes) -> None:
        await self.connection.send(frame_audio(self.version, pcm))

    async def next_json(self) -> dict[str, Any]:
        """The next text message; binary ones before it (late microphone frames) are skipped."""
        while True:
            message = await asyncio.wait_for(self.inbox.get(), WAIT_S)
            if isinstance(message, str):
                return json.loads(message)

    async def audio_frames(self, count: int) -> list[bytes]:
        frames = []
        while len(frames) < count:
            message = await asyncio.wait_for(self.inbox.get(), WAIT_S)
            assert isinstance(message, bytes), f"text before {count} audio frames: {message}"
            frames.append(unframe_audio(self.version, message))
        return frames


class VoiceBridge:
    def __init__(self, version: int, sample_rate: int) -> None:
        self.version = version
        self.sample_rate = sample_rate
        self.links: asyncio.Queue[VoiceLink] = asyncio.Queue()
        self.port = 0

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/xiaozhi/v1/"

    async def process_request(self, connection: ServerConnection, request: Request) -> Any:
        return None

    async def handler(self, connection: ServerConnection) -> None:
        hello = json.loads(await connection.recv())
        link = VoiceLink(connection, hello, self.version)
        params = {**PCM16_HELLO, "sample_rate": self.sample_rate}
        await connection.send(
            json.dumps(
                {
                    "type": "hello",
                    "transport": "websocket",
                    "session_id": link.session_id,
                    "audio_params": params,
                }
            )
        )
        await self.links.put(link)
        try:
            async for message in connection:
                await link.inbox.put(message)
        except ConnectionClosed:
            pass


def frame_audio(version: int, payload: bytes) -> bytes:
    """Protocol reference §1.3, written here independently of the firmware's code."""
    if version == 2:
        return struct.pack(">HHIII", 2, 0, 0, 0, len(payload)) + payload
    if version == 3:
        return struct.pack(">BBH", 0, 0, len(payload)) + payload
    return payload


def unframe_audio(version: int, data: bytes) -> bytes:
    if version == 2:
        assert (
            data[:4] == b"\x00\x02\x00\x00"
            and struct.unpack(">I", data[12:16])[0] == len(data) - 16
        )
        return data[16:]
    if version == 3:
        assert data[0] == 0 and struct.unpack(">H", data[2:4])[0] == len(data) - 4
        return data[4:]
    return data


def ramp(count: int, start: int, step: int) -> bytes:
    return struct.pack(f"<{count}h", *(((start + step * i) % 65536) - 32768 for i in range(count)))


def with_volume(pcm: bytes, volume: int) -> bytes:
    """The volume as the firmware documents it: sample * (volume * 256 // 100) >> 8."""
    gain = volume * 256 // 100
    samples = struct.unpack(f"<{len(pcm) // 2}h", pcm)
    return struct.pack(f"<{len(samples)}h", *((sample * gain) >> 8 for sample in samples))


def write_wav(path: Path, pcm: bytes, rate: int = 16000) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm)


def read_wav(path: Path) -> tuple[int, bytes]:
    with wave.open(str(path), "rb") as wav:
        assert (wav.getnchannels(), wav.getsampwidth()) == (1, 2)
        return wav.getframerate(), wav.readframes(wav.getnframes())


def device_config(bridge: VoiceBridge, tmp_path: Path, protocol_version: int) -> Path:
    config = {
        "url": bridge.url,
        "token": "device-token",
        "hal": "fake",
        "protocol_version": protocol_version,
        "reconnect_min_s": 0.05,
        "voice": {"mode": "auto"},
        "audio": {
            "mic_wav": str(tmp_path / "question.wav"),
            "mic_speed": 0,
            "speaker_wav": str(tmp_path / "answer.wav"),
            "events": str(tmp_path / "events.jsonl"),
        },
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture
async def question(tmp_path: Path) -> bytes:
    pcm = ramp(MIC_FRAMES * MIC_FRAME // 2 + MIC_TAIL_SAMPLES, 0, 37)
    write_wav(tmp_path / "question.wav", pcm)
    return pcm


@pytest.mark.parametrize(("version", "rate"), [(1, 16000), (2, 16000), (3, 24000)])
async def test_a_voice_turn_on_the_unix_port(
    tmp_path: Path, question: bytes, version: int, rate: int
) -> None:
    async with serving(VoiceBridge(version, rate)) as bridge:
        config = device_config(bridge, tmp_path, version)
        async with running_firmware(config) as device:
            link = await asyncio.wait_for(bridge.links.get(), WAIT_S)
            assert link.hello["audio_params"] == PCM16_HELLO

            listen = {"session_id": link.session_id, "type": "listen", "state": "start"}
            assert await link.next_json() == {**listen, "mode": "auto"}
            frames = await link.audio_frames(MIC_FRAMES + 1)
            assert [len(frame) for frame in frames] == [MIC_FRAME] * (MIC_FRAMES + 1)
            heard = b"".join(frames)
            assert heard == question + bytes(len(heard) - len(question))

            frame_size = rate * 60 // 1000 * 2
            answer = [ramp(frame_size // 2, 1000 * n, 91 + n) for n in range(6)]
            await link.send_json(type="stt", text="set the volume to thirty")
            await link.send_json(type="llm", emotion="happy", text="😀")
            await link.send_json(type="tts", state="start", sample_rate=rate)
            await link.send_json(type="tts", state="sentence_start", text="Volume set.")
            for frame in answer:
                await link.send_audio(frame)
            await link.send_json(type="tts", state="stop")

            # Auto mode: once the queue has played, a fresh listen start.
            assert await link.next_json() == {**listen, "mode": "auto"}
            await device.wait_for_line("voice: listening", timeout_s=WAIT_S)

        played_rate, played = read_wav(tmp_path / "answer.wav")
        assert played_rate == rate
        assert played == with_volume(b"".join(answer), DEFAULT_VOLUME)
        assert played != b"".join(answer)  # the volume really changed the samples
        events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert events == [
            {"role": "user", "text": "set the volume to thirty"},
            {"role": "system", "text": "emotion: happy"},
            {"role": "assistant", "text": "Volume set."},
        ]


async def test_frames_before_tts_start_are_not_played(tmp_path: Path, question: bytes) -> None:
    async with serving(VoiceBridge(1, 16000)) as bridge:
        config = device_config(bridge, tmp_path, 1)
        async with running_firmware(config) as device:
            link = await asyncio.wait_for(bridge.links.get(), WAIT_S)
            await link.next_json()
            await link.send_audio(ramp(960, 5, 3))  # listening: refused
            await device.wait_for(
                lambda: any(
                    "ignoring binary frames outside speaking" in line for line in device.lines
                ),
                "the refused frame's log line",
            )
            await link.send_json(type="tts", state="start")
            await link.send_audio(ramp(960, 9, 7))
            await link.send_json(type="tts", state="stop")
            await link.next_json()  # the next listen start: the turn is over
        _, played = read_wav(tmp_path / "answer.wav")
        assert played == with_volume(ramp(960, 9, 7), DEFAULT_VOLUME)
