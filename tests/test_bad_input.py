"""Bad input from devices: each case has a defined outcome, one log line, no harm to others."""

import asyncio
import json

import pytest
from structlog.testing import capture_logs

from backend.devices import DeviceState
from testkit.stock_device import STOCK_HELLO, WireDevice, answer_with, never_answer, ok
from tests.helpers import ManualClock, eventually, wait_state


async def healthy_call(device) -> None:
    """The bridge still serves this device: a real tools/call round trip."""
    live = device  # registry Device
    result = await live.call_tool("self.audio_speaker.set_volume", {"volume": 33})
    assert result.content == [{"type": "text", "text": "true"}]


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        ("{not json", "invalid JSON"),
        ("[1,2,3]", "expected a JSON object"),
        ('{"type":"listen","state":42}', "invalid 'listen' message"),
        ('{"type":"hello","features":"yes"}', "invalid 'hello' message"),
        ('{"type":"teleport"}', "unknown message type"),
        ('{"session_id":"s"}', "no string 'type'"),
        ('{"type":"mcp"}', "missing 'payload'"),
    ],
)
async def test_bad_text_frames_are_logged_once_and_dropped(bridge, wire_devices, frame, reason):
    device = wire_devices()
    # Session loggers bind at connect time, so capture from before the connection.
    with capture_logs() as logs:
        await device.connect()
        live = await wait_state(bridge, device.device_id)
        await device.send(frame)
        await eventually(lambda: any(e["event"] == "dropped device message" for e in logs))
    dropped = [entry for entry in logs if entry["event"] == "dropped device message"]
    assert len(dropped) == 1 and reason in dropped[0]["reason"]
    assert dropped[0]["device_id"] == device.device_id
    await healthy_call(live)


