"""`GET /api/mcp/servers`: the external MCP servers, their state and tools (scope `devices:read`
or `admin`). Never shows a command's arguments, environment, headers or tokens."""

from typing import Annotated, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict

from backend.api.scopes import needs
from backend.keys import Principal, Scope
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


class ServerList(BaseModel):
    """The answer of `GET /api/mcp/servers`."""

    servers: list[ServerView]


def mcp_servers_router(hub: McpServerHub) -> APIRouter:
    """The read-only API of the external MCP servers (`/api/mcp`)."""
    router = APIRouter(prefix="/api/mcp", tags=["mcp servers"])

    @router.get("/servers")
    async def list_servers(_reader: Reader) -> ServerList:
        return ServerList.model_validate({"servers": hub.listing()})

    return router
