"""`esp32-bridge mcp servers`: the external MCP servers the chat uses (`GET /api/mcp/servers`,
scope devices:read or admin): name, kind, state, last error, tools."""

from typing import Any

import typer

from backend.cli.options import (
    ConfigOpt,
    DataDirOpt,
    JsonOpt,
    ServerOpt,
    TokenOpt,
    WideOpt,
    admin_client,
)
from backend.cli.output import Listing, listing, print_json, say, show, when

mcp_app = typer.Typer(
    help="External MCP servers the chat may use beside device tools (docs/mcp-servers.md).",
    no_args_is_help=True,
)


@mcp_app.command("servers")
def servers(
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """List the external MCP servers: name, kind, state, last error and tools."""
    with admin_client(server, token, data_dir, config) as admin:
        listed = admin.get("/api/mcp/servers")["servers"]
    if as_json:
        print_json(listed)
        return
    if not listed:
        say("no MCP servers configured (see [[mcp_servers]] in docs/mcp-servers.md)")
        return
    show(servers_table(listed, wide=wide))


def servers_table(listed: list[dict[str, Any]], *, wide: bool = False) -> Listing:
    """The `mcp servers` table; a risky tool (it needs a "yes" in the chat) is marked."""
    table = listing(
        "name", "kind", "state", "since", "last_error", "tools",
        ids=("name",), prose=("last_error", "tools"), wide=wide,
    )  # fmt: skip
    for item in listed:
        tools = ", ".join(
            tool["name"] + (" (risky)" if tool.get("risky") else "") for tool in item["tools"]
        )
        table.add_row(
            item["name"],
            item["kind"],
            item["state"],
            when(item.get("since")),
            item.get("last_error") or "",
            tools or "-",
        )
    return table
