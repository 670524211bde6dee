"""The voice loop end to end: a stock-style voice device speaks to a real bridge over a real
WebSocket (and MQTT + UDP), the embedded stack recognizes it, the offline chat answers, and
the answer comes back as paced audio in protocol order."""

import asyncio

import pytest
from structlog.testing import capture_logs

from backend.devices.state import DeviceEvent, EventKind
from backend.server import Bridge
from backend.voice.tts import render
from simulator.voice_client import VoiceDevice, speak_turn
from testkit.mosquitto import free_port
from testkit.settings import DEVICE_TOKEN
from tests.helpers import eventually, wait_state
from tests.voice_helpers import spoken

# real-time pacing bounds (frames in flight, stop margin): alone on the CPU
pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.fixture
async def voice_bridge(bridge_factory) -> Bridge:
    return await bridge_factory(voice_enabled=True)


def _device(bridge: Bridge, device_id: str, **kwargs) -> VoiceDevice:
    return VoiceDevice.websocket(
        bridge.ws_url, DEVICE_TOKEN, device_id, f"client-{device_id}", **kwargs
    )


@pytest.mark.parametrize("version", [1, 3])
async def test_spoken_command_is_recognized_acted_on_and_answered_aloud(voice_bridge, version):
    clip = render("set the volume to thirty", "en", 16000)
    device_id = f"02:00:00:00:0{version}:01"
    async with _device(voice_bridge, device_id, version=version) as device:
        await wait_state(voice_bridge, device_id)
        reply = await speak_turn(device, clip)
    assert reply.kinds[:3] == ["stt", "llm", "tts start"], reply.kinds
    assert reply.kinds[-1] == "tts stop"
    assert "tts sentence_start" in reply.kinds
    assert (reply.transcript or "").lower().startswith("set the volume")
    assert device.mcp.calls[-1] == ("self.audio_speaker.set_volume", {"volume": 30})
    # The answer is audio at the announced rate, all of it played before `tts stop`.
    assert device.server_audio.sample_rate == 24000
    assert reply.audio.duration_ms > 500
    assert reply.counters.dropped_overflow == 0 and reply.counters.cut_at_stop == 0
    assert reply.max_in_flight <= 40
    assert reply.stop_margin_ms >= 0


QUESTION = "how often should i floss"


async def test_events_come_in_protocol_order_and_stop_waits_for_the_last_frame(voice_bridge):
    async with _device(voice_bridge, "02:00:00:00:10:01", version=2) as device:
        await wait_state(voice_bridge, "02:00:00:00:10:01")
        reply = await speak_turn(device, render(QUESTION, "en", 16000))
    kinds = reply.kinds
    assert kinds[:3] == ["stt", "llm", "tts start"] and kinds[-1] == "tts stop"
    assert set(kinds[3:-1]) == {"tts sentence_start"}
    assert reply.transcript
    first_frame = reply.frames[0][0]
    start_at = next(t for t, m in reply.events if m.get("state") == "start")
    sentence_at = next(t for t, m in reply.events if m.get("state") == "sentence_start")
    assert start_at <= sentence_at <= first_frame  # `tts start`, its sentence, then audio
    # Paced, not burst: the answer took about as long to arrive as it lasts.
    arrival_span_ms = (reply.frames[-1][0] - first_frame) * 1000
    assert arrival_span_ms >= reply.audio.duration_ms * 0.8
    assert reply.max_in_flight <= 4 and reply.stop_margin_ms >= 0
    # The turn's timings reached the log and the device events.
    answer = voice_bridge.frontends.voice.answers[-1]
    report = answer.timings.report()
    assert report["end_of_speech_ms"] == 0
    stages = ["recognized_ms", "first_token_ms", "first_audio_ms", "first_frame_sent_ms"]
    values = [report[stage] for stage in stages]
    assert values == sorted(values) and report["last_frame_due_ms"] <= report["stopped_ms"]


async def test_mqtt_udp_device_holds_a_voice_turn(bridge_factory):
    from backend.transports.mqtt_credentials import DerivedCredentials

    secret = "voice-loop-mqtt-secret-0123456789"
    bridge = await bridge_factory(
        voice_enabled=True,
        mqtt_url="embedded",
        mqtt_host="127.0.0.1",
        mqtt_port=0,
        mqtt_secret=secret,
        udp_host="127.0.0.1",
        udp_port=0,
    )
    device_id = "02:00:00:00:20:01"
    password = DerivedCredentials(secret.encode()).issue(device_id).password
    device = VoiceDevice.mqtt(bridge.mqtt.device_url, device_id, password)
    async with device:
        await wait_state(bridge, device_id, timeout_s=10)
        reply = await speak_turn(device, render("set the volume to seventy", "en", 16000))
    assert device.mcp.calls[-1] == ("self.audio_speaker.set_volume", {"volume": 70})
    assert reply.kinds[:3] == ["stt", "llm", "tts start"] and reply.kinds[-1] == "tts stop"
    assert reply.audio.duration_ms > 500 and reply.counters.cut_at_stop == 0


async def test_pcm16_device_gets_pcm16_at_16_khz(voice_bridge):
    device_id = "02:00:00:00:30:01"
    async with _device(voice_bridge, device_id, audio_format="pcm16") as device:
        await wait_state(voice_bridge, device_id)
        assert device.server_hello["audio_params"]["format"] == "pcm16"
        assert device.server_audio.sample_rate == 16000
        reply = await speak_turn(device, spoken("set the volume to forty"))
    assert device.mcp.calls[-1] == ("self.audio_speaker.set_volume", {"volume": 40})
    assert all(len(payload) == 1920 for _, payload in reply.frames)  # 60 ms of 16 kHz PCM16
    assert reply.audio.duration_ms == len(reply.frames) * 60


