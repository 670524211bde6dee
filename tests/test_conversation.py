"""The device conversation API: pipelines subscribe to what devices say and answer through a
`Conversation`, never through a transport; here over a real WebSocket device."""

import asyncio
import struct

from structlog.testing import capture_logs

from backend.devices import Conversation
from backend.protocol import Abort, AudioFrame, DeviceHello, Listen
from tests.helpers import eventually, wait_state


async def test_handlers_receive_listen_abort_audio_and_the_hello(bridge, wire_devices):
    opened: list[tuple[str, DeviceHello]] = []
    listens: list[Listen] = []
    aborts: list[Abort] = []
    frames: list[AudioFrame] = []
    ended: list[str] = []
    conversations: list[Conversation] = []

    async def on_listen(conversation: Conversation, message: Listen) -> None:
        conversations.append(conversation)
        listens.append(message)

    bridge.conversations.on_opened(lambda c, hello: opened.append((c.session_id, hello)))
    bridge.conversations.on_listen(on_listen)  # a coroutine handler
    bridge.conversations.on_abort(lambda c, message: aborts.append(message))
    bridge.conversations.on_audio(lambda c, frame: frames.append(frame))
    bridge.conversations.on_ended(lambda c, reason: ended.append(reason))

    device = wire_devices(protocol_version=2)  # 16-byte header with a timestamp
    server_hello = await device.connect()
    await wait_state(bridge, device.device_id)
    assert opened[0][0] == server_hello["session_id"] and opened[0][1].features.mcp

    session = device.session_id
    await device.send({"session_id": session, "type": "listen", "state": "start", "mode": "auto"})
    for index in range(3):
        payload = bytes([index]) * (20 + index)
        header = struct.pack(">HHIII", 2, 0, 0, 1000 + index, len(payload))
        await device.send(header + payload)
    text = {"session_id": session, "type": "listen", "state": "detect", "text": "xin chào"}
    await device.send(text)
    await device.send({"session_id": session, "type": "abort", "reason": "wake_word_detected"})
    await eventually(lambda: len(listens) == 2 and len(aborts) == 1 and len(frames) == 3)

    assert [(m.state, m.mode, m.text) for m in listens] == [
        ("start", "auto", None),
        ("detect", None, "xin chào"),
    ]
    assert aborts[0].reason == "wake_word_detected"
    assert [(f.payload, f.timestamp_ms) for f in frames] == [
        (bytes([i]) * (20 + i), 1000 + i) for i in range(3)
    ]
    assert conversations[0].device_id == device.device_id
    assert conversations[0].session_id == session
    assert conversations[0].uplink_audio is not None
    assert conversations[0].uplink_audio.sample_rate == 16000

    await device.close()
    await eventually(lambda: len(ended) == 1)
    assert "closed" in ended[0]


async def test_messages_sent_through_the_api_reach_the_device_with_its_session(
    bridge, wire_devices
):
    device = wire_devices(protocol_version=3)  # 4-byte header
    await device.connect()
    await wait_state(bridge, device.device_id)
    conversation = bridge.conversations.conversation(device.device_id)

    await conversation.send_stt("how long should I brush?")
    await conversation.send_llm("happy")
    await conversation.send_tts_start()
    await conversation.send_audio(b"\x01\x02\x03")
    await conversation.send_tts_sentence("Two minutes, twice a day.")
    await conversation.send_tts_stop()
    await conversation.send_alert("error", "battery low", "sad")
    await conversation.send_system("reboot")
    await device.wait_for_count(lambda: len(device.messages), 7)
    await device.wait_for_count(lambda: len(device.audio), 1)

    assert {message["session_id"] for message in device.messages} == {device.session_id}
    sent = [{k: v for k, v in m.items() if k != "session_id"} for m in device.messages]
    assert sent == [
        {"type": "stt", "text": "how long should I brush?"},
        {"type": "llm", "emotion": "happy"},
        {"type": "tts", "state": "start"},
        {"type": "tts", "state": "sentence_start", "text": "Two minutes, twice a day."},
        {"type": "tts", "state": "stop"},
        {"type": "alert", "status": "error", "message": "battery low", "emotion": "sad"},
        {"type": "system", "command": "reboot"},
    ]
    assert device.audio == [b"\x00\x00\x00\x03\x01\x02\x03"]  # v3: type, reserved, size, payload


async def test_goodbye_on_websocket_closes_the_link(bridge, wire_devices):
    device = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    await bridge.conversations.conversation(device.device_id).goodbye()
    await device.ws.wait_closed()
    assert device.ws.close_code == 1000
    await eventually(lambda: bridge.registry.get(device.device_id) is None)


async def test_a_failing_or_slow_handler_never_holds_up_the_device(bridge, wire_devices):
    release = asyncio.Event()

    async def slow(conversation: Conversation, message: Listen) -> None:
        await release.wait()

    def broken(conversation: Conversation, message: Listen) -> None:
        raise RuntimeError("pipeline bug")

    bridge.conversations.on_listen(slow)
    bridge.conversations.on_listen(broken)
    device = wire_devices()
    with capture_logs() as logs:
        await device.connect()
        live = await wait_state(bridge, device.device_id)
        await device.send({"session_id": "", "type": "listen", "state": "start"})
        result = await live.call_tool("self.audio_speaker.set_volume", {"volume": 12})
    assert result.content == [{"type": "text", "text": "true"}]  # the link kept serving
    assert any(e["event"] == "conversation handler failed" for e in logs)
    release.set()


async def test_no_conversation_for_an_unknown_or_offline_device(bridge, wire_devices):
    import pytest

    from backend.devices import DeviceOffline, UnknownDevice

    with pytest.raises(UnknownDevice):
        bridge.conversations.conversation("a4:cf:00:00:00:99")
    device = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    await device.close()
    await eventually(lambda: bridge.registry.get(device.device_id) is None)
    with pytest.raises(DeviceOffline):
        bridge.conversations.conversation(device.device_id)
