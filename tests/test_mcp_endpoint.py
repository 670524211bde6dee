"""`/mcp` with the official MCP SDK client (`streamable_http_client` + `ClientSession`) against a
real bridge: conversations as resources, the search tools, a real simulated device's tools,
scopes, sessions bound to their key, and `tools/list_changed` when devices come and go."""

import json
from typing import Any

import anyio
import httpx
import pytest
from mcp import types
from mcp.shared.exceptions import MCPError

from backend.api.mcp_endpoint import safe_device_ids
from backend.chat.search import SearchResult
from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN
from tests.fakes.search import FakeWebSearch
from tests.helpers import create_key, sse_events, wait_state
from tests.mcp_helpers import VOLUME, mcp_session


async def chat_turn(bridge: Bridge, message: str, conversation_id: str) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with (
        httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30) as http,
        http.stream(
            "POST",
            "/api/chat/stream",
            json={"message": message, "conversation_id": conversation_id},
        ) as response,
    ):
        assert (await sse_events(response))[-1]["type"] == "done"


async def test_resources_are_conversations(bridge):
    await chat_turn(bridge, "How often should I floss?", "floss-talk")
    async with mcp_session(bridge, await create_key(bridge, "chat:use")) as session:
        listed = await session.list_resources()
        assert [r.uri for r in listed.resources] == ["memory://conversation/floss-talk"]
        assert listed.resources[0].title == "How often should I floss?"
        templates = await session.list_resource_templates()
        assert templates.resource_templates[0].uri_template == (
            "memory://conversation/{conversation_id}"
        )

        read = await session.read_resource("memory://conversation/floss-talk")
        [contents] = read.contents
        assert isinstance(contents, types.TextResourceContents)
        assert contents.mime_type == "application/json"
        conversation = json.loads(contents.text)
        assert conversation["id"] == "floss-talk" and conversation["summary"]
        assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]
        assert conversation["messages"][0]["content"] == "How often should I floss?"

        with pytest.raises(MCPError) as caught:
            await session.read_resource("memory://conversation/nope")
        assert caught.value.code == types.INVALID_PARAMS


async def test_device_tools_listed_and_called_on_a_real_device(bridge, simulated_devices):
    sim = await simulated_devices(bridge)
    token = await create_key(bridge, "devices:call")
    async with mcp_session(bridge, token) as session:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        assert VOLUME in tools and "device.02-00-00-00-00-01.self.reboot" not in tools
        assert not {"duckduckgo_search", "knowledge_base_search"} & tools.keys()  # chat:use
        volume = tools[VOLUME]
        assert volume.input_schema["properties"]["volume"]["maximum"] == 100
        assert volume.meta == {
            "esp32-mcp-bridge/device_id": sim.device_id,
            "esp32-mcp-bridge/tool": "self.audio_speaker.set_volume",
        }

        result = await session.call_tool(VOLUME, {"volume": 17})
        assert not result.is_error and result.content[0].text == "true"
        assert sim.hal.get_volume() == 17

        bad = await session.call_tool(VOLUME, {"volume": 500})  # checked against the schema
        assert bad.is_error and "invalid arguments" in bad.content[0].text
        assert sim.hal.get_volume() == 17

        with pytest.raises(MCPError) as caught:
            await session.call_tool("device.02-00-00-00-00-01.self.nope", {})
        assert caught.value.code == types.INVALID_PARAMS


async def test_a_key_without_devices_call_cannot_call_a_device_tool(bridge, simulated_devices):
    sim = await simulated_devices(bridge)
    before = sim.hal.get_volume()
    token = await create_key(bridge, "devices:read", "chat:use")
    async with mcp_session(bridge, token) as session:
        assert VOLUME in {tool.name for tool in (await session.list_tools()).tools}
        with pytest.raises(MCPError) as caught:
            await session.call_tool(VOLUME, {"volume": 5})
    assert caught.value.code == -32001
    assert "missing scope devices:call" in caught.value.message
    assert caught.value.data["required_scope"] == "devices:call"
    assert sim.hal.get_volume() == before


async def test_a_chat_only_key_sees_searches_and_no_devices(bridge, simulated_devices):
    await simulated_devices(bridge)
    bridge.frontends.chat.web = FakeWebSearch(
        [SearchResult("Flossing", "Floss once a day.", "https://web.example/f")]
    )
    async with mcp_session(bridge, await create_key(bridge, "chat:use")) as session:
        names = [tool.name for tool in (await session.list_tools()).tools]
        assert names == ["duckduckgo_search", "knowledge_base_search"]

        web = await session.call_tool("duckduckgo_search", {"query": "floss", "max_results": 3})
        assert web.content[0].text == (
            "Title: Flossing\nContent: Floss once a day.\nLink: https://web.example/f"
        )
        kb = await session.call_tool("knowledge_base_search", {"query": "chảy máu chân răng"})
        assert kb.content[0].text.startswith("Title: ") and "Link: https://" in kb.content[0].text
        bad = await session.call_tool("knowledge_base_search", {"query": ""})
        assert bad.is_error

        with pytest.raises(MCPError) as caught:  # listed nowhere for this key: unknown
            await session.call_tool(VOLUME, {"volume": 5})
        assert caught.value.code == types.INVALID_PARAMS
        with pytest.raises(MCPError):
            await session.read_resource("memory://conversation/x")  # no such conversation


