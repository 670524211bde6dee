"""`GET /api/mcp/servers`: the external MCP servers, their state and tools (scope `devices:read`
or `admin`). Never shows a command's arguments, environment, headers or tokens."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from backend.api.scopes import needs
from backend.keys import Principal, Scope
from backend.mcp_servers.hub import McpServerHub

Reader = Annotated[Principal, Depends(needs(Scope.DEVICES_READ))]


def mcp_servers_router(hub: McpServerHub) -> APIRouter:
    router = APIRouter(prefix="/api/mcp", tags=["mcp servers"])

    @router.get("/servers")
    async def list_servers(_reader: Reader) -> dict[str, Any]:
        return {"servers": hub.listing()}

    return router
