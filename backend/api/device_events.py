"""The web console's live view of the fleet, and who the caller is.

- `GET /api/whoami` (any valid key): `{key_id, name, scopes, device_ids, is_admin}`, so a page
  shows and allows what the key may do.
- `GET /api/fleet/events` (devices:read; a device-limited key sees its devices only): Server-
  Sent Events. First `event: snapshot` batches `data: {"devices": [rows]}` (at most
  `SNAPSHOT_BATCH` rows each, rows exactly as `GET /api/devices` rows), then `event: ready`
  `data: {"total": N}`, then live `event: devices` `data: {"devices": [rows]}` and
  `event: removed` `data: {"device_ids": [...]}`; a `: ping` comment every 15 s.

Changes are coalesced per device: the registry's listener only marks a device id as pending
(no row is built on the registry's hot path), and the stream builds the rows of the pending ids
at most every `flush_interval_s`, as they are then. So a device that connects, initializes and
becomes ready within one interval costs one row, and the pending set is bounded by the number
of distinct devices (a stream whose pending set passes `max_pending` ends, and the client, which
reconnects, gets a fresh snapshot instead of a backlog). Events that change no row (tool calls,
voice turns) are ignored: a refused call may name any device id.

A stream ends when the client leaves (Starlette cancels the generator; the listener is removed
in its `finally`), when the bridge stops (`DeviceStreams.close`, called before the HTTP server
waits for its connections to finish, which an endless stream never would), or when its key is
revoked (checked at every flush and ping, so within `ping_interval_s` on a quiet fleet: the
client's next request is then a 401).
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from backend.api.openapi import streamed
from backend.api.scopes import needs, principal_of
from backend.devices import DeviceRegistry
from backend.devices.errors import UnknownDevice
from backend.devices.state import DeviceEvent, EventKind
from backend.keys import Principal, Scope

log = structlog.get_logger("api.device_events")

SNAPSHOT_BATCH = 500
FLUSH_INTERVAL_S = 0.1
PING_INTERVAL_S = 15.0
MAX_PENDING = 100_000
EVENTS_PATH = "/api/fleet/events"
WHOAMI_PATH = "/api/whoami"
# Events that change a device's row (or remove it); the others say nothing a row shows.
ROW_EVENTS = frozenset(EventKind) - {EventKind.TOOL_CALLED, EventKind.VOICE_TURN}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_PING = b": ping\n\n"

Reader = Annotated[Principal, Depends(needs(Scope.DEVICES_READ))]
# The principal of an active key by id, None once revoked (KeyStore.active).
KeyLookup = Callable[[str], Principal | None]
ADMIN_KEY_ID = "admin"  # the admin token's principal: no key to revoke


class WhoAmI(BaseModel):
    """The answer of `GET /api/whoami`: the caller's key, scopes and devices."""

    key_id: str
    name: str
    scopes: list[str]
    device_ids: list[str] | None
    is_admin: bool


def whoami_of(principal: Principal) -> WhoAmI:
    """The caller as `GET /api/whoami` shows it (scopes and devices sorted)."""
    return WhoAmI(
        key_id=principal.key_id,
        name=principal.name,
        scopes=sorted(str(scope) for scope in principal.scopes),
        device_ids=sorted(principal.device_ids) if principal.device_ids is not None else None,
        is_admin=principal.is_admin,
    )


