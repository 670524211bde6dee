"""Scoped API keys for the bridge's HTTP front ends (chat, devices, admin).

Designed for `esp32-bridge keys create|list|revoke` and a Bearer-token check in the API; the
core wires both. See `store.py` and docs/chat.md.
"""

from backend.keys.store import (
    KEYS_MIGRATIONS,
    ApiKey,
    CreatedKey,
    InvalidKey,
    KeyStore,
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
    "Principal",
    "Scope",
    "UnknownKey",
]
