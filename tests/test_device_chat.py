"""Device conversations: a `listen` detect with text becomes a chat turn in the device's own
conversation, answered as `stt`, `llm`, `tts start`, `sentence_start`..., `tts stop`, over a real
WebSocket (a scripted stock device) and with a real simulated device (the firmware code)."""

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from backend.chat import MAX_QUERY_CHARS
from backend.dialogue.device_chat import SentenceStream
from backend.server import Bridge
from testkit.llm_server import FakeCall, Reply
from testkit.settings import DEVICE_TOKEN
from testkit.stock_device import WireDevice, answer_when, answer_with, stock_error, stock_tools
from tests.helpers import eventually, wait_state

QUESTION = "How long should I brush my teeth?"


def detect(device: WireDevice, text: str) -> dict[str, Any]:
    return {"session_id": device.session_id, "type": "listen", "state": "detect", "text": text}


def summary(messages: list[dict[str, Any]]) -> list[str]:
    """`stt`, `llm`, `tts:start`, `tts:sentence_start`, `tts:stop`... in arrival order."""
    return [m["type"] + (f":{m['state']}" if m["type"] == "tts" else "") for m in messages]


def tts_stops(device: WireDevice) -> int:
    return sum(1 for m in device.messages if m.get("type") == "tts" and m["state"] == "stop")


async def ready(bridge: Bridge, wire_devices: Any, **kwargs: Any) -> WireDevice:
    device: WireDevice = wire_devices(**kwargs)
    await device.connect()
    await wait_state(bridge, device.device_id)
    return device


async def test_text_turn_is_answered_in_protocol_order(bridge, wire_devices):
    device = await ready(bridge, wire_devices)
    await device.send(detect(device, QUESTION))
    await device.wait_for_count(lambda: tts_stops(device), 1)

    kinds = summary(device.messages)
    sentences = kinds.count("tts:sentence_start")
    assert sentences >= 2
    assert kinds == ["stt", "llm", "tts:start"] + ["tts:sentence_start"] * sentences + ["tts:stop"]
    stt, llm = device.messages[0], device.messages[1]
    assert stt["text"] == QUESTION and stt["session_id"] == device.session_id
    assert llm["emotion"] == "thinking"  # offline: the answer is quoted from references
    spoken = [m["text"] for m in device.messages if m.get("state") == "sentence_start"]
    assert all("http" not in line and "Sources" not in line for line in spoken)
    assert any("2 minutes" in line for line in spoken)

    conversation = await bridge.frontends.memory.conversation_for_device(device.device_id)
    stored = await bridge.frontends.memory.get(conversation.id, with_messages=True)
    assert stored.messages[0].content == QUESTION
    assert "Sources:" in stored.messages[1].content  # stored with its sources, not spoken


async def test_model_answer_is_split_into_sentences(bridge_factory, wire_devices, fake_llm):
    bridge = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    fake_llm.script("chat", Reply("**Brush** twice a day. Use fluoride toothpaste! Floss too?"))
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN)
    try:
        await device.connect()
        await wait_state(bridge, device.device_id)
        await device.send(detect(device, QUESTION))
        await device.wait_for_count(lambda: tts_stops(device), 1)
    finally:
        await device.close()
    spoken = [m["text"] for m in device.messages if m.get("state") == "sentence_start"]
    assert spoken == ["Brush twice a day.", "Use fluoride toothpaste!", "Floss too?"]
    assert device.messages[1]["type"] == "llm" and device.messages[1]["emotion"] == "happy"


@pytest.mark.parametrize(
    ("text", "emotion"),
    [("Who won the football match last night?", "confused"), ("Set the volume to 30", "sad")],
)
async def test_emotion_follows_the_outcome(bridge, wire_devices, text, emotion):
    device = await ready(bridge, wire_devices)
    device.handlers["tools/call"] = answer_with(lambda p: stock_error(p, "Speaker is broken"))
    await device.send(detect(device, text))
    await device.wait_for_count(lambda: tts_stops(device), 1)
    assert device.messages[1]["type"] == "llm" and device.messages[1]["emotion"] == emotion


async def test_a_simulated_device_changes_its_volume_by_text(bridge, simulated_devices):
    sim = await simulated_devices(bridge)
    assert sim.hal.get_volume() != 30
    assert await sim.app.send_text("Set the volume to 30")
    await eventually(lambda: ("assistant", "Volume set to 30.") in sim.hal.shown)
    assert sim.hal.get_volume() == 30
    assert ("user", "Set the volume to 30") in sim.hal.shown
    assert ("system", "emotion: happy") in sim.hal.shown


