"""Answers made for the ear: the offline note stays on screens, a confirmed change is said in
words, numbers and units are read as words, and the sentences of a spoken answer are apart by
a pause the device hears as silent frames."""

import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy
import pytest

from backend.chat import (
    CHAT_MIGRATIONS,
    ChatEvent,
    ChatService,
    Done,
    SqliteMemoryStore,
    Token,
    TurnRequest,
    collect,
)
from backend.chat.offline import OFFLINE_NOTE
from backend.chat.text import Language
from backend.chat.tools import AskBeforeChanging, DeviceToolBox
from backend.server import Bridge
from backend.storage import Database
from backend.voice.tts import speakable
from simulator.voice_client import VoiceDevice, VoiceReply
from testkit.in_process import FirmwareDevice
from testkit.settings import DEVICE_TOKEN
from testkit.stock_device import WireDevice
from tests.helpers import wait_state

FLOSS = "how often should I floss"


@pytest.fixture
async def offline(tmp_path: Path) -> AsyncIterator[ChatService]:
    database = Database(tmp_path / "chat.sqlite3", CHAT_MIGRATIONS)
    await database.open()
    yield ChatService(SqliteMemoryStore(database), None, None)
    await database.close()


def tokens(events: list[ChatEvent]) -> list[Token]:
    return [event for event in events if isinstance(event, Token)]


# ---- the offline note is for screens --------------------------------------------------------


@pytest.mark.parametrize(("text", "language"), [(FLOSS, "en"), ("nên dùng chỉ nha khoa?", "vi")])
async def test_the_offline_note_is_shown_but_not_said(
    offline: ChatService, text: str, language: Language
) -> None:
    events = await collect(offline.run_turn(TurnRequest(text=text)))
    (token,) = tokens(events)
    note = OFFLINE_NOTE[language]
    assert token.text.startswith(note + "\n")  # the API and the console keep it
    assert token.spoken == token.text.removeprefix(note + "\n")
    assert note not in token.spoken and token.spoken
    done = events[-1]
    assert isinstance(done, Done) and done.metadata.answer.startswith(note)


async def test_a_device_neither_says_nor_shows_the_offline_note(
    bridge: Bridge, wire_devices: Any
) -> None:
    device: WireDevice = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    await device.send(
        {"session_id": device.session_id, "type": "listen", "state": "detect", "text": FLOSS}
    )
    await device.wait_for_count(
        lambda: sum(m.get("state") == "stop" for m in device.messages if m["type"] == "tts"), 1
    )
    lines = [m["text"] for m in device.messages if m.get("state") == "sentence_start"]
    assert lines and lines[0].startswith("Clean between your teeth")
    assert not any("Offline mode" in line or line.startswith("(") for line in lines)
    conversation = await bridge.frontends.memory.conversation_for_device(device.device_id)
    stored = await bridge.frontends.memory.get(conversation.id, with_messages=True)
    assert stored.messages[1].content.startswith(OFFLINE_NOTE["en"])


# ---- a confirmed change in words --------------------------------------------------------------


@pytest.mark.parametrize(
    ("asked", "reply", "shown", "said"),
    [
        (
            "set the volume to 30",
            "yes",
            "Done: self.audio_speaker.set_volume → true",
            "Volume set to 30.",
        ),
        ("turn on the light", "yes", "Done: self.led.set → true", "The light is on."),
        (
            "set the volume to 30",
            "no",
            "OK, I did not run self.audio_speaker.set_volume.",
            "OK, I did not set the speaker volume to 30.",
        ),
        (
            "chỉnh âm lượng 30",
            "có",
            "Đã xong: self.audio_speaker.set_volume → true",
            "Đã chỉnh âm lượng thành 30.",
        ),
    ],
)
async def test_a_confirmed_change_is_said_in_words_and_shown_in_full(
    offline: ChatService, asked: str, reply: str, shown: str, said: str
) -> None:
    device = FirmwareDevice()
    box = AskBeforeChanging(DeviceToolBox(device))  # the recognizer was unsure: ask first
    request = {"conversation_id": "c1", "device_id": device.device_id}
    await collect(offline.run_turn(TurnRequest(text=asked, **request), box))
    events = await collect(offline.run_turn(TurnRequest(text=reply, **request), box))
    (token,) = tokens(events)
    assert token.text == shown and token.spoken == said


