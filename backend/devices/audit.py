"""The audit log: one row per device tool call, refused ones included.

Every `Device.call_tool` ends in one `tool_called` registry event, and so does a call refused
before it reached a device (`DeviceRegistry.refuse_call`); this listener turns each into a row:
when, who (`actor`: `key:<id>` for an API key, `admin` for the admin token, `chat:...` or
`device:<id>` for a chat turn or a device's own conversation), which device and tool, the
SHA-256 of the arguments (canonical JSON; the arguments themselves are not kept: they may hold
personal data), the outcome (`ok`, `tool_error`, `error`, `refused`), the error class, whether
the call was confirmed, and how long it took. Photo uploads to the bridge's vision endpoint get a
row each too (`record_upload`: tool `vision.explain`, the upload's size in `bytes`; never the
image). Rows are written to the database in batches, at most every `flush_interval_s`; past
`max_buffer` unwritten rows (a database that stopped answering) new ones are counted as
`dropped` rather than kept.

Crash safety (`journal`, the file `audit-journal` in the data directory): each row is also
appended to a local journal as it is pushed, in the `tool_called` event itself, so before the
call's caller gets its answer: one `write()` of a JSON line, arguments already digested (tens of
µs with the digest; no fsync: the kernel keeps what was written across a `kill -9` of the
process, not across a power cut, the same bound as SQLite's `synchronous=NORMAL`). A flush moves
the journal aside (`audit-journal.<n>`) together with the batch and deletes it once the batch is
committed. At start, journal files a killed bridge left are written to the database
(`recovered`; rows already there, committed just before the kill, are recognised by time, device
and digest and not written twice), then deleted. A journal that cannot be written (disk full)
does not fail the call: the row is still buffered, counted in `unjournaled` and logged. A
database that is down does not fail the call either: rows wait in the buffer and in the journal;
a bridge stopped while the database is down writes them at its next start rather than losing
them. Each instance of a cluster keeps its own journal: the instance that ran a call writes its
row.

Retention: every `prune_interval_s` (an hour) rows older than `retention_s` are deleted, then the
oldest rows past `max_rows` (settings `audit_retention_days`, 90, and `audit_max_rows`,
1,000,000; 0 turns either off), in batches of `PRUNE_BATCH` rows so no transaction is long.
"""

