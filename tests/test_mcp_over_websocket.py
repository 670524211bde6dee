"""The bridge as MCP client of real devices: discovery, calls through the admin API, failures."""

import asyncio
import json
import time

import pytest

from backend.devices import DeviceState
from testkit.stock_device import (
    STATUS_TOOL,
    VOLUME_TOOL,
    answer_with,
    hang_and_signal,
    never_answer,
    ok,
    stock_error,
    text_result,
)
from tests.helpers import eventually, wait_state


def many_tools(count: int) -> list[dict]:
    return [
        {
            "name": f"self.board.tool_{i:03d}",
            "description": "A board tool with a long description. " * 6,
            "inputSchema": {"type": "object", "properties": {"x": {"type": "integer"}}},
        }
        for i in range(count)
    ]


async def test_discovery_sequence_and_pagination(bridge, wire_devices):
    tools = [STATUS_TOOL, VOLUME_TOOL, *many_tools(10)]
    device = wire_devices(tools=tools, page_size=4)
    await device.connect()
    ready = await wait_state(bridge, device.device_id)

    methods = device.methods()
    assert methods[:3] == ["initialize", "notifications/initialized", "tools/list"]
    lists = [p for p in device.received if p.get("method") == "tools/list"]
    assert len(lists) == 3  # 12 tools, 4 per page
    assert lists[0]["params"]["cursor"] == ""
    assert [p["params"]["cursor"] for p in lists[1:]] == [tools[4]["name"], tools[8]["name"]]
    assert [tool.name for tool in ready.tool_list()] == [tool["name"] for tool in tools]
    assert ready.server_info == {"name": "bread-compact-wifi", "version": "2.4.2"}

    init = device.received[0]
    assert init["params"]["protocolVersion"] == "2024-11-05"
    ids = [p["id"] for p in device.received if "id" in p]
    assert all(isinstance(i, int) for i in ids) and ids == sorted(set(ids))


async def test_simulated_firmware_lists_three_pages(bridge):
    from simulator import SimulatedDevice

    sim = SimulatedDevice(bridge.ws_url, "device-secret-token-for-tests", extra_tools=60)
    sim.start()
    try:
        device = await wait_state(bridge, sim.device_id, timeout_s=10)
        assert len(device.tool_list()) == 7 + 60
        assert device.server_info["name"] == "sim-device"
    finally:
        await sim.stop()


