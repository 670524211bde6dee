"""API keys: random tokens stored as SHA-256 hashes, each with scopes.

A token looks like `esk_<key id>_<secret>`: the key id (public, 12 hex digits) finds the row,
then the SHA-256 of the whole token is compared with the stored hash in constant time
(`hmac.compare_digest`). The token is shown once, at creation; only its hash is kept, so a
leaked database does not leak usable keys (the secret has 256 bits, so a plain hash is enough;
no slow KDF is needed for random tokens).

Scopes: `chat:use` (talk to the assistant), `devices:read` (list devices and tools),
`devices:call` (call tools, optionally only on some device ids), `admin` (everything,
including key management).
"""

import hashlib
import hmac
import json
import secrets
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from backend.errors import BridgeError
from backend.storage import Database, Migration

KEYS_MIGRATIONS = [
    Migration(
        "keys",
        1,
        """
        CREATE TABLE api_keys (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            token_hash TEXT NOT NULL,
            scopes TEXT NOT NULL,
            device_ids TEXT,
            created_at TEXT NOT NULL,
            last_used_at TEXT,
            revoked_at TEXT
        );
        """,
    )
]

TOKEN_PREFIX = "esk_"
_ID_HEX = 12


class Scope(StrEnum):
    CHAT_USE = "chat:use"
    DEVICES_READ = "devices:read"
    DEVICES_CALL = "devices:call"
    ADMIN = "admin"


class InvalidKey(BridgeError):
    """The presented token is malformed, unknown or revoked (one message for all: no oracle)."""

    def __init__(self) -> None:
        super().__init__("invalid or revoked API key")


