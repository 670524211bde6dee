"""Scoped API keys for the bridge's HTTP front ends (chat, devices, admin).

`esp32-bridge keys create|list|revoke` manage them through the admin API; the API's gate
resolves every bearer token to a `Principal` (backend/api/gate.py). See `store.py` and
docs/chat.md.
"""

from backend.keys.store import (
    KEYS_MIGRATIONS,
    ApiKey,
    CreatedKey,
    InvalidKey,
    KeyStore,
    McpScope,
    MissingScope,
    Principal,
    Scope,
    UnknownKey,
)

__all__ = [
    "KEYS_MIGRATIONS",
    "ApiKey",
    "CreatedKey",
    "InvalidKey",
    "KeyStore",
    "McpScope",
    "MissingScope",
    "Principal",
    "Scope",
    "UnknownKey",
]
