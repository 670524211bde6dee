"""The audit log: one row per device tool call, refused ones included.

Every `Device.call_tool` ends in one `tool_called` registry event, and so does a call refused
before it reached a device (`DeviceRegistry.refuse_call`); this listener turns each into a row:
when, who (`actor`: `key:<id>` for an API key, `admin` for the admin token, `chat:...` or
`device:<id>` for a chat turn or a device's own conversation), which device and tool, the
SHA-256 of the arguments (canonical JSON; the arguments themselves are not kept: they may hold
personal data), the outcome (`ok`, `tool_error`, `error`, `refused`), the error class, whether
the call was confirmed, and how long it took. Photo uploads to the bridge's vision endpoint get a
row each too (`record_upload`: tool `vision.explain`, the upload's size in `bytes`; never the
image). Rows are digested and written off the call path, batched, at most every
`flush_interval_s`; past `max_buffer` unwritten rows (a database that stopped answering) new
ones are counted as `dropped` rather than kept.

Retention: every `prune_interval_s` (an hour) rows older than `retention_s` are deleted, then the
oldest rows past `max_rows` (settings `audit_retention_days`, 90, and `audit_max_rows`,
1,000,000; 0 turns either off), in batches of `PRUNE_BATCH` rows so no transaction is long.
"""

import asyncio
import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import structlog

from backend.common import iso_time
from backend.devices.registry import DeviceEvent, DeviceRegistry, EventKind
from backend.storage import Connection, Database, DatabaseError, Migration, WriteBehind

log = structlog.get_logger("audit")

AUDIT_MIGRATIONS = (
    Migration(
        "audit",
        1,
        """
        CREATE TABLE audit_log (
            id {serial_pk},
            at {real} NOT NULL,
            actor TEXT,
            device_id TEXT NOT NULL,
            tool TEXT NOT NULL,
            arguments_sha256 TEXT NOT NULL,
            outcome TEXT NOT NULL,
            error TEXT,
            confirmed INTEGER NOT NULL,
            duration_ms {real} NOT NULL
        );
        CREATE INDEX audit_log_device ON audit_log (device_id, id);
        """,
    ),
    Migration("audit", 2, "ALTER TABLE audit_log ADD COLUMN bytes INTEGER;"),
)


PRUNE_INTERVAL_S = 3600.0
PRUNE_BATCH = 10_000

