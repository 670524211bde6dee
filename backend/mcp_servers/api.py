"""`GET /api/mcp/servers`: the external MCP servers, their state and tools (scope `devices:read`
or `admin`). Never shows a command's arguments, environment, headers or tokens; a server's URL
(`target`) and every URL quoted in `last_error` are shown without their secrets, to every
reader (`backend.logs.redact_url`: userinfo, query values, secret-looking path segments;
docs/mcp-servers.md, "Secrets in URLs")."""

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, ValidationError

from backend.api.scopes import needs
from backend.keys import Principal, Scope
from backend.logs import redact_url, redact_urls
from backend.mcp_servers.hub import McpServerHub

Reader = Annotated[Principal, Depends(needs(Scope.DEVICES_READ))]


class ServerToolView(BaseModel):
    """One tool of an external MCP server, as the API lists it."""

    name: str
    description: str
    risky: bool


class ServerView(BaseModel):
    """One external MCP server as the API lists it: kind, state, tools."""

    # Configured servers add connects, relists, next_attempt_in_s and target (command or url).
    model_config = ConfigDict(extra="allow")

    name: str
    kind: Literal["stdio", "http", "dialin"]
    state: Literal["connecting", "ready", "backing-off", "failed", "stopped"]
    since: str
    last_error: str | None
    bound_device_ids: list[str] | None
    calls: int
    pending: int
    tools: list[ServerToolView]
    # In a cluster: the instance the server runs on, or was dialed in to (docs/cluster.md).
    instance: str | None = None


def shown(summary: dict[str, Any]) -> dict[str, Any]:
    """A server's summary as the API shows it: its URL and error without secrets (a second pass
    over what the connectors already redact, so a server kind added later cannot leak one)."""
    data = dict(summary)
    target = data.get("target")
    if isinstance(target, str) and data.get("kind") != "stdio":
        data["target"] = redact_url(target)
    if isinstance(data.get("last_error"), str):
        data["last_error"] = redact_urls(data["last_error"])
    return data


class ServerList(BaseModel):
    """The answer of `GET /api/mcp/servers`."""

    servers: list[ServerView]


def mcp_servers_router(
    hub: McpServerHub,
    *,
    remote: Callable[[], list[dict[str, Any]]] | None = None,
    instance: str | None = None,
) -> APIRouter:
    """The read-only API of the external MCP servers (`/api/mcp`). In a cluster, `remote` gives
    the servers dialed in to the other instances, and `instance` names this one."""
    router = APIRouter(prefix="/api/mcp", tags=["mcp servers"])

    @router.get("/servers")
    async def list_servers(_reader: Reader) -> ServerList:
        servers = [
            ServerView.model_validate({**shown(s), "instance": instance}) for s in hub.listing()
        ]
        for summary in remote() if remote is not None else []:
            try:  # a peer's report: one malformed entry is skipped, not a 500
                servers.append(ServerView.model_validate(shown(summary)))
            except ValidationError:
                continue
        return ServerList(servers=servers)

    return router
