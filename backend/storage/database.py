"""One SQLite file for the whole bridge, used from asyncio without blocking the event loop.

Every statement runs on one dedicated thread that owns the connection (sqlite3 objects must stay
on the thread that made them), so callers `await` work that never stalls device traffic, and
writes are serialised without locks. Components (the device catalogue, chat memory, ...) bring
their own numbered migrations; `open()` applies the missing ones in order, each in its own
transaction, and records them in `schema_migrations`.

Failures to open (a corrupted file, a read-only file or folder, a newer schema) raise one
`DatabaseError` with a one-line reason, never a traceback.
"""

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from backend.errors import BridgeError

T = TypeVar("T")

DATABASE_FILE = "bridge.sqlite3"
_BOOKKEEPING = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    component TEXT NOT NULL,
    version INTEGER NOT NULL,
    applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (component, version)
)
"""


class DatabaseError(BridgeError):
    """The database cannot be opened or used; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema step of one component; versions count up from 1 per component."""

    component: str
    version: int
    sql: str


class Database:
    """The bridge's SQLite database (WAL mode), driven from asyncio through one worker thread."""

    def __init__(self, path: Path, migrations: Iterable[Migration] = ()) -> None:
        self.path = path
        self._migrations = _checked(migrations)
        self._executor: ThreadPoolExecutor | None = None
        self._connection: sqlite3.Connection | None = None
        self._thread_id: int | None = None

    @property
    def is_open(self) -> bool:
        """Whether the database is open (between `open` and `close`)."""
        return self._executor is not None

    async def open(self) -> None:
        """Open (creating it if needed) and migrate; raises DatabaseError with a clear reason."""
        if self._executor is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite")
        try:
            await self._submit(self._open_sync)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Close the connection on its thread and stop the thread; closing twice is fine."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(executor, self._close_sync)
        finally:
            executor.shutdown(wait=True)

    async def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run `work(connection)` on the database thread inside one transaction."""

        def transaction() -> T:
            connection = self._require_connection()
            try:
                with connection:
                    return work(connection)
            except sqlite3.Error as exc:
                raise DatabaseError(f"database {self.path.name}: {exc}") from exc

        return await self._submit(transaction)

    async def execute(self, sql: str, parameters: Sequence[Any] = ()) -> int:
        """One statement in its own transaction; returns the number of rows changed."""
        return await self.run(lambda connection: connection.execute(sql, parameters).rowcount)

    async def fetchall(self, sql: str, parameters: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """Run one query and return all its rows."""
        return await self.run(lambda connection: connection.execute(sql, parameters).fetchall())

    async def fetchone(self, sql: str, parameters: Sequence[Any] = ()) -> sqlite3.Row | None:
        """Run one query and return its first row, if any."""
        rows = await self.run(lambda connection: connection.execute(sql, parameters).fetchmany(1))
        return rows[0] if rows else None

    def run_sync(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """For code already on the database thread (rare); refuses to run anywhere else."""
        if threading.get_ident() != self._thread_id:
            raise RuntimeError("run_sync called outside the database thread")
        connection = self._require_connection()
        with connection:
            return work(connection)

    # ---- on the database thread ---------------------------------------------------------------

    async def _submit(self, work: Callable[[], T]) -> T:
        if self._executor is None:
            raise DatabaseError(f"database {self.path.name} is not open")
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    def _require_connection(self) -> sqlite3.Connection:
        if self._connection is None:
            raise DatabaseError(f"database {self.path.name} is not open")
        return self._connection

    def _open_sync(self) -> None:
        self._thread_id = threading.get_ident()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(self.path, isolation_level="DEFERRED")
        except (OSError, sqlite3.Error) as exc:
            raise DatabaseError(f"cannot open database {self.path}: {_reason(exc)}") from None
        connection.row_factory = sqlite3.Row
        try:
            _configure(connection)
            _prove_writable(connection)
            self._migrate(connection)
        except sqlite3.Error as exc:
            connection.close()
            raise DatabaseError(f"cannot use database {self.path}: {_reason(exc)}") from None
        self._connection = connection

    def _migrate(self, connection: sqlite3.Connection) -> None:
        with connection:
            connection.execute(_BOOKKEEPING)
        applied: dict[str, int] = {}
        for component, version in connection.execute(
            "SELECT component, MAX(version) FROM schema_migrations GROUP BY component"
        ):
            applied[component] = version
        known: dict[str, int] = {}
        for migration in self._migrations:
            known[migration.component] = max(known.get(migration.component, 0), migration.version)
        for component, version in applied.items():
            if version > known.get(component, version):
                raise DatabaseError(
                    f"database {self.path} has {component} schema v{version}, newer than "
                    f"this bridge knows (v{known[component]}): upgrade, or use another data dir"
                )
        for migration in self._migrations:
            if migration.version <= applied.get(migration.component, 0):
                continue
            with connection:
                connection.execute("BEGIN")  # DDL too: a failed migration leaves nothing behind
                for statement in _statements(migration.sql):
                    connection.execute(statement)
                connection.execute(
                    "INSERT INTO schema_migrations (component, version) VALUES (?, ?)",
                    (migration.component, migration.version),
                )

    def _close_sync(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()


def _configure(connection: sqlite3.Connection) -> None:
    # WAL: readers never block the writer; NORMAL is durable across a process crash in WAL mode.
    mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise sqlite3.OperationalError(f"journal_mode is {mode}, WAL is required")
    connection.execute("PRAGMA synchronous=NORMAL")
    connection.execute("PRAGMA foreign_keys=ON")
    connection.execute("PRAGMA busy_timeout=5000")


def _prove_writable(connection: sqlite3.Connection) -> None:
    """Commit one cheap real write, so a read-only file fails the start, not the first write.

    Opening a read-only file, switching it to WAL and even `BEGIN IMMEDIATE` all succeed; with
    every migration applied nothing else writes at start. Rewriting `user_version` to its own
    value commits a write (one WAL frame) and fails with SQLITE_READONLY on a file mode 0444
    (not root) or `chattr +i` (root too).
    """
    version = int(connection.execute("PRAGMA user_version").fetchone()[0])
    connection.execute(f"PRAGMA user_version = {version}")  # PRAGMA takes no parameters


def _statements(script: str) -> list[str]:
    """Split a migration into statements (sqlite3 runs one per execute inside a transaction)."""
    statements: list[str] = []
    current: list[str] = []
    for line in script.splitlines():
        current.append(line)
        candidate = "\n".join(current).strip()
        if candidate and sqlite3.complete_statement(candidate):
            statements.append(candidate)
            current = []
    rest = "\n".join(current).strip()
    if rest:
        statements.append(rest)
    return statements


def _checked(migrations: Iterable[Migration]) -> tuple[Migration, ...]:
    ordered = tuple(sorted(migrations, key=lambda m: (m.component, m.version)))
    seen: dict[str, int] = {}
    for migration in ordered:
        expected = seen.get(migration.component, 0) + 1
        if migration.version != expected:
            raise ValueError(
                f"{migration.component} migrations must count 1, 2, 3...; "
                f"found v{migration.version} where v{expected} was expected"
            )
        seen[migration.component] = migration.version
    return ordered


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, sqlite3.DatabaseError) and "not a database" in text:
        return "the file is not a SQLite database (corrupted?); move it away to start afresh"
    if "readonly" in text or "read-only" in text:
        return "the database is read-only; check the permissions of the file and its folder"
    if "unable to open" in text:
        return "unable to open the file; check that its folder exists and is writable"
    return text
