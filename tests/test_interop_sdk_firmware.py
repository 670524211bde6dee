"""The official MCP SDK client (mcp 2.3.0 `ClientSession`) against the firmware's MCP server.

The firmware server runs on CPython (firmware/lib on sys.path) with the stock tools over a HalFake
plus synthetic tools spanning several tools/list pages. Between them is a JSON text pipe, the
same text the device exchanges inside `mcp` envelopes: the SDK's outgoing messages are serialised
as its stdio transport does, handed to `McpServer.handle(text)`, and the reply text is parsed
back with the SDK's own JSON-RPC adapter.
"""

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import mcp.types as types
import pytest
from mcp import ClientSession
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from tests.fw.fw_support import MODEL_TOOLS, USER_TOOLS

FIRMWARE_LIB = Path(__file__).resolve().parents[1] / "firmware" / "lib"
if str(FIRMWARE_LIB) not in sys.path:
    sys.path.insert(0, str(FIRMWARE_LIB))

import tools_stock  # noqa: E402  (firmware/lib is put on sys.path just above)
from hal_fake import HalFake  # noqa: E402
from mcp_server import McpServer, integer  # noqa: E402

SYNTHETIC_TOOLS = 40


class Wire:
    """JSON text pipe between the SDK session and the firmware server; records the traffic."""

    def __init__(self, server: McpServer) -> None:
        self.server = server
        self.sent: list[dict] = []
        self.received: list[dict] = []

    def exchange(self, text: str) -> str | None:
        self.sent.append(json.loads(text))
        reply = self.server.handle(text)
        if reply is not None:
            self.received.append(json.loads(reply))
        return reply


@asynccontextmanager
async def sdk_session(wire: Wire) -> AsyncIterator[ClientSession]:
    to_client_send, to_client_receive = anyio.create_memory_object_stream[
        SessionMessage | Exception
    ](16)
    from_client_send, from_client_receive = anyio.create_memory_object_stream[SessionMessage](16)

    async def pump() -> None:
        async for outgoing in from_client_receive:
            text = outgoing.message.model_dump_json(by_alias=True, exclude_unset=True)
            reply = wire.exchange(text)
            if reply is not None:
                message = types.jsonrpc_message_adapter.validate_json(reply, by_name=False)
                await to_client_send.send(SessionMessage(message))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(pump)
        async with ClientSession(to_client_receive, from_client_send, read_timeout_seconds=5) as s:
            yield s
        tasks.cancel_scope.cancel()


@pytest.fixture
def hal() -> HalFake:
    return HalFake()


@pytest.fixture
def wire(hal: HalFake) -> Wire:
    server = McpServer(hal.board_name, hal.firmware_version)
    tools_stock.register(server, hal)
    for index in range(SYNTHETIC_TOOLS):
        server.add_tool(
            f"self.synthetic.tool_{index:02d}",
            f"Synthetic tool {index} to fill tools/list pages. " + "x" * 400,
            [integer("level", 1, 0, 9)],
            lambda args, index=index: index * 10 + args["level"],
        )
    return Wire(server)


async def test_initialize_accepts_our_2024_11_05_answer(wire: Wire, hal: HalFake) -> None:
    async with sdk_session(wire) as session:
        result = await session.initialize()
        assert result.protocol_version == "2024-11-05"
        assert session.protocol_version == "2024-11-05"
        assert result.server_info.name == hal.board_name
        assert result.server_info.version == hal.firmware_version
        assert result.capabilities.tools is not None
    offered = wire.sent[0]
    assert offered["method"] == "initialize"
    assert offered["params"]["protocolVersion"] > "2024-11-05"  # the SDK offers a newer one
    assert wire.sent[1] == {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert len(wire.received) == 1  # the notification got no reply


async def test_every_page_of_list_tools(wire: Wire) -> None:
    user_only = set(USER_TOOLS)
    visible = [name for name in wire.server.tool_names() if name not in user_only]
    async with sdk_session(wire) as session:
        await session.initialize()
        names: list[str] = []
        pages = 0
        cursor = None
        while True:
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await session.list_tools(params=params)
            pages += 1
            names += [tool.name for tool in page.tools]
            cursor = page.next_cursor
            if cursor is None:
                break
            assert cursor == visible[len(names)]
    assert pages >= 3
    assert names == visible
    assert names[: len(MODEL_TOOLS)] == MODEL_TOOLS
    for request in wire.sent:
        if request.get("method") == "tools/list":
            assert len(json.dumps(request)) < 200
    for reply in wire.received[1:]:
        assert len(json.dumps(reply["result"], separators=(",", ":")).encode()) <= 8000


async def test_tool_schema_survives_the_sdk_models(wire: Wire) -> None:
    async with sdk_session(wire) as session:
        await session.initialize()
        page = await session.list_tools()
    volume = next(tool for tool in page.tools if tool.name == "self.audio_speaker.set_volume")
    assert volume.input_schema == {
        "type": "object",
        "properties": {"volume": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["volume"],
    }


async def test_call_tool_success_changes_the_hal(wire: Wire, hal: HalFake) -> None:
    async with sdk_session(wire) as session:
        await session.initialize()
        result = await session.call_tool("self.audio_speaker.set_volume", {"volume": 35})
        status = await session.call_tool("self.get_device_status", None)
    assert result.is_error is False
    assert [(c.type, c.text) for c in result.content] == [("text", "true")]
    assert hal.get_volume() == 35
    assert hal.changes == [("volume", 35)]
    assert json.loads(status.content[0].text)["audio_speaker"] == {"volume": 35}
    assert wire.sent[-1]["params"] == {"name": "self.get_device_status"}


async def test_call_synthetic_tool_with_default(wire: Wire) -> None:
    async with sdk_session(wire) as session:
        await session.initialize()
        with_default = await session.call_tool("self.synthetic.tool_07", {})
        explicit = await session.call_tool("self.synthetic.tool_07", {"level": 4.9})
    assert with_default.content[0].text == "71"
    assert explicit.content[0].text == "74"


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("self.nope", {}, "Unknown tool: self.nope"),
        ("self.audio_speaker.set_volume", {"volume": 101}, "Value exceeds maximum allowed: 100"),
        ("self.audio_speaker.set_volume", {}, "Missing valid argument: volume"),
        ("self.audio_speaker.set_volume", {"volume": "50"}, "Missing valid argument: volume"),
    ],
)
async def test_call_tool_errors_raise_mcp_error(
    wire: Wire, hal: HalFake, name: str, arguments: dict, message: str
) -> None:
    async with sdk_session(wire) as session:
        await session.initialize()
        with pytest.raises(MCPError) as caught:
            await session.call_tool(name, arguments)
        # The session stays usable after an error reply.
        assert (await session.send_ping()) is not None
    assert (caught.value.code, caught.value.message) == (types.INVALID_PARAMS, message)
    assert hal.changes == []


async def test_unknown_cursor_raises_mcp_error(wire: Wire) -> None:
    async with sdk_session(wire) as session:
        await session.initialize()
        with pytest.raises(MCPError) as caught:
            await session.list_tools(params=types.PaginatedRequestParams(cursor="self.gone"))
    assert caught.value.code == types.INVALID_PARAMS
    assert caught.value.message == "Unknown cursor: self.gone"