_CANONICAL = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def arguments_digest(arguments: Any) -> str:
    """SHA-256 of the arguments' canonical JSON (sorted keys, compact, UTF-8)."""
    try:
        canonical = _CANONICAL.encode(arguments)
    except (TypeError, ValueError, RecursionError):
        canonical = repr(arguments)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One audit row as read back: the arguments only as their SHA-256."""

    id: int
    at: float
    actor: str | None
    device_id: str
    tool: str
    arguments_sha256: str
    outcome: str
    error: str | None
    confirmed: bool
    duration_ms: float
    bytes: int | None = None  # the size of a photo upload (None for tool calls)

    def to_json(self) -> dict[str, Any]:
        """The row for the API and CLI, with `at` as ISO-8601 UTC."""
        return {
            "id": self.id,
            "at": iso_time(self.at),
            "actor": self.actor,
            "device_id": self.device_id,
            "tool": self.tool,
            "arguments_sha256": self.arguments_sha256,
            "outcome": self.outcome,
            "error": self.error,
            "confirmed": self.confirmed,
            "duration_ms": self.duration_ms,
            "bytes": self.bytes,
        }


class AuditLog:
    """Follows the registry's `tool_called` events into the `audit_log` table."""

    def __init__(
        self,
        database: Database,
        registry: DeviceRegistry,
        *,
        flush_interval_s: float = 0.5,
        max_buffer: int = 100_000,
        retention_s: float = 90 * 86400.0,
        max_rows: int = 1_000_000,
        prune_interval_s: float = PRUNE_INTERVAL_S,
    ) -> None:
        self.retention_s = retention_s  # 0: rows are kept whatever their age
        self.max_rows = max_rows  # 0: no cap
        self._prune_interval_s = prune_interval_s
        self._pruner: asyncio.Task[None] | None = None
        self.pruned = 0
        self._db = database
        self._registry = registry
        self._max_buffer = max_buffer
        self._buffer: list[tuple[Any, ...]] = []
        self._writer = WriteBehind(
            self._write_buffered,
            name="audit-log",
            interval_s=flush_interval_s,
            depth=lambda: len(self._buffer),
        )
        self._unsubscribe: Any = None
        self.dropped = 0
        self.written = 0

    def start(self) -> None:
        """Follow the registry's `tool_called` events and start the periodic writer."""
        self._unsubscribe = self._registry.subscribe(self._on_event)
        self._writer.start()
        if self.retention_s > 0 or self.max_rows > 0:
            self._pruner = asyncio.create_task(self._prune_periodically(), name="audit-prune")

    async def stop(self) -> None:
        """Stop following events and write what is buffered (a failing database loses only those
        rows)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._pruner is not None:
            self._pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pruner
            self._pruner = None
        await self._writer.stop()
        with contextlib.suppress(DatabaseError):
            await self.flush()

    def _on_event(self, event: DeviceEvent) -> None:
        if event.kind is not EventKind.TOOL_CALLED or event.origin is not None:
            return  # a call forwarded to another instance is audited there
        detail = event.detail
        self._push(
            (
                time.time(),
                detail.get("actor"),
                event.device_id,
                str(detail.get("tool", "")),
                detail.get("arguments") or {},  # digested at flush, off the call's path
                str(detail.get("outcome", "")),
                detail.get("error"),
                int(bool(detail.get("confirmed"))),
                float(detail.get("duration_ms", 0.0)),
                None,
            )
        )

    def record_upload(
        self,
        device_id: str,
        *,
        tool: str,
        question: str,
        size: int,
        outcome: str,
        error: str | None,
        duration_ms: float,
        actor: str | None = None,
    ) -> None:
        """One row for an upload (its size and outcome; the question only digested); `actor`
        is `device:<device_id>` unless given (an uploader whose credentials did not hold)."""
        who = actor if actor is not None else f"device:{device_id}"
        row = (time.time(), who, device_id, tool, {"question": question})
        self._push((*row, outcome, error, 0, duration_ms, size))

    def _push(self, row: tuple[Any, ...]) -> None:
        """A row for the next flush, or counted as dropped when the buffer is full."""
        if len(self._buffer) >= self._max_buffer:
            self.dropped += 1
            return
        self._buffer.append(row)
        self._writer.wake()

    async def flush(self) -> None:
        """Write the buffered rows in one transaction, after any write in progress; on a
        database error they are counted as dropped."""
        await self._writer.flush()

    async def _write_buffered(self) -> None:
        rows, self._buffer = self._buffer, []
        if not rows:
            return
        rows = [_digested(row) for row in rows]
        try:
            await self._db.run(lambda c: _insert(c, rows))
        except DatabaseError as exc:
            log.error("audit rows not written; will retry", rows=len(rows), error=str(exc))
            self._buffer = rows + self._buffer
            raise
        self.written += len(rows)

    async def _prune_periodically(self) -> None:
        while True:
            try:
                await self.prune()
            except DatabaseError as exc:
                log.warning("audit rows not pruned; will retry", error=str(exc))
            await asyncio.sleep(self._prune_interval_s)

    async def prune(self, now: float | None = None) -> int:
        """Delete rows older than `retention_s`, then the oldest past `max_rows`; how many."""
        deleted = 0
        if self.retention_s > 0:
            cutoff = (time.time() if now is None else now) - self.retention_s
            while True:
                batch = await self._db.execute(
                    "DELETE FROM audit_log WHERE id IN"
                    " (SELECT id FROM audit_log WHERE at < ? ORDER BY id LIMIT ?)",
                    (cutoff, PRUNE_BATCH),
                )
                deleted += batch
                if batch < PRUNE_BATCH:
                    break
        if self.max_rows > 0:
            rows = await self._db.fetchall(
                "SELECT id FROM audit_log ORDER BY id DESC LIMIT 1 OFFSET ?", (self.max_rows,)
            )
            if rows:  # the newest row past the cap: it and everything older go
                last = rows[0]["id"]
                while True:
                    batch = await self._db.execute(
                        "DELETE FROM audit_log WHERE id IN"
                        " (SELECT id FROM audit_log WHERE id <= ? ORDER BY id LIMIT ?)",
                        (last, PRUNE_BATCH),
                    )
                    deleted += batch
                    if batch < PRUNE_BATCH:
                        break
        if deleted:
            self.pruned += deleted
            log.info("audit rows pruned", deleted=deleted, retention_s=self.retention_s,
                     max_rows=self.max_rows)  # fmt: skip
        return deleted

    async def entries(
        self,
        *,
        device_id: str | None = None,
        tool: str | None = None,
        actor: str | None = None,
        before: int | None = None,
        limit: int = 100,
    ) -> list[AuditEntry]:
        """Newest first; `before` is the id of the last entry of the previous page."""
        await self.flush()
        where: list[str] = []
        parameters: list[Any] = []
        for column, value in (("device_id", device_id), ("tool", tool), ("actor", actor)):
            if value is not None:
                where.append(f"{column} = ?")
                parameters.append(value)
        if before is not None:
            where.append("id < ?")
            parameters.append(before)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = await self._db.fetchall(
            f"SELECT * FROM audit_log {clause} ORDER BY id DESC LIMIT ?", (*parameters, limit)
        )
        return [
            AuditEntry(
                row["id"],
                row["at"],
                row["actor"],
                row["device_id"],
                row["tool"],
                row["arguments_sha256"],
                row["outcome"],
                row["error"],
                bool(row["confirmed"]),
                row["duration_ms"],
                row["bytes"],
            )
            for row in rows
        ]


class _Digest(str):
    """An arguments digest already computed (a row a failed write put back)."""


def _digested(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """The row with its arguments (index 4) replaced by their digest."""
    arguments = row[4]
    if isinstance(arguments, _Digest):
        return row
    return (*row[:4], _Digest(arguments_digest(arguments)), *row[5:])


def _insert(c: Connection, rows: list[tuple[Any, ...]]) -> None:
    c.executemany(
        "INSERT INTO audit_log (at, actor, device_id, tool, arguments_sha256, outcome, error,"
        " confirmed, duration_ms, bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        rows,
    )
