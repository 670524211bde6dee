"""Bounds on what an external MCP server sends (issue #32, item 1): tool count, name length and
charset, schema size and depth, bytes of declarations, tools/list pages, re-list rate, result
size, and the memory a server leaves behind.

The hostile server (testkit/hostile_mcp_server.py) dials in over a real WebSocket: to the
endpoint alone on loopback (tests/dialin_helpers.py), and to a whole bridge with a simulated
device whose tool is called through the admin API during the flood.
"""

import asyncio
import gc
import json
import weakref
from collections.abc import AsyncIterator
from typing import Any

import httpx
import mcp_types
import psutil
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from structlog.testing import capture_logs

from backend.mcp_dialin.endpoint import DialInLimits, server_name
from backend.mcp_servers.hub import (
    DEFAULT_TOOL_BOUNDS,
    SessionServer,
    ToolBounds,
    json_depth,
    list_tools_bounded,
)
from backend.mcp_servers.settings import McpServerSettings
from backend.server import Bridge
from testkit import mcp_server_fuzzing
from testkit.hostile_mcp_server import HostileServer
from testkit.settings import ADMIN_TOKEN
from tests.dialin_helpers import EndpointHost, wait_for
from tests.helpers import create_key

TOKEN = "esk_0123456789ab_secret"
NAME = server_name("0123456789ab")
MB = 2**20


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / MB


@pytest.fixture
async def host() -> AsyncIterator[EndpointHost]:
    running = await EndpointHost(DialInLimits(init_timeout_s=30.0)).start()
    running.add_key(TOKEN)
    yield running
    await running.stop()


async def test_a_hostile_dialed_in_server_is_held_to_the_bounds(host: EndpointHost) -> None:
    gc.collect()
    before = _rss_mb()
    with capture_logs() as logs:
        hostile = await HostileServer(host.url(TOKEN)).start()
        await wait_for(lambda: host.hub.get(NAME) is not None)
    server = host.hub.get(NAME)
    assert isinstance(server, SessionServer)
    # 500 fat tools in 50 pages: the byte budget stops the listing on its second page; the odd
    # names and the deep schema of the first page are dropped; one warning says so.
    assert [tool.name for tool in server.tools] == ["echo", "big"]
    assert hostile.report.tools_list <= 2
    [warning] = [line for line in logs if line["event"] == "mcp server tool list bounded"]
    assert warning["log_level"] == "warning"
    assert warning["stopped"] == "max_tool_bytes"
    assert warning["dropped"] == {
        "name_length": 1,
        "name_charset": 4,
        "schema_depth": 1,
        "schema_bytes": 10,
    }

    result = await server.call("big", {})  # 1 MB of text, cut to 64 KiB
    [block] = result.content
    assert block["text"].endswith("\n[result cut at 65536 bytes]")
    assert len(block["text"].encode()) < 65536 + 100

    # list_changed every 20 ms for 4.5 s: one re-list in flight, at most one per 2 s.
    with capture_logs() as flood_logs:
        await hostile.flood(4.5)
    assert hostile.report.notifications > 100
    assert 1 <= server.relists <= 3
    gap = hostile.report.min_relist_gap_s()
    assert gap is None or gap >= 1.5
    assert not [line for line in flood_logs if line["event"] == "mcp server tool list bounded"]
    assert _rss_mb() - before < 50  # loosely: the page bytes are never all held

    # The server leaves: nothing of it stays referenced.
    gone = weakref.ref(server)
    del server, result, block
    await hostile.close()
    await wait_for(lambda: host.hub.get(NAME) is None)
    await wait_for(lambda: host.endpoint.open_count == 0)
    gc.collect()
    assert gone() is None
    assert _rss_mb() - before < 50


async def test_another_devices_calls_work_during_the_flood(
    bridge_factory, simulated_devices
) -> None:
    bridge: Bridge = await bridge_factory()
    lender = await simulated_devices(bridge, index=1)
    other = await simulated_devices(bridge, index=2)
    token = await create_key(bridge, "mcp:endpoint", devices=[lender.device_id])
    name = server_name(token.split("_")[1])
    url = f"ws://127.0.0.1:{bridge.http_port}/v1/mcp-endpoint/?token={token}"
    gc.collect()
    before = _rss_mb()
    hostile = await HostileServer(url).start()
    await wait_for(lambda: bridge.mcp_servers.get(name) is not None)
    server = bridge.mcp_servers.get(name)
    assert server is not None and len(server.tools) <= DEFAULT_TOOL_BOUNDS.max_tools
    # What the bound device's next turn offers the model: the two tools that passed, small.
    box = bridge.mcp_servers.toolbox_for(None, lender.device_id)
    assert box is not None
    offered = [spec for spec in box.functions() if spec.llm_name.startswith(f"{name}__")]
    assert sorted(spec.llm_name for spec in offered) == [f"{name}__big", f"{name}__echo"]
    assert sum(len(json.dumps(spec.parameters)) for spec in offered) < 1024
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30) as http:
        flood = asyncio.create_task(hostile.flood(3.0))
        calls = 0
        while not flood.done():
            response = await http.post(
                f"/api/devices/{other.device_id}/tools/call",
                json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": calls}},
            )
            assert response.status_code == 200, response.text
            calls += 1
            await asyncio.sleep(0.05)
        await flood
        assert calls > 10
        assert (await http.get("/healthz")).status_code == 200
    assert server.relists <= 3
    await hostile.close()
    await wait_for(lambda: bridge.mcp_servers.get(name) is None)
    del server
    gc.collect()
    assert _rss_mb() - before < 50


