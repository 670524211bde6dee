"""The real firmware MCP server and stock tools running inside this process, as a `ToolSource`.

No socket and no session: a call goes straight to `McpServer.handle_message`. The chat tests and
the chat benchmark use it where the device's link is not what is being measured.
"""

from typing import Any

from backend.mcp_session import CallResult, Tool
from simulator.firmware import firmware_module


class FirmwareDevice:
    """A `ToolSource` running the real firmware MCP server and stock tools in this process."""

    def __init__(self, device_id: str = "02:00:00:00:00:01") -> None:
        self.device_id = device_id
        self.hal = firmware_module("hal_fake").HalFake(board_name="bench", firmware_version="1")
        self.server = firmware_module("mcp_server").McpServer("bench", "1")
        firmware_module("tools_stock").register(self.server, self.hal)
        listed = self.server.handle_message(
            {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"withUserTools": True}}
        )
        self.tools = [Tool.model_validate(raw) for raw in listed["result"]["tools"]]
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def tool_list(self, *, include_user_only: bool = True) -> list[Tool]:
        return [
            tool
            for tool in self.tools
            if include_user_only or "user" not in (tool.annotations or {}).get("audience", [])
        ]

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        confirmed: bool = False,
        actor: str | None = None,
    ) -> CallResult:
        self.calls.append((name, dict(arguments or {})))
        reply = self.server.handle_message(
            {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "tools/call",
                "params": {"name": name, "arguments": arguments or {}},
            }
        )
        return CallResult.from_wire(reply["result"])