async def test_call_success_through_api(bridge, api, wire_devices):
    device = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    response = await api.post(
        f"/api/devices/{device.device_id}/tools/call",
        json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": 42}},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["content"] == [{"type": "text", "text": "true"}]
    assert body["isError"] is False and body["duration_ms"] > 0
    assert device.volume == 42
    call = await device.wait_for_method("tools/call")
    assert call["params"] == {"name": "self.audio_speaker.set_volume", "arguments": {"volume": 42}}


async def test_is_error_result_is_returned_not_raised(bridge, api, wire_devices):
    device = wire_devices()

    device.handlers["tools/call"] = answer_with(
        lambda p: ok(p, text_result("speaker unplugged", is_error=True))
    )
    await device.connect()
    await wait_state(bridge, device.device_id)
    response = await api.post(
        f"/api/devices/{device.device_id}/tools/call",
        json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": 1}},
    )
    assert response.status_code == 200
    assert response.json()["isError"] is True
    assert response.json()["content"][0]["text"] == "speaker unplugged"


async def test_device_error_without_code_is_502_with_its_message(bridge, api, wire_devices):
    device = wire_devices()

    device.handlers["tools/call"] = answer_with(
        lambda p: stock_error(p, "Value exceeds maximum allowed: 100")
    )
    await device.connect()
    await wait_state(bridge, device.device_id)
    response = await api.post(
        f"/api/devices/{device.device_id}/tools/call",
        json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": 100}},
    )
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "device_error"
    assert "Value exceeds maximum allowed: 100" in error["message"]


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"volume": 101}, "maximum"),
        ({"volume": "loud"}, 'not of type "integer"'),
        ({}, '"volume" is a required property'),
    ],
)
async def test_arguments_checked_against_schema_before_sending(
    bridge, api, wire_devices, arguments, fragment
):
    device = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    response = await api.post(
        f"/api/devices/{device.device_id}/tools/call",
        json={"name": "self.audio_speaker.set_volume", "arguments": arguments},
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_arguments"
    assert fragment in response.json()["error"]["message"]
    assert "tools/call" not in device.methods()


async def test_unknown_device_and_unknown_tool_are_404(bridge, api, wire_devices):
    device = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    missing_device = await api.post("/api/devices/00:00:00:00:00:00/tools/call", json={"name": "x"})
    assert missing_device.status_code == 404
    assert missing_device.json()["error"]["code"] == "unknown_device"
    missing_tool = await api.post(
        f"/api/devices/{device.device_id}/tools/call", json={"name": "self.nope"}
    )
    assert missing_tool.status_code == 404
    assert missing_tool.json()["error"]["code"] == "unknown_tool"


async def test_timeout_is_504_and_device_sees_cancellation(bridge, api, wire_devices):
    device = wire_devices()

    device.handlers["tools/call"] = never_answer
    await device.connect()
    await wait_state(bridge, device.device_id)
    response = await api.post(
        f"/api/devices/{device.device_id}/tools/call",
        json={"name": "self.get_device_status", "timeout_s": 0.3},
    )
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    call = await device.wait_for_method("tools/call")
    cancelled = await device.wait_for_method("notifications/cancelled")
    assert cancelled["params"]["requestId"] == call["id"]
    # A late reply is dropped and the link keeps working.
    await device.reply(ok(call, {"content": [], "isError": False}))
    device.handlers.pop("tools/call")
    again = await api.post(
        f"/api/devices/{device.device_id}/tools/call", json={"name": "self.get_device_status"}
    )
    assert again.status_code == 200


async def test_device_killed_mid_call_fails_fast_with_503(bridge, api, wire_devices):
    device = wire_devices()
    called = asyncio.Event()
    device.handlers["tools/call"] = hang_and_signal(called)
    await device.connect()
    await wait_state(bridge, device.device_id)
    request = asyncio.create_task(
        api.post(
            f"/api/devices/{device.device_id}/tools/call",
            json={"name": "self.get_device_status", "timeout_s": 30},
        )
    )
    await called.wait()
    killed_at = time.perf_counter()
    await device.kill()
    response = await request
    elapsed = time.perf_counter() - killed_at
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "device_disconnected"
    assert elapsed < 10  # far below the 30 s timeout; the real figure is in bench/disconnect.py
    await eventually(lambda: bridge.registry.get(device.device_id) is None)


async def test_reconnect_with_same_device_id_replaces_old_link(bridge, api, wire_devices):
    old = wire_devices()
    hung = asyncio.Event()
    old.handlers["tools/call"] = hang_and_signal(hung)
    await old.connect()
    first = await wait_state(bridge, old.device_id)
    pending = asyncio.create_task(
        api.post(
            f"/api/devices/{old.device_id}/tools/call",
            json={"name": "self.get_device_status", "timeout_s": 30},
        )
    )
    await hung.wait()
    new = wire_devices()  # same Device-Id
    await new.connect()
    await eventually(lambda: bridge.registry.get(new.device_id) is not first)
    second = await wait_state(bridge, new.device_id)

    response = await pending
    assert response.status_code == 503
    assert "replaced" in response.json()["error"]["message"]
    assert first.mcp.pending_count == 0
    await old.ws.wait_closed()
    assert old.ws.close_code == 1000
    assert len(bridge.registry) == 1 and bridge.registry.get(new.device_id) is second
    ok_response = await api.post(
        f"/api/devices/{new.device_id}/tools/call",
        json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": 7}},
    )
    assert ok_response.status_code == 200 and new.volume == 7


async def test_200_concurrent_calls_on_one_link_match_their_replies(bridge, wire_devices):
    device = wire_devices()

    async def echo_later(dev, payload):
        value = payload["params"]["arguments"]["volume"]
        await asyncio.sleep((value % 7) / 1000)  # replies come back out of order
        text = json.dumps({"echo": value})
        return ok(payload, {"content": [{"type": "text", "text": text}], "isError": False})

    device.handlers["tools/call"] = echo_later
    await device.connect()
    live = await wait_state(bridge, device.device_id)
    results = await asyncio.gather(
        *(live.call_tool("self.audio_speaker.set_volume", {"volume": i % 101}) for i in range(200))
    )
    echoes = [json.loads(result.content[0]["text"])["echo"] for result in results]
    assert echoes == [i % 101 for i in range(200)]
    assert live.mcp.pending_count == 0


async def test_user_only_tools_filtered_by_query(bridge, api, wire_devices):
    user_tool = {
        "name": "self.reboot",
        "description": "Reboot",
        "inputSchema": {"type": "object", "properties": {}},
        "annotations": {"audience": ["user"]},
    }
    device = wire_devices(tools=[STATUS_TOOL, VOLUME_TOOL, user_tool])
    await device.connect()
    await wait_state(bridge, device.device_id)
    listed = device.received[2]
    assert listed["params"].get("withUserTools") is True
    listing = (await api.get(f"/api/devices/{device.device_id}/tools?user=true")).json()
    assert listing["cached"] is False and listing["state"] == "ready"
    all_tools = listing["tools"]
    ai_tools = (await api.get(f"/api/devices/{device.device_id}/tools?user=false")).json()["tools"]
    assert [t["name"] for t in all_tools] == [
        STATUS_TOOL["name"],
        VOLUME_TOOL["name"],
        "self.reboot",
    ]
    assert [t["name"] for t in ai_tools] == [STATUS_TOOL["name"], VOLUME_TOOL["name"]]
    assert all_tools[1]["inputSchema"] == VOLUME_TOOL["inputSchema"]


async def test_tools_list_changed_triggers_relist(bridge, wire_devices):
    device = wire_devices()
    await device.connect()
    live = await wait_state(bridge, device.device_id)
    device.tools = [
        *device.tools,
        {"name": "self.new", "description": "", "inputSchema": {"type": "object"}},
    ]
    await device.reply({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
    await eventually(lambda: "self.new" in live.tools.by_name)


async def test_device_request_is_answered_method_not_found(bridge, wire_devices):
    device = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    await device.reply({"jsonrpc": "2.0", "id": 99, "method": "sampling/createMessage"})
    await eventually(lambda: any(p.get("id") == 99 and "error" in p for p in device.received))
    answer = next(p for p in device.received if p.get("id") == 99)
    assert answer["error"]["code"] == -32601


async def test_device_without_mcp_feature_is_ready_without_tools(bridge, wire_devices):
    device = wire_devices(hello={"type": "hello", "version": 1, "transport": "websocket"})
    await device.connect()
    live = await wait_state(bridge, device.device_id)
    assert live.tool_list() == []
    assert device.ws is not None
    await (await device.ws.ping())  # everything the bridge sent before the pong has arrived
    assert device.received == [] and live.mcp.pending_count == 0


async def test_vision_capability_sent_but_token_never_logged(bridge_factory, capsys):
    from structlog.testing import capture_logs

    vision_bridge = await bridge_factory(
        vision_url="http://10.0.0.2:8003/vision", vision_token="v-secret-1"
    )
    from testkit.stock_device import WireDevice

    device = WireDevice(vision_bridge.ws_url, "device-secret-token-for-tests")
    with capture_logs() as logs:
        await device.connect()
        await wait_state(vision_bridge, device.device_id)
    try:
        init = device.received[0]
        assert init["params"]["capabilities"]["vision"] == {
            "url": "http://10.0.0.2:8003/vision",
            "token": "v-secret-1",
        }
        assert "v-secret-1" not in repr(logs)
        assert "device-secret-token-for-tests" not in repr(logs)
    finally:
        await device.close()


async def test_device_state_summary_in_api(bridge, api, wire_devices):
    device = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    page = (await api.get("/api/devices")).json()
    assert page["total"] == 1 and page["next_cursor"] is None
    listing = page["devices"]
    summary = (await api.get(f"/api/devices/{device.device_id}")).json()
    assert listing == [summary]
    assert summary["state"] == DeviceState.READY.value
    assert summary["transport"] == "websocket"
    assert summary["tool_count"] == 2
    assert summary["client_id"] == "6c4a5a2e-2f0e-4a4e-9d59-3b2d1c0e9f11"
    assert summary["server_info"]["name"] == "bread-compact-wifi"
