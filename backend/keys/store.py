"""API keys: random tokens stored as SHA-256 hashes, each with scopes.

A token looks like `esk_<key id>_<secret>`: the key id (public, 12 hex digits) finds the row,
then the SHA-256 of the whole token is compared with the stored hash in constant time
(`hmac.compare_digest`). The token is shown once, at creation; only its hash is kept, so a
leaked database does not leak usable keys (the secret has 256 bits, so a plain hash is enough;
no slow KDF is needed for random tokens).

Scopes: `chat:use` (talk to the assistant), `devices:read` (list devices and tools),
`devices:call` (call tools, optionally only on some device ids; includes `devices:read`),
`metrics:read` (scrape `GET /metrics`), `admin` (everything, including key management), and
`mcp:<server>` (use that external MCP server's tools in chat turns; backend/mcp_servers).
`mcp:endpoint` is a scope of its own, not a server: a user's MCP server may dial in with the key
(backend/mcp_dialin). `mcp:dialin` is one too: the tools of every dialed-in server (in chat turns
and on `/mcp`), where `mcp:dialin-<key id>` grants one of them.

The running bridge checks keys without touching the database: `load()` reads the active keys
into an in-memory index (key id → hash and principal) that `create` and `revoke` keep current,
and `resolve(token)` is a dictionary lookup plus one constant-time comparison. `last_used_at` is
written at most once a minute per key, off the request path, and on `aclose()`.

On a database other bridges share (PostgreSQL, docs/storage.md) another instance may create or
revoke a key, so the index is read again every `refresh_s` (KEY_REFRESH_S, 2 s): by a task, and
by `authenticate` before it answers from an index older than that. A key revoked on one instance
is refused on every other within `refresh_s` (`refresh_s=0`: `authenticate` reads the database
every time).
"""

import asyncio
import contextlib
import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

import structlog

from backend.errors import BridgeError
from backend.storage import Connection, Database, Migration, Row

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
TOUCH_INTERVAL_S = 60.0
KEY_REFRESH_S = 2.0  # on a shared database: how stale the key index may get

log = structlog.get_logger("keys")


class Scope(StrEnum):
    """What an API key may do; the values are the scope strings of the API and CLI."""

    CHAT_USE = "chat:use"
    DEVICES_READ = "devices:read"
    DEVICES_CALL = "devices:call"
    ADMIN = "admin"
    # A user's MCP server may dial in with it (backend/mcp_dialin; the key's devices get its tools).
    MCP_ENDPOINT = "mcp:endpoint"
    # The tools of every server dialed in through the MCP endpoint (chat turns and `/mcp`);
    # `mcp:dialin-<key id>` (an `McpScope`) grants the one server of that key.
    MCP_DIALIN = "mcp:dialin"
    # The browser may become a voice device on the talk page (backend/transports/browser.py).
    CONSOLE_TALK = "console:talk"
    # GET /metrics: the bridge's Prometheus metrics (docs/metrics.md), for a scraper's key.
    METRICS_READ = "metrics:read"


_MCP_SCOPE = re.compile(r"mcp:[a-z0-9_-]{1,32}")


class McpScope(str):
    """`mcp:<server>`: may use that external MCP server's tools in chat turns
    (docs/mcp-servers.md). Not a `Scope` member: server names come from the configuration."""

    __slots__ = ()

    def __new__(cls, value: str) -> "McpScope":
        """Accept only `mcp:<server>`; raises ValueError otherwise."""
        if not isinstance(value, str) or _MCP_SCOPE.fullmatch(value) is None:
            raise ValueError(f"not an MCP server scope: {str(value)[:60]!r} (mcp:<server>)")
        return super().__new__(cls, value)

    @property
    def server(self) -> str:
        """The server name after `mcp:`."""
        return self[4:]


AnyScope = Scope | McpScope


def parse_scope(value: str) -> AnyScope:
    """A `Scope`, or an `mcp:<server>` scope; ValueError otherwise."""
    try:
        return Scope(value)
    except ValueError:
        return McpScope(value)


class InvalidKey(BridgeError):
    """The presented token is malformed, unknown or revoked (one message for all: no oracle)."""

    def __init__(self) -> None:
        super().__init__("invalid or revoked API key")


class UnknownKey(BridgeError):
    """No API key has this id (the API answers 404)."""

    def __init__(self, key_id: str) -> None:
        super().__init__(f"no API key {key_id[:40]!r}")
        self.key_id = key_id