# ---- numbers and units for the ear ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("The battery is at 55%.", "The battery is at 55 percent."),
        ("Brush for 2-3 minutes, or 2–3.", "Brush for 2 to 3 minutes, or 2 to 3."),
        ("Use 1,350 to 1,500 ppm fluoride.", "Use 1350 to 1500 parts per million fluoride."),
        ("The chip is at 41.5°C, 107 °F.", "The chip is at 41.5 degrees, 107 degrees Fahrenheit."),
        (
            "Clean between, e.g. with floss, i.e. daily.",
            "Clean between, for example with floss, that is daily.",
        ),
        ("Floss vs. mouthwash", "Floss versus mouthwash"),
        (
            "Dưới 10% năng lượng, 2-3 phút, 1.450 ppm.",
            "Dưới 10 phần trăm năng lượng, 2 đến 3 phút, 1450 phần triệu.",
        ),
        ("Nhiệt độ 37°C", "Nhiệt độ 37 độ"),
        # Left alone: dates, versions, names with numbers, a decimal comma in Vietnamese.
        ("Version 1.2.3 of 2024-05-01, COVID-19.", "Version 1.2.3 of 2024-05-01, COVID-19."),
        ("Chip đang ở 41,5 độ.", "Chip đang ở 41,5 độ."),
    ],
)
def test_numbers_units_and_abbreviations_are_read_as_words(text: str, spoken: str) -> None:
    assert speakable(text) == spoken


# ---- the pause between sentences, at the device ----------------------------------------------

SILENT_PEAK = 200  # eSpeak's speech peaks in the thousands; a silent frame is all but zero
PAUSE_FRAMES = 5  # Pacing.sentence_pause_ms 300 / 60 ms frames


def silent(frame: bytes) -> bool:
    samples = numpy.frombuffer(frame, dtype="<i2")
    return not len(samples) or int(numpy.abs(samples.astype(numpy.int32)).max()) < SILENT_PEAK


def sentence_frames(reply: VoiceReply) -> list[list[bytes]]:
    """The reply's frames (PCM16) cut at each `tts sentence_start` by arrival time."""
    marks = [t for t, m in reply.events if m.get("state") == "sentence_start"]
    cut: list[list[bytes]] = [[] for _ in marks]
    for arrived, frame in reply.frames:
        index = sum(1 for mark in marks if mark <= arrived) - 1
        assert index >= 0, "a frame before the first sentence's mark"
        cut[index].append(frame)
    return cut


def run(frames: list[bytes]) -> int:
    """How many frames at the start of `frames` are silent."""
    return next((i for i, frame in enumerate(frames) if not silent(frame)), len(frames))


@pytest.mark.slow
async def test_sentences_are_apart_by_a_pause_and_none_comes_first_or_last(
    bridge_factory: Any,
) -> None:
    bridge = await bridge_factory(voice_enabled=True)
    device_id = "02:00:00:00:50:01"
    client = VoiceDevice.websocket(
        bridge.ws_url, DEVICE_TOKEN, device_id, f"client-{device_id}", audio_format="pcm16"
    )
    async with client as device:
        await wait_state(bridge, device_id)
        await device.listen_detect("set the volume to 30, what is the volume now and is it online")
        reply = await device.wait_turn()
    assert reply.sentences == [
        "Volume set to 30.",
        "The volume is 30.",
        "The device does not report its network.",
    ]
    parts = sentence_frames(reply)
    assert run(parts[0]) == 0  # no pause before the first sentence
    assert run(parts[-1][::-1]) <= 1  # nor after the last (at most its padded end)
    for before, after in itertools.pairwise(parts):
        gap = run(before[::-1]) + run(after)
        # The pause, plus at most the padded end of one sentence and eSpeak's start of the next.
        assert PAUSE_FRAMES <= gap <= PAUSE_FRAMES + 2, gap