def frame(event: str, data: dict[str, Any]) -> bytes:
    """One Server-Sent Event; compact JSON on one `data:` line (JSON never holds a raw newline)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {text}\n\n".encode()


class DeviceStream:
    """One client's stream: a registry listener that marks device ids pending, and the
    generator that sends the snapshot, then the pending rows."""

    def __init__(
        self,
        registry: DeviceRegistry,
        principal: Principal,
        *,
        flush_interval_s: float,
        ping_interval_s: float,
        max_pending: int,
        snapshot_only: bool = False,
        key_active: KeyLookup | None = None,
    ) -> None:
        self._registry = registry
        self._key_id = principal.key_id
        self._key_active = key_active
        # None: every device (admin, or a key not limited to some devices).
        self._only = None if principal.is_admin else principal.device_ids
        self._flush_interval_s = flush_interval_s
        self._ping_interval_s = ping_interval_s
        self._max_pending = max_pending
        self._snapshot_only = snapshot_only
        self._pending: dict[str, None] = {}  # an ordered set: device ids changed since a flush
        self._wake = asyncio.Event()
        self._closed = False
        self._overflowed = False

    def on_event(self, event: DeviceEvent) -> None:
        """The registry's listener: O(1), builds nothing."""
        if event.kind not in ROW_EVENTS:
            return
        if self._only is not None and event.device_id not in self._only:
            return
        if event.device_id not in self._pending and len(self._pending) >= self._max_pending:
            self._overflowed = True
        else:
            self._pending[event.device_id] = None
        self._wake.set()

    def close(self) -> None:
        """End the stream after one last flush (the bridge is stopping)."""
        self._closed = True
        self._wake.set()

    async def frames(self) -> AsyncIterator[bytes]:
        """The SSE frames: snapshot, `ready`, then coalesced changes and pings until the end."""
        # Subscribed before the snapshot is read: a change during it is sent after `ready`.
        unsubscribe = self._registry.subscribe(self.on_event)
        try:
            total = 0
            for rows in self._snapshot():
                total += len(rows)
                yield frame("snapshot", {"devices": rows})
            yield frame("ready", {"total": total})
            if self._snapshot_only:
                return
            async for chunk in self._live():
                yield chunk
        finally:
            unsubscribe()

    async def _live(self) -> AsyncIterator[bytes]:
        last_flush = time.monotonic()
        while True:
            try:
                async with asyncio.timeout(self._ping_interval_s):
                    await self._wake.wait()
            except TimeoutError:
                if self._revoked():
                    return
                yield _PING
                continue
            if self._revoked():
                return
            if self._overflowed:
                log.info("device event stream fell behind; ending it", pending=len(self._pending))
                return
            wait = last_flush + self._flush_interval_s - time.monotonic()
            if wait > 0 and not self._closed:
                await asyncio.sleep(wait)  # coalesce: more changes join this flush
            self._wake.clear()
            for chunk in self._flush():
                yield chunk
            if self._closed:
                return
            last_flush = time.monotonic()

    def _revoked(self) -> bool:
        if self._key_active is None or self._key_id == ADMIN_KEY_ID:
            return False
        return self._key_active(self._key_id) is None

    def _flush(self) -> Iterator[bytes]:
        pending, self._pending = self._pending, {}
        rows: list[dict[str, Any]] = []
        removed: list[str] = []
        for device_id in pending:
            row = self._row(device_id)
            if row is None:
                removed.append(device_id)
            else:
                rows.append(row)
        for start in range(0, len(rows), SNAPSHOT_BATCH):
            yield frame("devices", {"devices": rows[start : start + SNAPSHOT_BATCH]})
        for start in range(0, len(removed), SNAPSHOT_BATCH):
            yield frame("removed", {"device_ids": removed[start : start + SNAPSHOT_BATCH]})

    def _row(self, device_id: str) -> dict[str, Any] | None:
        try:
            return self._registry.summary(device_id)
        except UnknownDevice:
            return None  # forgotten (or never known: nothing to show)

    def _snapshot(self) -> Iterator[list[dict[str, Any]]]:
        """The rows of every device the key may see, sorted by id, in batches; each batch is
        built when it is sent, so a large fleet is never held as rows all at once."""
        registry = self._registry
        known = {record.device_id for record in registry.records()}
        known.update(device.device_id for device in registry)
        if self._only is not None:
            known &= self._only
        ids = sorted(known)
        for start in range(0, len(ids), SNAPSHOT_BATCH):
            rows = [self._row(device_id) for device_id in ids[start : start + SNAPSHOT_BATCH]]
            batch = [row for row in rows if row is not None]
            if batch:
                yield batch


class DeviceStreams:
    """The open device event streams of one bridge, and their routes."""

    def __init__(
        self,
        registry: DeviceRegistry,
        *,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        ping_interval_s: float = PING_INTERVAL_S,
        max_pending: int = MAX_PENDING,
        key_active: KeyLookup | None = None,
    ) -> None:
        self._registry = registry
        self._key_active = key_active
        self._flush_interval_s = flush_interval_s
        self._ping_interval_s = ping_interval_s
        self._max_pending = max_pending
        self._open: set[DeviceStream] = set()
        self._closed = False

    def __len__(self) -> int:
        """How many streams are open now."""
        return len(self._open)

    def close(self) -> None:
        """End every open stream (and refuse none: a stream opened later ends at once)."""
        self._closed = True
        for stream in list(self._open):
            stream.close()

    def open(self, principal: Principal, *, snapshot_only: bool = False) -> DeviceStream:
        """A new stream for this caller (already closed if the bridge is stopping)."""
        stream = DeviceStream(
            self._registry,
            principal,
            flush_interval_s=self._flush_interval_s,
            ping_interval_s=self._ping_interval_s,
            max_pending=self._max_pending,
            snapshot_only=snapshot_only,
            key_active=self._key_active,
        )
        if self._closed:
            stream.close()
        self._open.add(stream)
        return stream

    async def _tracked(self, stream: DeviceStream) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream.frames():
                yield chunk
        finally:
            self._open.discard(stream)

    def router(self) -> APIRouter:
        """The routes `GET /api/whoami` and `GET /api/fleet/events`."""
        router = APIRouter()

        @router.get(WHOAMI_PATH)
        async def whoami(request: Request) -> WhoAmI:
            return whoami_of(principal_of(request))

        @router.get(EVENTS_PATH, response_model=None, responses=streamed())
        async def device_events(
            principal: Reader,
            snapshot_only: Annotated[
                bool,
                Query(description="end the stream after the snapshot and `ready`"),
            ] = False,
        ) -> StreamingResponse:
            stream = self.open(principal, snapshot_only=snapshot_only)
            return StreamingResponse(
                self._tracked(stream), media_type="text/event-stream", headers=_SSE_HEADERS
            )

        return router