class MissingScope(BridgeError):
    """The caller is authenticated, but its key does not allow this (HTTP 403 `forbidden`)."""

    def __init__(self, message: str, scope: "Scope") -> None:
        super().__init__(message)
        self.scope = scope


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a key's id, name, scopes and (for devices:call) allowed devices."""

    key_id: str
    name: str
    scopes: frozenset[AnyScope]
    device_ids: frozenset[str] | None = None  # None: every device

    @property
    def is_admin(self) -> bool:
        """Whether the caller holds the `admin` scope (every device, every action)."""
        return Scope.ADMIN in self.scopes

    def may_use_server(self, server: str, *, dialin: bool = False) -> bool:
        """May use the external MCP server `server` (admin, or `mcp:<server>`); a server that
        dialed in (`dialin`, backend/mcp_dialin) is also covered by `mcp:dialin`."""
        if self.is_admin or f"mcp:{server}" in self.scopes:
            return True
        return dialin and Scope.MCP_DIALIN in self.scopes

    def has(self, scope: Scope | str) -> bool:
        """Admin has every scope; devices:call includes devices:read."""
        wanted = Scope(scope)
        if self.is_admin or wanted in self.scopes:
            return True
        return wanted is Scope.DEVICES_READ and Scope.DEVICES_CALL in self.scopes

    def may_call(self, device_id: str) -> bool:
        """May call tools of that device (admin, or devices:call covering it)."""
        if self.is_admin:
            return True
        if Scope.DEVICES_CALL not in self.scopes:
            return False
        return self.device_ids is None or device_id in self.device_ids

    def may_read(self, device_id: str) -> bool:
        """Whether the caller may see this device: a devices scope, and the device in its list if it
        has one."""
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

    def require(self, scope: Scope) -> None:
        """Raise MissingScope unless the key has `scope` (or admin)."""
        if not self.has(scope):
            raise MissingScope(f"this key lacks the scope {scope}", scope)

    def require_read(self, device_id: str) -> None:
        """Raise MissingScope unless the key may list this device and its tools."""
        if self.may_read(device_id):
            return
        if Scope.DEVICES_READ not in self.scopes and Scope.DEVICES_CALL not in self.scopes:
            raise MissingScope(f"this key lacks the scope {Scope.DEVICES_READ}", Scope.DEVICES_READ)
        raise MissingScope(f"this key does not cover device {device_id!r}", Scope.DEVICES_READ)

    def require_call(self, device_id: str) -> None:
        """Raise MissingScope unless the key may call this device's tools."""
        reason = self.call_denied_reason(device_id)
        if reason is not None:
            raise MissingScope(
                f"not allowed to call tools of {device_id!r}: {reason}", Scope.DEVICES_CALL
            )


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A key as `keys list` shows it (never the token or its hash)."""

    id: str
    name: str
    scopes: frozenset[AnyScope]
    device_ids: frozenset[str] | None
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    @property
    def active(self) -> bool:
        """Whether the key is still usable (not revoked)."""
        return self.revoked_at is None


@dataclass(frozen=True, slots=True)
class CreatedKey:
    """A key just created, with its secret token: shown to the operator once, never stored."""

    key: ApiKey
    token: str  # shown once; not stored

    def __repr__(self) -> str:  # keep the token out of logs and tracebacks
        return f"CreatedKey(key={self.key!r}, token='***')"


def hash_token(token: str) -> str:
    """The SHA-256 hex of a token: what the store keeps and looks tokens up by."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def parse_scopes(values: Iterable[str]) -> frozenset[AnyScope]:
    """Parse scope strings; raises ValueError on an unknown one or on none at all."""
    scopes: set[AnyScope] = set()
    for value in values:
        try:
            scopes.add(parse_scope(value.strip()))
        except ValueError:
            known = ", ".join(scope.value for scope in Scope)
            raise ValueError(f"unknown scope {value!r} (known: {known}, mcp:<server>)") from None
    if not scopes:
        raise ValueError("a key needs at least one scope")
    return frozenset(scopes)


@dataclass(slots=True)
class _Indexed:
    """An active key in the in-memory index."""

    token_hash: str
    principal: Principal
    last_used: datetime | None = None
    written: datetime | None = None  # the last_used_at value last written to the database
    written_at: float = float("-inf")  # monotonic time of that write