class UnknownKey(BridgeError):
    def __init__(self, key_id: str) -> None:
        super().__init__(f"no API key {key_id[:40]!r}")
        self.key_id = key_id


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a key's id, name, scopes and (for devices:call) allowed devices."""

    key_id: str
    name: str
    scopes: frozenset[Scope]
    device_ids: frozenset[str] | None = None  # None: every device

    @property
    def is_admin(self) -> bool:
        return Scope.ADMIN in self.scopes

    def has(self, scope: Scope | str) -> bool:
        return self.is_admin or Scope(scope) in self.scopes

    def may_call(self, device_id: str) -> bool:
        """May call tools of that device (admin, or devices:call covering it)."""
        if self.is_admin:
            return True
        if Scope.DEVICES_CALL not in self.scopes:
            return False
        return self.device_ids is None or device_id in self.device_ids

    def may_read(self, device_id: str) -> bool:
        if self.is_admin:
            return True
        if Scope.DEVICES_READ not in self.scopes and Scope.DEVICES_CALL not in self.scopes:
            return False
        return self.device_ids is None or device_id in self.device_ids

    def call_denied_reason(self, device_id: str) -> str | None:
        """None when `may_call`, else why not (for `DeviceToolBox(unavailable_reason=...)`)."""
        if self.may_call(device_id):
            return None
        if Scope.DEVICES_CALL not in self.scopes:
            return f"missing scope {Scope.DEVICES_CALL}"
        return f"scope {Scope.DEVICES_CALL} does not cover device {device_id}"


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A key as `keys list` shows it (never the token or its hash)."""

    id: str
    name: str
    scopes: frozenset[Scope]
    device_ids: frozenset[str] | None
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


@dataclass(frozen=True, slots=True)
class CreatedKey:
    key: ApiKey
    token: str  # shown once; not stored

    def __repr__(self) -> str:  # keep the token out of logs and tracebacks
        return f"CreatedKey(key={self.key!r}, token='***')"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def parse_scopes(values: Iterable[str]) -> frozenset[Scope]:
    scopes = set()
    for value in values:
        try:
            scopes.add(Scope(value.strip()))
        except ValueError:
            known = ", ".join(scope.value for scope in Scope)
            raise ValueError(f"unknown scope {value!r} (known: {known})") from None
    if not scopes:
        raise ValueError("a key needs at least one scope")
    return frozenset(scopes)


class KeyStore:
    """Keys in the bridge database; open it with KEYS_MIGRATIONS."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(
        self,
        name: str,
        scopes: Iterable[Scope | str],
        *,
        device_ids: Iterable[str] | None = None,
    ) -> CreatedKey:
        name = " ".join(name.split())
        if not name or len(name) > 100:
            raise ValueError("a key name is 1 to 100 characters")
        scope_set = parse_scopes(str(scope) for scope in scopes)
        devices = frozenset(device_ids) if device_ids is not None else None
        key_id = secrets.token_hex(_ID_HEX // 2)
        token = f"{TOKEN_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        created = _now()
        await self.db.execute(
            "INSERT INTO api_keys (id, name, token_hash, scopes, device_ids, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (
                key_id,
                name,
                hash_token(token),
                json.dumps(sorted(scope_set)),
                json.dumps(sorted(devices)) if devices is not None else None,
                created.isoformat(),
            ),
        )
        key = ApiKey(key_id, name, scope_set, devices, created, None, None)
        return CreatedKey(key, token)

    async def list(self, *, include_revoked: bool = True) -> list[ApiKey]:
        where = "" if include_revoked else "WHERE revoked_at IS NULL"
        rows = await self.db.fetchall(
            f"SELECT id, name, scopes, device_ids, created_at, last_used_at, revoked_at"
            f" FROM api_keys {where} ORDER BY created_at, id"
        )
        return [_key(row) for row in rows]

    async def revoke(self, key_id: str) -> ApiKey:
        def work(c: sqlite3.Connection) -> ApiKey:
            c.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                (_now().isoformat(), key_id),
            )
            row = c.execute(
                "SELECT id, name, scopes, device_ids, created_at, last_used_at, revoked_at"
                " FROM api_keys WHERE id = ?",
                (key_id,),
            ).fetchone()
            if row is None:
                raise UnknownKey(key_id)
            return _key(row)

        return await self.db.run(work)

    async def authenticate(self, token: str) -> Principal:
        """The principal of a valid, unrevoked token; InvalidKey otherwise."""
        token = token.strip()
        if token.lower().startswith("bearer "):
            token = token[7:].strip()
        key_id = _key_id(token)
        presented = hash_token(token)

        def work(c: sqlite3.Connection) -> Principal:
            row = c.execute(
                "SELECT id, name, token_hash, scopes, device_ids, revoked_at"
                " FROM api_keys WHERE id = ?",
                (key_id or "",),
            ).fetchone()
            # Compare even when there is no row, so timing does not tell ids apart.
            stored = row["token_hash"] if row is not None else hash_token("no such key")
            if not hmac.compare_digest(presented, stored) or row is None:
                raise InvalidKey()
            if row["revoked_at"] is not None:
                raise InvalidKey()
            c.execute(
                "UPDATE api_keys SET last_used_at = ? WHERE id = ?", (_now().isoformat(), row["id"])
            )
            return Principal(
                row["id"],
                row["name"],
                _scopes(row["scopes"]),
                _devices(row["device_ids"]),
            )

        return await self.db.run(work)


def admin_principal(name: str = "admin token") -> Principal:
    """The principal of the bridge's admin token (backend.auth), which has every scope."""
    return Principal("admin", name, frozenset({Scope.ADMIN}))


def _key_id(token: str) -> str | None:
    if not token.startswith(TOKEN_PREFIX):
        return None
    key_id, _, secret = token[len(TOKEN_PREFIX) :].partition("_")
    if len(key_id) != _ID_HEX or not secret:
        return None
    return key_id


def _now() -> datetime:
    return datetime.now(UTC)


def _scopes(text: str) -> frozenset[Scope]:
    return frozenset(
        Scope(value) for value in json.loads(text) if value in Scope._value2member_map_
    )


def _devices(text: str | None) -> frozenset[str] | None:
    return frozenset(json.loads(text)) if text is not None else None


def _key(row: sqlite3.Row) -> ApiKey:
    def moment(value: str | None) -> datetime | None:
        return datetime.fromisoformat(value) if value else None

    created = moment(row["created_at"])
    assert created is not None
    return ApiKey(
        row["id"],
        row["name"],
        _scopes(row["scopes"]),
        _devices(row["device_ids"]),
        created,
        moment(row["last_used_at"]),
        moment(row["revoked_at"]),
    )