async def test_manual_mode_ends_the_utterance_at_listen_stop(voice_bridge):
    device_id = "02:00:00:00:40:01"
    async with _device(voice_bridge, device_id) as device:
        await wait_state(voice_bridge, device_id)
        await device.listen_start("manual")
        # No trailing silence: only `listen stop` can end this utterance.
        await device.send_speech(
            render("set the volume to twenty", "en", 16000), trailing_silence_ms=0
        )
        await device.listen_stop()
        reply = await device.wait_turn(timeout_s=30)
    assert device.mcp.calls[-1] == ("self.audio_speaker.set_volume", {"volume": 20})
    assert reply.kinds[-1] == "tts stop"


async def test_abort_mid_answer_stops_the_downlink_and_the_next_turn_is_clean(voice_bridge):
    device_id = "02:00:00:00:50:01"
    async with _device(voice_bridge, device_id) as device:
        await wait_state(voice_bridge, device_id)
        await device.listen_start("auto")
        await device.send_speech(render(QUESTION, "en", 16000))
        await _wait_frames(device, 5)
        await device.abort()
        aborted_at = device.clock()
        reply = await device.wait_turn(timeout_s=10)
        late = [t for t, _ in reply.frames if t > aborted_at + 0.05]
        assert late == [] and reply.kinds[-1] == "tts stop"
        assert voice_bridge.frontends.device_chat.running(device_id) is None
        second = await speak_turn(device, render("set the volume to ten", "en", 16000))
    assert second.kinds[:3] == ["stt", "llm", "tts start"] and second.kinds[-1] == "tts stop"
    assert device.mcp.calls[-1] == ("self.audio_speaker.set_volume", {"volume": 10})


async def test_speech_while_speaking_in_realtime_mode_interrupts_the_answer(voice_bridge):
    device_id = "02:00:00:00:60:01"
    async with _device(voice_bridge, device_id) as device:
        await wait_state(voice_bridge, device_id)
        await device.listen_start("realtime")
        await device.send_speech(render(QUESTION, "en", 16000))
        await _wait_frames(device, 5)
        barge = asyncio.create_task(
            device.send_speech(render("set the volume to forty", "en", 16000))
        )
        first = await device.wait_turn(timeout_s=15)  # the interrupted answer's `tts stop`
        await barge
        second = await device.wait_turn(timeout_s=30)
    assert first.kinds[-1] == "tts stop"
    assert second.transcript is not None and "40" in second.transcript
    assert device.mcp.calls[-1] == ("self.audio_speaker.set_volume", {"volume": 40})


async def test_the_device_is_heard_again_as_soon_as_tts_stop_goes_out(voice_bridge):
    # A device answers `tts stop` with `listen start` and speech at once, while the turn still
    # logs its timings: that speech must not be dropped as echo of the answer.
    device_id = "02:00:00:00:71:01"
    speaking_after_stop: list[bool] = []

    def on_event(event: DeviceEvent) -> None:
        if event.kind is EventKind.VOICE_TURN:  # emitted after `tts stop`, inside the turn
            chat = voice_bridge.frontends.device_chat
            assert chat.running(device_id) is not None
            speaking_after_stop.append(chat.speaking(device_id))

    unsubscribe = voice_bridge.registry.subscribe(on_event)
    try:
        async with _device(voice_bridge, device_id) as device:
            await wait_state(voice_bridge, device_id)
            reply = await speak_turn(device, render("set the volume to thirty", "en", 16000))
    finally:
        unsubscribe()
    assert reply.kinds[-1] == "tts stop"
    assert speaking_after_stop == [False]


async def test_wake_word_pre_roll_is_not_taken_as_the_question(voice_bridge):
    device_id = "02:00:00:00:70:01"
    async with _device(voice_bridge, device_id) as device:
        await wait_state(voice_bridge, device_id)
        # The stock device sends the wake word's audio first, faster than real time.
        await device.send_speech(render("set the volume to ninety", "en", 16000), realtime=False)
        await device.listen_detect("hi esp")
        reply = await speak_turn(device, render("set the volume to thirty", "en", 16000))
    assert device.mcp.calls == [("self.audio_speaker.set_volume", {"volume": 30})]
    assert "ninety" not in (reply.transcript or "")


async def _wait_frames(device: VoiceDevice, count: int, timeout_s: float = 20) -> None:
    await eventually(lambda: len(device.frames) >= count, timeout_s)


async def test_unreachable_speech_providers_fall_back_to_the_embedded_engines(bridge_factory):
    closed = f"http://127.0.0.1:{free_port()}"
    bridge = await bridge_factory(
        voice_enabled=True,
        asr_provider="openai",
        asr_base_url=closed,
        asr_api_key="sk-never-logged",
        tts_provider="openai",
        tts_base_url=closed,
        tts_api_key="sk-never-logged",
    )
    device_id = "02:00:00:00:80:01"
    with capture_logs() as logs:
        async with _device(bridge, device_id) as device:
            await wait_state(bridge, device_id)
            first = await speak_turn(device, render("set the volume to thirty", "en", 16000))
            second = await speak_turn(device, render("set the volume to ninety", "en", 16000))
    transcripts = [first.transcript, second.transcript]
    assert [call[1] for call in device.mcp.calls] == [{"volume": 30}, {"volume": 90}], transcripts
    for reply in (first, second):
        assert reply.kinds[-1] == "tts stop" and reply.audio.duration_ms > 500
    provider_lines = [line for line in logs if "provider" in line["event"]]
    assert 1 <= len(provider_lines) <= 4  # once per outage and engine, not once per utterance
    assert "sk-never-logged" not in repr(logs)