import asyncio
import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from backend.common import iso_time
from backend.devices.registry import DeviceRegistry
from backend.devices.state import DeviceEvent, EventKind
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
JOURNAL_FILE = "audit-journal"
RECOVERY_RETRY_S = 2.0
JOURNAL_ERROR_LOG_EVERY_S = 10.0

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
        journal: Path | None = None,
    ) -> None:
        """`journal`: the crash-safety journal's path (None: rows pushed but not yet flushed are
        lost with the process)."""
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
        self._journal = journal
        self._journal_fd: int | None = None
        self._journal_dirty = False  # rows appended since the journal was last moved aside
        self._segments: list[Path] = []  # journals moved aside whose rows are not committed
        self._segment_serial = 0
        self._recovery: asyncio.Task[None] | None = None
        self.recovered = 0  # rows a killed bridge's journal brought back at start
        self.unjournaled = 0  # rows the journal could not take (they are still buffered)
        self._journal_error_logged_at = float("-inf")

    def start(self) -> None:
        """Follow the registry's `tool_called` events and start the periodic writer."""
        if self._journal is not None:
            self._open_journal(self._journal)
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
        if self._recovery is not None:
            self._recovery.cancel()  # its files stay for the next start
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery
            self._recovery = None
        await self._writer.stop()
        with contextlib.suppress(DatabaseError):
            await self.flush()
        if self._journal_fd is not None:
            os.close(self._journal_fd)
            self._journal_fd = None
            if not self._journal_dirty and not self._buffer:  # nothing of it is unwritten
                with contextlib.suppress(OSError):
                    assert self._journal is not None
                    self._journal.unlink()

    # ---- the crash-safety journal ---------------------------------------------------------

    def _open_journal(self, path: Path) -> None:
        """Open a fresh journal; the files a previous run left are recovered by a task."""
        self._segment_serial = time.time_ns()  # names no leftover can hold
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            leftovers = sorted(path.parent.glob(f"{path.name}*"))
            if path in leftovers:  # the killed run's current journal: moved aside like a segment
                moved = self._segment_path(path)
                path.rename(moved)
                leftovers[leftovers.index(path)] = moved
            self._journal_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:  # the bridge runs, but a kill would lose the unflushed rows
            log.error("audit journal unavailable: rows not yet written die with the process",
                      path=str(path), error=str(exc))  # fmt: skip
            return
        if leftovers:
            self._recovery = asyncio.create_task(self._recover(leftovers), name="audit-recover")

    def _segment_path(self, path: Path) -> Path:
        while True:  # a rename onto a leftover would lose it (a clock set back)
            self._segment_serial += 1
            segment = path.with_name(f"{path.name}.{self._segment_serial}")
            if not segment.exists():
                return segment

    def _append_journal(self, row: tuple[Any, ...]) -> None:
        """Append one digested row to the journal (a write(), no fsync: see the module)."""
        if self._journal_fd is None:
            return
        try:
            os.write(self._journal_fd, (json.dumps(row) + "\n").encode())
            self._journal_dirty = True
        except (OSError, TypeError, ValueError) as exc:
            self.unjournaled += 1
            now = time.monotonic()
            if now - self._journal_error_logged_at >= JOURNAL_ERROR_LOG_EVERY_S:
                self._journal_error_logged_at = now
                log.error("audit journal not written: a kill now would lose these rows",
                          error=str(exc), unjournaled=self.unjournaled)  # fmt: skip

    def _rotate_journal(self) -> list[Path]:
        """Move the journal aside with the batch being flushed (the caller took the buffer in
        the same step); the segments whose rows that flush commits."""
        if self._journal_fd is not None and self._journal_dirty and self._journal is not None:
            try:
                segment = self._segment_path(self._journal)
                self._journal.rename(segment)
                fresh = os.open(self._journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            except OSError as exc:  # the rows stay in the journal: a later flush moves them
                log.error("audit journal not rotated", error=str(exc))
            else:
                os.close(self._journal_fd)
                self._journal_fd = fresh
                self._journal_dirty = False
                self._segments.append(segment)
        return list(self._segments)

    def _committed(self, segments: list[Path]) -> None:
        for segment in segments:
            with contextlib.suppress(OSError):
                segment.unlink()
            with contextlib.suppress(ValueError):
                self._segments.remove(segment)

    async def _recover(self, files: list[Path]) -> None:
        """Write the rows of a killed run's journal files (those not already in the table),
        then delete the files; retried while the database is down."""
        rows: list[tuple[Any, ...]] = []
        unreadable = 0
        for file in files:
            with contextlib.suppress(OSError):
                for line in file.read_text(errors="replace").splitlines():
                    try:
                        row = json.loads(line)
                    except ValueError:
                        unreadable += 1  # a line cut short (a power cut, a full disk)
                        continue
                    if isinstance(row, list) and len(row) == len(_COLUMNS):
                        rows.append((*row[:4], _Digest(row[4]), *row[5:]))
                    else:
                        unreadable += 1
        while True:
            try:
                added = await self._db.run(lambda c: _insert_missing(c, rows))
                break
            except DatabaseError as exc:
                log.warning("audit journal not recovered yet; will retry", rows=len(rows),
                            error=str(exc))  # fmt: skip
                await asyncio.sleep(RECOVERY_RETRY_S)
        for file in files:
            with contextlib.suppress(OSError):
                file.unlink()
        self.recovered += added
        self.written += added
        log.info("audit rows recovered from the journal of a bridge that did not stop",
                 rows=added, already_stored=len(rows) - added, unreadable=unreadable)  # fmt: skip

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
        if self._journal_fd is not None:  # digested now: the journal never holds arguments
            row = _digested(row)
            self._append_journal(row)
        self._buffer.append(row)
        self._writer.wake()

    async def flush(self) -> None:
        """Write the buffered rows in one transaction, after any write in progress; on a
        database error they are counted as dropped."""
        await self._writer.flush()

    async def _write_buffered(self) -> None:
        rows, self._buffer = self._buffer, []
        segments = self._rotate_journal()  # the journal of these rows, deleted once committed
        if not rows:
            self._committed(segments)
            return
        rows = [_digested(row) for row in rows]
        try:
            await self._db.run(lambda c: _insert(c, rows))
        except DatabaseError as exc:
            log.error("audit rows not written; will retry", rows=len(rows), error=str(exc))
            self._buffer = rows + self._buffer
            raise
        self.written += len(rows)
        self._committed(segments)

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
        outcome: str | None = None,
        since: float | None = None,
        until: float | None = None,
        before: int | None = None,
        limit: int = 100,
    ) -> list[AuditEntry]:
        """Newest first; `before` is the id of the last entry of the previous page; `since`
        (inclusive) and `until` (exclusive) bound the time, as Unix seconds."""
        await self.flush()
        where: list[str] = []
        parameters: list[Any] = []
        filters = (("device_id", device_id), ("tool", tool), ("actor", actor), ("outcome", outcome))
        for column, value in filters:
            if value is not None:
                where.append(f"{column} = ?")
                parameters.append(value)
        for condition, bound in (("at >= ?", since), ("at < ?", until), ("id < ?", before)):
            if bound is not None:
                where.append(condition)
                parameters.append(bound)
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


_COLUMNS = (
    "at", "actor", "device_id", "tool", "arguments_sha256", "outcome", "error", "confirmed",
    "duration_ms", "bytes",
)  # fmt: skip


def _insert(c: Connection, rows: list[tuple[Any, ...]]) -> None:
    c.executemany(
        f"INSERT INTO audit_log ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
        rows,
    )


def _insert_missing(c: Connection, rows: list[tuple[Any, ...]]) -> int:
    """Insert the journal rows not already stored (a batch committed just before the kill, whose
    journal was not deleted yet): a row is known by its time, device and digest."""
    if not rows:
        return 0
    stored = {
        (row["at"], row["device_id"], row["arguments_sha256"])
        for row in c.execute(
            "SELECT at, device_id, arguments_sha256 FROM audit_log WHERE at >= ? AND at <= ?",
            (min(row[0] for row in rows), max(row[0] for row in rows)),
        ).fetchall()
    }
    missing = [row for row in rows if (row[0], row[2], row[4]) not in stored]
    if missing:
        _insert(c, missing)
    return len(missing)
