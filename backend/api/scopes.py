"""Scope checks for the API's routes: the gate put the caller's `Principal` in the ASGI scope.

Every route names what it needs (docs/chat.md, "API keys and scopes"):

- `GET /api/devices[/{id}[/tools]]`: `devices:read` (a device-limited key sees its devices only);
- `POST /api/devices/{id}/tools/call`: `devices:call` covering that device;
- `DELETE /api/devices/{id}` and `/api/keys`: `admin`;
- `/v1/...` and `POST /api/chat/stream`: `chat:use`;
- `/mcp`: any valid key; each resource and tool checks its own scope.

A missing scope is `MissingScope` (403 `forbidden`, backend/api/errors.py).
"""

from collections.abc import Callable
from typing import Any

from starlette.requests import HTTPConnection

from backend.api.gate import PRINCIPAL
from backend.keys import InvalidKey, Principal, Scope


def principal_of(connection: HTTPConnection) -> Principal:
    """The caller, as the gate resolved it (InvalidKey, i.e. 401, when there is none)."""
    state: dict[str, Any] = connection.scope.get("state") or {}
    principal = state.get(PRINCIPAL)
    if not isinstance(principal, Principal):
        raise InvalidKey()
    return principal


def needs(scope: Scope) -> Callable[[HTTPConnection], Principal]:
    """A FastAPI dependency: the caller, who must have `scope` (else 403)."""

    def dependency(connection: HTTPConnection) -> Principal:
        principal = principal_of(connection)
        principal.require(scope)
        return principal

    return dependency


def actor_of(principal: Principal) -> str:
    """How the audit log names a caller: `admin` (the admin token) or `key:<id>`."""
    return "admin" if principal.key_id == "admin" else f"key:{principal.key_id}"