async def test_a_device_key_cannot_read_memory(bridge):
    await chat_turn(bridge, "How often should I floss?", "private")
    async with mcp_session(bridge, await create_key(bridge, "devices:read")) as session:
        assert (await session.list_resources()).resources == []
        with pytest.raises(MCPError) as caught:
            await session.read_resource("memory://conversation/private")
    assert caught.value.code == -32001 and caught.value.data["required_scope"] == "chat:use"


async def test_tools_list_changed_when_a_device_comes_and_goes(bridge, simulated_devices):
    notices: list[Any] = []
    arrived = anyio.Event()

    def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            notices.append(message)
            arrived.set()

    async with mcp_session(bridge, ADMIN_TOKEN, on_message) as session:
        assert not [t for t in (await session.list_tools()).tools if t.name.startswith("device.")]
        sim = await simulated_devices(bridge)
        with anyio.fail_after(5):
            await arrived.wait()
        names = [tool.name for tool in (await session.list_tools()).tools]
        assert VOLUME in names

        arrived = anyio.Event()
        await sim.stop()
        with anyio.fail_after(5):
            await arrived.wait()
        assert VOLUME not in [tool.name for tool in (await session.list_tools()).tools]
    assert len(notices) >= 2


async def test_mcp_needs_a_valid_key_and_sessions_stay_with_their_key(bridge):
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "probe", "version": "1"},
        },
    }
    accept = {"Accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=accept) as http:
        for auth in ({}, {"Authorization": "Bearer esk_000000000000_forged"}):
            refused = await http.post("/mcp", json=initialize, headers=auth)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert refused.json()["error"]["message"] == "missing or invalid API key"

        owner = {"Authorization": f"Bearer {await create_key(bridge, 'chat:use')}"}
        opened = await http.post("/mcp", json=initialize, headers=owner)
        assert opened.status_code == 200
        session = {"mcp-session-id": opened.headers["mcp-session-id"]}
        listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        other = {"Authorization": f"Bearer {await create_key(bridge, 'chat:use')}"}
        hijack = await http.post("/mcp", json=listing, headers={**other, **session})
        assert hijack.status_code == 404  # as if the session did not exist
        mine = await http.post("/mcp", json=listing, headers={**owner, **session})
        assert mine.status_code == 200 and "knowledge_base_search" in mine.text


def test_safe_device_ids():
    assert safe_device_ids(["a4:cf:12:34:56:78", "plain_id-1"]) == {
        "a4:cf:12:34:56:78": "a4-cf-12-34-56-78",
        "plain_id-1": "plain_id-1",
    }
    clashing = safe_device_ids(["a:b", "a.b", "c"])
    assert clashing["c"] == "c"
    assert clashing["a:b"] != clashing["a.b"]
    assert all(name.startswith("a-b-") and len(name) == 10 for name in [clashing["a:b"]])


async def test_the_bridge_stops_while_a_session_holds_its_stream_open(bridge_factory):
    bridge = await bridge_factory()
    opened = anyio.Event()

    async def hold_a_session() -> None:
        async with mcp_session(bridge, ADMIN_TOKEN) as session:
            await session.list_tools()  # the client has opened its GET stream by now
            opened.set()
            await anyio.sleep_forever()

    async with anyio.create_task_group() as group:
        group.start_soon(hold_a_session)
        await opened.wait()
        with anyio.fail_after(10):  # a hang, not a speed limit: the API drains open streams
            await bridge.stop()
        group.cancel_scope.cancel()


async def test_colliding_device_ids_get_distinct_names(bridge, wire_devices):
    colon, dot = wire_devices("desk:1"), wire_devices("desk.1")
    for device in (colon, dot):
        await device.connect()
        await wait_state(bridge, device.device_id)
    safe = safe_device_ids(["desk:1", "desk.1"])
    async with mcp_session(bridge, ADMIN_TOKEN) as session:
        names = {tool.name for tool in (await session.list_tools()).tools}
        for device in (colon, dot):
            name = f"device.{safe[device.device_id]}.self.audio_speaker.set_volume"
            assert name in names
            result = await session.call_tool(name, {"volume": 7})
            assert not result.is_error
    assert [c[1] for c in colon.stock.calls] == [{"volume": 7}]
    assert [c[1] for c in dot.stock.calls] == [{"volume": 7}]
