"""An external MCP server for the tests, built with the official SDK's `MCPServer` (FastMCP).

Run as a script it serves stdio (`python tests/fakes/mcp_server.py`); `build_server()` is also
mounted over Streamable HTTP on loopback by tests/mcp_servers_helpers.py. Its tools are made to
misbehave on request: `hang` never answers, `crash` kills the process mid-call, `huge` answers
megabytes, `flood` sends a storm of `notifications/tools/list_changed`, `grow` adds a tool.
"""

import os
import sys

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations


def build_server(name: str = "fake") -> MCPServer:
    server = MCPServer(name)

    @server.tool()
    def echo(text: str) -> str:
        """Echo the text back."""
        return f"echo:{text}"

    @server.tool()
    async def hang() -> str:
        """Never answers."""
        await anyio.sleep_forever()
        return "unreachable"

    @server.tool()
    def crash() -> str:
        """Kills the server process mid-call."""
        os._exit(3)

    @server.tool()
    def huge(size: int) -> str:
        """Answers `size` bytes of text."""
        return "x" * size

    @server.tool()
    async def flood(count: int, ctx: Context) -> str:
        """Sends `count` tools/list_changed notifications, then answers."""
        for _ in range(count):
            await ctx.session.send_tool_list_changed()
        return f"flooded {count}"

    @server.tool()
    async def grow(ctx: Context) -> str:
        """Adds the tool `late_tool` and says the list changed."""

        def late_tool() -> str:
            """A tool that appeared later."""
            return "late"

        if "late_tool" not in {tool.name for tool in await server.list_tools()}:
            server.add_tool(late_tool)
        await ctx.session.send_tool_list_changed()
        return "grown"

    @server.tool(annotations=ToolAnnotations(destructiveHint=True))
    def erase(what: str) -> str:
        """Erases something (marked destructive)."""
        return f"erased {what}"

    return server


if __name__ == "__main__":
    build_server(sys.argv[1] if len(sys.argv) > 1 else "fake").run(transport="stdio")
