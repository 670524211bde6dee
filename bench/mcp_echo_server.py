"""A stdio MCP server with one tool, `echo`, written with the official SDK (for
bench/mcp_servers.py)."""

from mcp.server.mcpserver import MCPServer

server = MCPServer("echo")


@server.tool()
def echo(text: str) -> str:
    """Echo the text back."""
    return text


if __name__ == "__main__":
    server.run(transport="stdio")