class KeyStore:
    """Keys in the bridge database; open it with KEYS_MIGRATIONS."""

    def __init__(
        self,
        db: Database,
        *,
        touch_interval_s: float = TOUCH_INTERVAL_S,
        refresh_s: float | None = None,
    ) -> None:
        """`refresh_s`: how often the index is read again; by default KEY_REFRESH_S on a shared
        database (PostgreSQL) and never on the bridge's own SQLite file."""
        self.db = db
        self.touch_interval_s = touch_interval_s
        self.refresh_s = (
            refresh_s if refresh_s is not None else KEY_REFRESH_S if db.shared else None
        )
        self._index: dict[str, _Indexed] | None = None
        self._loaded_at = float("-inf")
        self._lock = asyncio.Lock()  # a reload never drops a key created while it read
        self._refresher: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()

    @property
    def loaded(self) -> bool:
        """Whether the key index has been read from the database."""
        return self._index is not None

    async def load(self) -> None:
        """Read every active key into the in-memory index that `resolve` uses (and, on a shared
        database, start reading it again every `refresh_s`)."""
        async with self._lock:
            began = time.monotonic()
            rows = await self.db.fetchall(
                "SELECT id, name, token_hash, scopes, device_ids, last_used_at"
                " FROM api_keys WHERE revoked_at IS NULL"
            )
            self._index = self._indexed(rows)
            self._loaded_at = began
        if self.refresh_s is not None and self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(
                self._refresh_forever(self.refresh_s), name="key-index-refresh"
            )

    def _indexed(self, rows: list[Row]) -> dict[str, _Indexed]:
        """The index of `rows`; a key already indexed keeps its use not written yet."""
        old = self._index or {}
        index: dict[str, _Indexed] = {}
        for row in rows:
            kept = old.get(row["id"])
            if kept is not None and kept.token_hash == row["token_hash"]:
                index[row["id"]] = kept
                continue
            used = datetime.fromisoformat(row["last_used_at"]) if row["last_used_at"] else None
            principal = Principal(
                row["id"], row["name"], _scopes(row["scopes"]), _devices(row["device_ids"])
            )
            index[row["id"]] = _Indexed(row["token_hash"], principal, used, used)
        return index

    async def _refresh_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(max(every_s, 0.1))
            try:
                await self.load()
            except BridgeError as exc:  # the database is away: keep the index, try again
                log.warning("could not refresh the API key index", error=str(exc))

    async def _refresh_if_stale(self) -> None:
        if self.refresh_s is not None and time.monotonic() - self._loaded_at >= self.refresh_s:
            await self.load()

    def active(self, key_id: str) -> Principal | None:
        """The principal of the active key `key_id` (in memory), None once it is revoked."""
        entry = self._index.get(key_id) if self._index is not None else None
        return entry.principal if entry is not None else None

    def resolve(self, token: str) -> Principal | None:
        """The principal of a valid, active token from the in-memory index (no database round
        trip), or None. Accepts `Bearer <token>`. Before `load()` no key is valid."""
        if self._index is None:
            return None
        token = _bare(token)
        key_id = _key_id(token)
        entry = self._index.get(key_id or "")
        presented = hash_token(token)
        # Compare even when there is no entry, so timing does not tell ids apart.
        stored = entry.token_hash if entry is not None else _NO_KEY_HASH
        if not hmac.compare_digest(presented, stored) or entry is None:
            return None
        self._touch(entry)
        return entry.principal

    async def aclose(self) -> None:
        """Stop refreshing; write the last-use times still only in memory, and wait for
        pending writes."""
        refresher, self._refresher = self._refresher, None
        if refresher is not None:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
        if self._index is None or not self.db.is_open:
            return
        for entry in self._index.values():
            if entry.last_used is not None and entry.last_used != entry.written:
                with contextlib.suppress(BridgeError):
                    await self._write_last_used(entry.principal.key_id, entry.last_used)
                entry.written = entry.last_used

    def _touch(self, entry: _Indexed) -> None:
        entry.last_used = _now()
        moment = time.monotonic()
        if moment - entry.written_at < self.touch_interval_s:
            return
        entry.written_at = moment
        entry.written = entry.last_used
        try:
            task = asyncio.get_running_loop().create_task(
                self._write_quietly(entry.principal.key_id, entry.last_used)
            )
        except RuntimeError:  # no event loop (a synchronous caller): aclose() writes it
            entry.written = None
            return
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_quietly(self, key_id: str, moment: datetime) -> None:
        try:
            await self._write_last_used(key_id, moment)
        except BridgeError as exc:
            log.warning("could not record key use", key_id=key_id, error=str(exc))

    async def _write_last_used(self, key_id: str, moment: datetime) -> None:
        await self.db.execute(
            "UPDATE api_keys SET last_used_at = ? WHERE id = ?", (moment.isoformat(), key_id)
        )

    async def create(
        self,
        name: str,
        scopes: Iterable[Scope | str],
        *,
        device_ids: Iterable[str] | None = None,
    ) -> CreatedKey:
        """Create a key; raises ValueError on a bad name (1 to 100 characters) or scope."""
        name = " ".join(name.split())
        if not name or len(name) > 100:
            raise ValueError("a key name is 1 to 100 characters")
        scope_set = parse_scopes(str(scope) for scope in scopes)
        devices = frozenset(device_ids) if device_ids is not None else None
        key_id = secrets.token_hex(_ID_HEX // 2)
        token = f"{TOKEN_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        created = _now()
        async with self._lock:
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
            if self._index is not None:
                principal = Principal(key_id, name, scope_set, devices)
                self._index[key_id] = _Indexed(hash_token(token), principal)
        key = ApiKey(key_id, name, scope_set, devices, created, None, None)
        log.info("api key created", key_id=key_id, scopes=sorted(scope_set))
        return CreatedKey(key, token)

    async def list(self, *, include_revoked: bool = True) -> list[ApiKey]:
        """Every key (never the tokens), oldest first; only active ones with
        `include_revoked=False`."""
        where = "" if include_revoked else "WHERE revoked_at IS NULL"
        rows = await self.db.fetchall(
            f"SELECT id, name, scopes, device_ids, created_at, last_used_at, revoked_at"
            f" FROM api_keys {where} ORDER BY created_at, id"
        )
        keys = [_key(row) for row in rows]
        return [self._with_recent_use(key) for key in keys]

    def _with_recent_use(self, key: ApiKey) -> ApiKey:
        """The key with the in-memory last use when that is newer than the stored one."""
        entry = self._index.get(key.id) if self._index is not None else None
        if entry is None or entry.last_used is None:
            return key
        if key.last_used_at is not None and key.last_used_at >= entry.last_used:
            return key
        return ApiKey(
            key.id,
            key.name,
            key.scopes,
            key.device_ids,
            key.created_at,
            entry.last_used,
            key.revoked_at,
        )

    async def revoke(self, key_id: str) -> ApiKey:
        """Revoke a key at once (a second revoke keeps the first time); raises UnknownKey."""

        def work(c: Connection) -> ApiKey:
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

        async with self._lock:
            revoked = await self.db.run(work)
            if self._index is not None and self._index.pop(key_id, None) is not None:
                log.info("api key revoked", key_id=key_id)
        return revoked

    async def authenticate(self, token: str) -> Principal:
        """The principal of a valid, unrevoked token; InvalidKey otherwise. Uses the in-memory
        index once `load()` ran, else reads the database."""
        if self._index is not None:
            await self._refresh_if_stale()
            principal = self.resolve(token)
            if principal is None:
                raise InvalidKey()
            return principal
        token = _bare(token)
        key_id = _key_id(token)
        presented = hash_token(token)

        def work(c: Connection) -> Principal:
            row = c.execute(
                "SELECT id, name, token_hash, scopes, device_ids, revoked_at"
                " FROM api_keys WHERE id = ?",
                (key_id or "",),
            ).fetchone()
            # Compare even when there is no row, so timing does not tell ids apart.
            stored = row["token_hash"] if row is not None else _NO_KEY_HASH
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


_NO_KEY_HASH = hash_token("no such key")


def _bare(token: str) -> str:
    token = token.strip()
    if token.lower().startswith("bearer "):
        token = token[7:].strip()
    return token


def _key_id(token: str) -> str | None:
    if not token.startswith(TOKEN_PREFIX):
        return None
    key_id, _, secret = token[len(TOKEN_PREFIX) :].partition("_")
    if len(key_id) != _ID_HEX or not secret:
        return None
    return key_id


def _now() -> datetime:
    return datetime.now(UTC)


def _scopes(text: str) -> frozenset[AnyScope]:
    scopes: set[AnyScope] = set()
    for value in json.loads(text):
        with contextlib.suppress(ValueError, TypeError):
            scopes.add(parse_scope(value))
    return frozenset(scopes)


def _devices(text: str | None) -> frozenset[str] | None:
    return frozenset(json.loads(text)) if text is not None else None


def _key(row: Row) -> ApiKey:
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
