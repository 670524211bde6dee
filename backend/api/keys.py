"""`/api/keys`: create, list and revoke API keys (scope `admin`). The token is in the answer to
`POST` only; the bridge keeps its SHA-256 (backend/keys/store.py). `GET /api/scopes` (any
key: the names are documented, nothing secret) lists the scopes a key may be given, for the
console's scope picker."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field, field_validator

from backend.api.app import ApiError
from backend.api.errors import errors
from backend.api.scopes import needs, principal_of
from backend.keys import ApiKey, KeyStore, Principal, Scope
from backend.keys.store import parse_scopes

Admin = Annotated[Principal, Depends(needs(Scope.ADMIN))]


class KeyCreate(BaseModel):
    """The body of `POST /api/keys`: name, scopes, optional device ids."""

    name: str = Field(min_length=1, max_length=100)  # KeyStore.create checks it too
    scopes: list[str] = Field(
        min_length=1,
        max_length=64,
        description="chat:use, devices:read, devices:call, admin, or mcp:<server>",
    )

    @field_validator("scopes")
    @classmethod
    def _known_scopes(cls, value: list[str]) -> list[str]:
        parse_scopes(value)  # ValueError names the unknown one (422 on `scopes`)
        return value

    device_ids: list[str] | None = Field(
        default=None, description="limit devices:read/devices:call to these devices"
    )


class KeyView(BaseModel):
    """An API key as listed (never its token)."""

    id: str
    name: str
    scopes: list[str]
    device_ids: list[str] | None
    created_at: str
    last_used_at: str | None
    revoked_at: str | None
    active: bool


class CreatedKeyView(KeyView):
    """A key just created, with its token (shown this once)."""

    token: str = Field(description="shown once: the bridge keeps only its hash")


class KeyList(BaseModel):
    """The answer of `GET /api/keys`."""

    keys: list[KeyView]


# What each scope lets a key do, for the console's scope picker (docs/chat.md, "API keys and
# scopes"); a scope missing here is still listed, with no description.
SCOPE_DESCRIPTIONS: dict[Scope, str] = {
    Scope.CHAT_USE: "chat with the assistant (/v1, the chat page)",
    Scope.DEVICES_READ: "list devices, their tools and their audit rows",
    Scope.DEVICES_CALL: "call device tools (reading devices included)",
    Scope.ADMIN: "everything: keys, activations, firmware, the whole audit log",
    Scope.MCP_ENDPOINT: "a user's MCP server may dial in with this key",
    Scope.MCP_DIALIN: "use the tools of every dialed-in MCP server",
    Scope.CONSOLE_TALK: "the talk page: the browser becomes a voice device",
    Scope.METRICS_READ: "read GET /metrics (a Prometheus scraper)",
}


class ScopeInfo(BaseModel):
    """A scope a key may be given."""

    name: str
    description: str


class ScopeList(BaseModel):
    """The answer of `GET /api/scopes`."""

    scopes: list[ScopeInfo]
    mcp_server_pattern: str = Field(description="`mcp:<server>` scopes are accepted too")


def key_view(key: ApiKey) -> dict[str, Any]:
    """The key as the API shows it, times as ISO-8601."""
    return {
        "id": key.id,
        "name": key.name,
        "scopes": sorted(key.scopes),
        "device_ids": sorted(key.device_ids) if key.device_ids is not None else None,
        "created_at": key.created_at.isoformat(),
        "last_used_at": key.last_used_at.isoformat() if key.last_used_at else None,
        "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
        "active": key.active,
    }


def keys_router(keys: KeyStore) -> APIRouter:
    """The admin routes of API keys (`/api/keys`): create, list, revoke; and `/api/scopes`."""
    router = APIRouter(tags=["keys"])

    @router.post("/api/keys", status_code=201, responses=errors(503))
    async def create_key(body: KeyCreate, _admin: Admin) -> CreatedKeyView:
        try:
            created = await keys.create(body.name, body.scopes, device_ids=body.device_ids)
        except ValueError as exc:
            raise ApiError(422, "invalid_request", str(exc)) from None
        return CreatedKeyView(**key_view(created.key), token=created.token)

    # Not under /api/keys/: that path is DELETE /api/keys/{key_id}'s.
    @router.get("/api/scopes")
    async def scopes(request: Request) -> ScopeList:
        principal_of(request)  # any valid key
        return ScopeList(
            scopes=[
                ScopeInfo(name=str(scope), description=SCOPE_DESCRIPTIONS.get(scope, ""))
                for scope in Scope
            ],
            mcp_server_pattern="mcp:[a-z0-9_-]{1,32}",
        )

    @router.get("/api/keys")
    async def list_keys(
        _admin: Admin,
        revoked: Annotated[bool, Query(description="include revoked keys")] = True,
    ) -> KeyList:
        listed = await keys.list(include_revoked=revoked)
        return KeyList(keys=[KeyView(**key_view(key)) for key in listed])

    @router.delete("/api/keys/{key_id}", responses=errors(404, 503))
    async def revoke_key(key_id: str, _admin: Admin) -> KeyView:
        return KeyView(**key_view(await keys.revoke(key_id)))

    return router