@pytest.mark.parametrize(
    "payload",
    [
        "just a string",
        42,
        None,
        [],
        [{"jsonrpc": "2.0", "id": 12345, "result": {}}],
        {"jsonrpc": "2.0", "id": "abc", "result": {}},
        {"jsonrpc": "2.0", "id": 999999, "result": {}},
        {"jsonrpc": "2.0", "id": 1.5, "error": "bad"},
        {"jsonrpc": "2.0"},
        {"id": {"nested": True}, "result": None},
    ],
)
async def test_garbage_mcp_payloads_are_logged_once_and_dropped(bridge, wire_devices, payload):
    device = wire_devices()
    with capture_logs() as logs:
        await device.connect()
        live = await wait_state(bridge, device.device_id)
        start = len(logs)
        await device.reply(payload)
        await eventually(lambda: any("dropped" in e["event"] for e in logs[start:]))
        await healthy_call(live)
    warnings = [e for e in logs[start:] if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "dropped" in warnings[0]["event"], warnings
    assert warnings[0]["device_id"] == device.device_id


async def test_binary_frames_that_break_the_framing_are_logged_and_dropped(bridge, wire_devices):
    device = wire_devices(protocol_version=3)  # 4-byte header with the payload size
    with capture_logs() as logs:
        await device.connect()
        live = await wait_state(bridge, device.device_id)
        await device.send(b"\x00\xff" * 100)  # claims 255 bytes, carries 196
        await device.send(b"")
        await eventually(lambda: sum(e["event"] == "dropped audio frame" for e in logs) == 2)
        await healthy_call(live)
    dropped = [e for e in logs if e["event"] == "dropped audio frame"]
    assert "payload_size" in dropped[0]["reason"] and dropped[0]["device_id"] == device.device_id


async def test_oversize_frame_closes_with_1009_and_others_unaffected(bridge, wire_devices):
    victim = wire_devices("a4:cf:00:00:00:0a")
    bystander = wire_devices("a4:cf:00:00:00:0b")
    with capture_logs() as logs:
        await victim.connect()
        await bystander.connect()
        await wait_state(bridge, victim.device_id)
        other = await wait_state(bridge, bystander.device_id)
        await victim.send(json.dumps({"type": "listen", "state": "detect", "text": "x" * 70_000}))
        await victim.ws.wait_closed()
        await eventually(lambda: bridge.registry.get(victim.device_id) is None)
    assert victim.ws.close_code == 1009
    disconnects = [e for e in logs if e["event"] == "device disconnected"]
    assert len(disconnects) == 1 and "1009" in disconnects[0]["reason"]
    await healthy_call(other)


async def test_device_that_never_answers_initialize_fails_but_stays_connected(bridge_factory):
    impatient = await bridge_factory(init_timeout_s=0.3)
    silent = WireDevice(impatient.ws_url, "device-secret-token-for-tests", "a4:cf:00:00:00:0c")
    healthy = WireDevice(impatient.ws_url, "device-secret-token-for-tests", "a4:cf:00:00:00:0d")

    silent.handlers["initialize"] = never_answer
    try:
        with capture_logs() as logs:
            await silent.connect()
            await healthy.connect()
            failed = await wait_state(impatient, silent.device_id, DeviceState.FAILED)
        assert "initialize" in failed.error and "timed out" in failed.error.lower()
        assert [e["event"] for e in logs if e.get("device_id") == silent.device_id].count(
            "MCP handshake failed; device stays connected"
        ) == 1
        # initialize is never cancelled (MCP forbids it), the link stays up.
        assert "notifications/cancelled" not in silent.methods()
        assert impatient.registry.get(silent.device_id) is failed
        await healthy_call(await wait_state(impatient, healthy.device_id))
    finally:
        await silent.close()
        await healthy.close()


async def test_device_answering_garbage_to_tools_list_fails_cleanly(bridge, wire_devices):
    device = wire_devices()

    device.handlers["tools/list"] = answer_with(lambda p: ok(p, "this is not a tools object"))
    await device.connect()
    failed = await wait_state(bridge, device.device_id, DeviceState.FAILED)
    assert failed.error


async def test_device_that_never_sends_hello_is_closed(bridge_factory):
    strict = await bridge_factory(hello_timeout_s=0.2)
    device = WireDevice(strict.ws_url, "device-secret-token-for-tests")
    await device.connect(send_hello=False)
    await device.ws.wait_closed()
    assert device.ws.close_code == 1008
    await eventually(lambda: len(strict.registry) == 0)


async def test_a_device_cut_off_for_a_policy_violation_is_held_off_before_it_reconnects(
    bridge_factory,
):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    # handshake_device: 5/s, burst 2 → a cut-off device waits (2 + 1) / 5 = 0.6 s of the
    # limits' clock, which moves only when the test says.
    clock = ManualClock()
    limits = {"handshake_device": {"per_s": 5, "burst": 2}}
    strict = await bridge_factory(clock=clock, hello_timeout_s=0.1, rate_limits=limits)
    device = WireDevice(strict.ws_url, "device-secret-token-for-tests", "a4:cf:00:00:00:0c")
    await device.connect(send_hello=False)
    await device.ws.wait_closed()
    assert device.ws.close_code == 1008

    async def handshake_status() -> int:
        try:
            async with connect(strict.ws_url, additional_headers=device.headers()):
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code

    assert await handshake_status() == 429
    other = WireDevice(strict.ws_url, "device-secret-token-for-tests", "a4:cf:00:00:00:0d")
    await other.connect()  # another device is not held off
    await wait_state(strict, other.device_id, DeviceState.READY)
    clock.advance(0.5)
    assert await handshake_status() == 429  # still held off: 2.5 of the 3 tokens
    clock.advance(0.25)
    await device.connect()
    await wait_state(strict, device.device_id, DeviceState.READY)
    await asyncio.gather(device.close(), other.close())


async def test_tolerant_of_other_clients_pretty_json_empty_session(bridge, wire_devices):
    device = wire_devices(compact=False)
    await device.connect()
    live = await wait_state(bridge, device.device_id)
    # The device never echoes the session id: nothing depends on it.
    device.session_id = ""
    await device.send({"type": "listen", "state": "start", "mode": "auto"})
    await device.send({"session_id": "", "type": "listen", "state": "detect", "text": "hi"})
    await healthy_call(live)


async def test_repeated_hello_gets_same_session_and_no_reinit(bridge, wire_devices):
    device = wire_devices()
    first = await device.connect()
    await wait_state(bridge, device.device_id)
    inits = device.methods().count("initialize")
    await device.stop_reader()
    await device.send(STOCK_HELLO)
    again = json.loads(await device.ws.recv())
    assert again["session_id"] == first["session_id"]
    device.start_reader()
    await device.round_trip()  # whatever the bridge sent after that hello has arrived
    assert device.methods().count("initialize") == inits == 1