async def test_a_new_detect_cancels_the_running_turn(bridge, wire_devices):
    device = await ready(bridge, wire_devices, tools=stock_tools())
    reached, release = asyncio.Event(), asyncio.Event()
    device.handlers["tools/call"] = answer_when(release, reached)
    await device.send(detect(device, "Set the volume to 30"))
    await asyncio.wait_for(reached.wait(), 5)  # turn 1 waits on the device's tool
    first = bridge.frontends.device_chat.running(device.device_id)
    assert first is not None

    await device.send(detect(device, QUESTION))
    await device.wait_for_count(lambda: tts_stops(device), 1)
    assert first.cancelled()
    kinds = summary(device.messages)
    assert kinds[:4] == ["stt", "stt", "llm", "tts:start"] and kinds[-1] == "tts:stop"
    assert [device.messages[0]["text"], device.messages[1]["text"]] == [
        "Set the volume to 30",
        QUESTION,
    ]
    conversation = await bridge.frontends.memory.conversation_for_device(device.device_id)
    stored = await bridge.frontends.memory.get(conversation.id, with_messages=True)
    assert [m.content for m in stored.messages if m.role == "user"] == [QUESTION]
    release.set()
    await device.round_trip()
    assert tts_stops(device) == 1


async def test_abort_cancels_the_turn(bridge, wire_devices):
    device = await ready(bridge, wire_devices, tools=stock_tools())
    reached = asyncio.Event()
    device.handlers["tools/call"] = answer_when(asyncio.Event(), reached)
    await device.send(detect(device, "Set the volume to 30"))
    await asyncio.wait_for(reached.wait(), 5)
    turn = bridge.frontends.device_chat.running(device.device_id)
    assert turn is not None
    await device.send({"session_id": device.session_id, "type": "abort", "reason": "wake_word"})
    await asyncio.wait([turn], timeout=5)
    assert turn.cancelled()
    await device.round_trip()
    assert summary(device.messages) == ["stt"]  # nothing spoken after the abort


async def test_listen_without_text_starts_nothing(bridge, wire_devices):
    device = await ready(bridge, wire_devices)
    await device.send({"session_id": device.session_id, "type": "listen", "state": "start"})
    await device.send(detect(device, "   "))
    await device.send(detect(device, QUESTION))
    await device.wait_for_count(lambda: tts_stops(device), 1)
    assert [m["text"] for m in device.messages if m["type"] == "stt"] == [QUESTION]


async def test_the_stock_wake_word_is_not_a_question(bridge, wire_devices):
    device = await ready(bridge, wire_devices)
    await device.send(detect(device, "你好小智"))  # what stock firmware sends when it wakes
    await device.send(detect(device, "Hi ESP!"))
    await device.send(detect(device, QUESTION))
    await device.wait_for_count(lambda: tts_stops(device), 1)
    assert [m["text"] for m in device.messages if m["type"] == "stt"] == [QUESTION]


async def test_an_overlong_question_is_ignored_with_one_warning(bridge, wire_devices):
    device = await ready(bridge, wire_devices)
    with capture_logs() as logs:
        for _ in range(3):
            await device.send(detect(device, "t" * (MAX_QUERY_CHARS + 1)))
        await device.send(detect(device, QUESTION))
        await device.wait_for_count(lambda: tts_stops(device), 1)
    assert [m["text"] for m in device.messages if m["type"] == "stt"] == [QUESTION]
    warnings = [e for e in logs if e["event"] == "device question too long; ignored"]
    assert [e["chars"] for e in warnings] == [MAX_QUERY_CHARS + 1] * 3  # within its budget of 5
    assert all(len(str(e)) < 1000 for e in logs)  # the text itself is clipped or left out


async def test_tool_calls_go_to_the_speaking_device(bridge_factory, fake_llm, simulated_devices):
    bridge = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    first = await simulated_devices(bridge, 1)
    second = await simulated_devices(bridge, 2)
    fake_llm.script(
        "chat",
        Reply(calls=[FakeCall("self_audio_speaker_set_volume", {"volume": 12})]),
        Reply("Done, the volume is 12."),
    )
    before = first.hal.get_volume()
    assert await second.app.send_text("Please set the volume to 12")
    await eventually(lambda: ("assistant", "Done, the volume is 12.") in second.hal.shown)
    assert second.hal.get_volume() == 12 and first.hal.get_volume() == before


def test_sentences_are_released_once_text_follows_their_end() -> None:
    stream = SentenceStream()
    tokens = ["Brush", " twice a day.", " Floss", " daily!", "\n\n**Tip", ":** see a dentist. "]
    released = [stream.feed(token) for token in tokens]
    assert released == [[], [], ["Brush twice a day."], [], ["Floss daily!"], []]
    assert stream.flush() == ["Tip: see a dentist."]