# ---- the listing on its own ----------------------------------------------------------------------


class _Pages:
    """A session serving fixed tools/list pages (cursor "1", "2"...); counts requests."""

    def __init__(self, pages: list[dict[str, Any]]) -> None:
        self.pages = pages
        self.requests = 0
        self._tool_output_schemas: dict[str, Any] = {}  # as the SDK's ClientSession caches

    async def list_tools(self, *, params: Any = None) -> mcp_types.ListToolsResult:
        self.requests += 1
        index = int(params.cursor) if params is not None and params.cursor else 0
        result = mcp_types.ListToolsResult.model_validate(self.pages[index])
        for tool in result.tools:
            self._tool_output_schemas[tool.name] = tool.output_schema
        return result


FOUR_DEEP = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}}


def _tool(name: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "inputSchema": schema or {"type": "object"}}


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


async def test_names_schemas_and_counts_are_bounded() -> None:
    bounds = ToolBounds(max_tools=3, max_name_chars=8, max_schema_bytes=200, max_schema_depth=4)
    page = {
        "tools": [
            _tool("ok.one-1"),
            _tool("x" * 9),  # too long
            _tool("sp ace"),
            _tool("ü"),
            _tool("deep", _nested(3)),  # depth 5: every object and its properties count
            _tool("fat", {"type": "object", "description": "y" * 300}),
            _tool("ok.one-1"),  # duplicate
            _tool("two"),
            _tool("three", FOUR_DEEP),  # depth 4 is fine
            _tool("four"),  # over max_tools
        ]
    }
    session = _Pages([page])
    listing = await list_tools_bounded(session, bounds)
    assert [tool.name for tool in listing.tools] == ["ok.one-1", "two", "three"]
    assert listing.dropped == {
        "name_length": 1,
        "name_charset": 2,
        "schema_depth": 1,
        "schema_bytes": 1,
        "duplicate": 1,
    }
    assert listing.stopped == "max_tools"
    assert set(session._tool_output_schemas) == {"ok.one-1", "two", "three"}


async def test_pages_and_bytes_stop_the_listing() -> None:
    endless = [{"tools": [_tool(f"t{i}")], "nextCursor": str(i + 1)} for i in range(40)]
    session = _Pages(endless)
    listing = await list_tools_bounded(session, ToolBounds(max_pages=16))
    assert session.requests == 16 and listing.stopped == "max_pages"
    assert len(listing.tools) == 16

    wordy = [
        {**page, "tools": [{**_tool(f"t{i}"), "description": "d" * 200}]}
        for i, page in enumerate(endless)
    ]
    session = _Pages(wordy)
    listing = await list_tools_bounded(session, ToolBounds(max_tool_bytes=1024))
    assert listing.stopped == "max_tool_bytes"
    assert session.requests == len(listing.tools) + 1 < 40

    looping = [{"tools": [_tool("a")], "nextCursor": "1"}, {"tools": [], "nextCursor": "1"}]
    listing = await list_tools_bounded(_Pages(looping))
    assert listing.stopped == "bad_cursor" and [t.name for t in listing.tools] == ["a"]


def test_json_depth() -> None:
    assert json_depth(1, 8) == 0
    assert json_depth({}, 8) == 1
    assert json_depth({"a": [{"b": 1}]}, 8) == 3
    assert json_depth(FOUR_DEEP, 8) == 4
    assert json_depth(_nested(100), 8) == 9  # stops counting past the limit


def test_configured_servers_set_their_bounds() -> None:
    entry = McpServerSettings(name="s", command="x")
    assert entry.tool_bounds() == DEFAULT_TOOL_BOUNDS
    assert ToolBounds(256, 64, 8192, 8, 1 << 20, 16) == DEFAULT_TOOL_BOUNDS
    tight = McpServerSettings(
        name="s",
        url="http://127.0.0.1:1/mcp",
        max_tools=10,
        max_tool_name_chars=20,
        max_schema_bytes=1024,
        max_schema_depth=3,
        max_tool_bytes=4096,
        max_tool_list_pages=2,
        max_message_bytes=65536,
    )
    assert tight.tool_bounds() == ToolBounds(10, 20, 1024, 3, 4096, 2)
    with pytest.raises(ValueError):
        McpServerSettings(name="s", command="x", max_tools=0)


@settings(
    max_examples=500,  # 100,000 once by hand (docs/mcp-servers.md); a sample in the suite
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)
@given(mcp_server_fuzzing.server_inputs)
def test_fuzzed_server_input_never_escapes(value: tuple[str, Any]) -> None:
    mcp_server_fuzzing.check_server_input(*value)
