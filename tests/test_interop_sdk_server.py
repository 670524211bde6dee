"""Our McpClient drives the official MCP SDK's low-level Server through xiaozhi envelopes.

Each payload we send is wrapped as `{"session_id","type":"mcp","payload"}` JSON text, unwrapped
and parsed the way the SDK's own transports parse frames; the server's output takes the reverse
path. The SDK (mcp 2.3.0) serves `/mcp`; the device side (McpClient) never uses it.
"""

import base64
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from mcp import types
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from backend.mcp_session import DeviceError, McpClient, RequestTimeout

PAGE_SIZE = 2
SCHEMA = {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0}}}
SDK_TOOLS = [
    types.Tool(name=f"self.tool_{index}", description=f"Tool nº{index}", input_schema=SCHEMA)
    for index in range(5)
] + [types.Tool(name="self.slow", input_schema={"type": "object"})]


def envelope(payload_json: str) -> str:
    return '{"session_id":"x","type":"mcp","payload":' + payload_json + "}"


def unwrap(text: str) -> Any:
    message = json.loads(text)
    assert (message["session_id"], message["type"]) == ("x", "mcp")
    return message["payload"]


class SdkDevice:
    """An SDK Server with paginated tools; records what its handlers saw."""

    def __init__(self) -> None:
        self.cursors_seen: list[str | None] = []
        self.cancelled = anyio.Event()
        self.ping_answer: Any = None
        self.roots_error: tuple[int, str] | None = None
        self.server = Server(
            "sdk-device",
            version="9.9.9",
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
        )

    async def list_tools(
        self, _ctx: Any, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        cursor = params.cursor if params is not None else None
        self.cursors_seen.append(cursor)
        start = int(base64.b64decode(cursor)) if cursor else 0
        end = start + PAGE_SIZE
        next_cursor = base64.b64encode(str(end).encode()).decode() if end < len(SDK_TOOLS) else None
        return types.ListToolsResult(tools=SDK_TOOLS[start:end], next_cursor=next_cursor)

    async def call_tool(
        self, ctx: Any, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        arguments = params.arguments or {}
        if params.name == "self.slow":
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                self.cancelled.set()
                raise
        if params.name == "self.notify_change":
            await ctx.session.send_tool_list_changed()
            self.ping_answer = await ctx.session.send_ping()
            try:
                await ctx.session.send_request(types.ListRootsRequest(), types.ListRootsResult)
            except MCPError as exc:
                self.roots_error = (exc.error.code, exc.error.message)
            return types.CallToolResult(content=[types.TextContent(type="text", text="sent")])
        if params.name not in {tool.name for tool in SDK_TOOLS}:
            raise MCPError(code=types.INVALID_PARAMS, message=f"Unknown tool: {params.name}")
        level = arguments.get("level")
        if not isinstance(level, int) or level < 0:
            text = f"level must be a non-negative integer, got {level!r}"
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=text)], is_error=True
            )
        text = f"{params.name} → {level} ✓"
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)])


@asynccontextmanager
async def connected(device: SdkDevice, **client_kwargs: Any) -> AsyncIterator[McpClient]:
    """A client whose link is the envelope transport to `device`'s server."""
    to_server, server_reads = anyio.create_memory_object_stream[SessionMessage | Exception](32)
    server_writes, from_server = anyio.create_memory_object_stream[SessionMessage](32)

    async def send(payload: dict[str, Any]) -> None:
        inner = json.dumps(unwrap(envelope(json.dumps(payload))))
        message = types.jsonrpc_message_adapter.validate_json(inner, by_name=False)
        await to_server.send(SessionMessage(message))

    client = McpClient(send, **client_kwargs)

    async def pump_replies() -> None:
        async for session_message in from_server:
            wire = session_message.message.model_dump_json(by_alias=True, exclude_unset=True)
            client.feed(unwrap(envelope(wire)))

    options = device.server.create_initialization_options()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(device.server.run, server_reads, server_writes, options)
        tasks.start_soon(pump_replies)
        try:
            yield client
        finally:
            client.close("test over")
            await to_server.aclose()
            tasks.cancel_scope.cancel()


async def test_initialize_is_answered_with_our_protocol_version() -> None:
    device = SdkDevice()
    async with connected(device) as client:
        server = await client.initialize()
    # The SDK still negotiates 2024-11-05 (its oldest handshake version) and echoes it.
    assert server.protocol_version == "2024-11-05"
    assert server.server_info["name"] == "sdk-device"
    assert server.server_info["version"] == "9.9.9"
    assert "tools" in server.capabilities


async def test_paginated_list_passes_opaque_cursors_back_verbatim() -> None:
    device = SdkDevice()
    async with connected(device) as client:
        await client.initialize()
        tools = await client.list_tools()
    assert [tool.name for tool in tools] == [tool.name for tool in SDK_TOOLS]
    assert device.cursors_seen == ["", "Mg==", "NA=="]
    assert tools[0].input_schema == SCHEMA
    assert tools[0].description == "Tool nº0"
    assert tools[-1].input_schema == {"type": "object"}


async def test_call_returning_text() -> None:
    async with connected(SdkDevice()) as client:
        await client.initialize()
        result = await client.call_tool("self.tool_3", {"level": 7})
    assert result.is_error is False
    assert result.content == [{"type": "text", "text": "self.tool_3 → 7 ✓"}]


async def test_call_returning_is_error_is_a_result_not_an_exception() -> None:
    async with connected(SdkDevice()) as client:
        await client.initialize()
        result = await client.call_tool("self.tool_1", {"level": -1})
    assert result.is_error is True
    assert result.text == "level must be a non-negative integer, got -1"


async def test_json_rpc_error_from_the_sdk_keeps_its_code() -> None:
    async with connected(SdkDevice()) as client:
        await client.initialize()
        with pytest.raises(DeviceError) as caught:
            await client.call_tool("self.nope")
    assert caught.value.code == types.INVALID_PARAMS
    assert caught.value.message == "Unknown tool: self.nope"


async def test_our_cancel_notice_interrupts_the_sdk_handler() -> None:
    device = SdkDevice()
    async with connected(device) as client:
        await client.initialize()
        with pytest.raises(RequestTimeout):
            await client.call_tool("self.slow", timeout_s=0.05)
        await device.cancelled.wait()
        # The connection is still usable afterwards.
        assert (await client.call_tool("self.tool_0", {"level": 1})).is_error is False


async def test_server_notifications_and_requests_reach_the_client() -> None:
    device = SdkDevice()
    changes: list[str] = []
    async with connected(device, on_tools_changed=lambda: changes.append("tools")) as client:
        await client.initialize()
        result = await client.call_tool("self.notify_change")
    assert result.text == "sent"
    assert changes == ["tools"]
    # Our answers to the server's requests are valid JSON-RPC for the SDK.
    assert isinstance(device.ping_answer, types.EmptyResult)
    assert device.roots_error == (types.METHOD_NOT_FOUND, "Method not found: roots/list")
