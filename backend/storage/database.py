"""The bridge's database, used from asyncio without blocking the event loop: one SQLite file
(the default), or a PostgreSQL server that several bridges share, chosen by one URL.

SQLite: every statement runs on one dedicated thread that owns the connection (sqlite3 objects
must stay on the thread that made them), so callers `await` work that never stalls device
traffic, and writes are serialised without locks. PostgreSQL (backend/storage/postgres.py): a
small pool of connections, each `run` on one of as many threads. Either way `await db.run(work)`
calls `work(connection)` inside one transaction, with the sqlite3-like `Connection` of
backend/storage/connection.py and `?` placeholders in portable SQL.

Components (the device catalogue, chat memory, ...) bring their own numbered migrations, one
text for both engines (type tokens such as `{real}`, backend/storage/dialect.py); `open()`
applies the missing ones in order and records them in `schema_migrations`. On PostgreSQL the
migrations run under an advisory lock, so bridges starting at once do not race.

Failures (a corrupted, read-only or newer-schema file; a server that is down, refuses, or
rejects the password) raise one `DatabaseError` with a one-line reason, never a traceback.
"""

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from backend.storage.connection import Connection, Row
from backend.storage.dialect import Engine, describe_url, expand_tokens, is_postgres_url
from backend.storage.errors import DatabaseError

if TYPE_CHECKING:  # psycopg costs 0.4 s of import: loaded only when a URL names PostgreSQL
    from backend.storage.postgres import PgConnection, PostgresEngine

T = TypeVar("T")

DATABASE_FILE = "bridge.sqlite3"
POOL_SIZE = 4  # PostgreSQL connections (and threads) per bridge
CONNECT_TIMEOUT_S = 5.0
_BOOKKEEPING = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    component TEXT NOT NULL,
    version INTEGER NOT NULL,
    applied_at TEXT NOT NULL DEFAULT {now},
    PRIMARY KEY (component, version)
)
"""

__all__ = ["DATABASE_FILE", "Database", "DatabaseError", "Migration"]


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema step of one component; versions count up from 1 per component. The SQL is
    portable, with the type tokens of backend/storage/dialect.py (`{real}`, `{serial_pk}`...)."""

    component: str
    version: int
    sql: str


class Database:
    """The bridge's database: a SQLite file (WAL mode) driven through one worker thread, or a
    PostgreSQL URL driven through a small pool (see the module docstring)."""

    def __init__(
        self,
        target: Path | str,
        migrations: Iterable[Migration] = (),
        *,
        pool_size: int = POOL_SIZE,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        pool_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        """`target`: the SQLite file's path, or a `postgresql://` URL; DatabaseError otherwise."""
        self._migrations = _checked(migrations)
        self._executor: ThreadPoolExecutor | None = None
        self._connection: sqlite3.Connection | None = None
        self._thread_id: int | None = None
        self._worker_threads: set[int] = set()
        self._postgres: PostgresEngine | None = None
        self.path: Path | None = None
        if isinstance(target, Path):
            self.path = target
            self.engine: Engine = "sqlite"
            self.label = target.name
        elif is_postgres_url(target):
            try:
                from backend.storage import postgres
            except ImportError as exc:  # psycopg is the `postgres` extra
                raise DatabaseError(
                    f"{describe_url(target)} needs the PostgreSQL driver ({exc.name} is not"
                    " installed): pip install 'esp32-mcp-bridge[postgres]'"
                ) from None

            self._postgres = postgres.PostgresEngine(
                target,
                pool_size=pool_size,
                connect_timeout_s=connect_timeout_s,
                pool_timeout_s=pool_timeout_s,
            )
            self.engine = "postgresql"
            self.label = self._postgres.label
        else:
            raise DatabaseError(
                "the database URL must be postgresql://... (unset: the SQLite file in the data "
                f"directory), not {describe_url(target).split('://', 1)[0]}://..."
            )

    @property
    def shared(self) -> bool:
        """Whether other bridges may write the same database (PostgreSQL), so what a store keeps
        in memory can go stale."""
        return self._postgres is not None

    @property
    def is_open(self) -> bool:
        """Whether the database is open (between `open` and `close`)."""
        return self._executor is not None

    async def open(self) -> None:
        """Open (creating it if needed) and migrate; raises DatabaseError with a clear reason."""
        if self._executor is not None:
            return
        postgres = self._postgres
        self._executor = ThreadPoolExecutor(
            max_workers=postgres.pool_size if postgres is not None else 1,
            thread_name_prefix=self.engine,
            initializer=lambda: self._worker_threads.add(threading.get_ident()),
        )
        try:
            if postgres is not None:
                await self._submit(lambda: postgres.open(self._migrate_postgres))
            else:
                await self._submit(self._open_sync)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Close the connection(s) and stop the thread(s); closing twice is fine."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        closing = self._postgres.close if self._postgres is not None else self._close_sync
        try:
            await asyncio.get_running_loop().run_in_executor(executor, closing)
        finally:
            executor.shutdown(wait=True)
            self._worker_threads.clear()

    async def run(self, work: Callable[[Connection], T]) -> T:
        """Run `work(connection)` on a database thread inside one transaction."""
        return await self._submit(lambda: self._transaction(work))

    async def execute(self, sql: str, parameters: Sequence[Any] = ()) -> int:
        """One statement in its own transaction; returns the number of rows changed."""
        return await self.run(lambda connection: connection.execute(sql, parameters).rowcount)

    async def fetchall(self, sql: str, parameters: Sequence[Any] = ()) -> list[Row]:
        """Run one query and return all its rows."""
        return await self.run(lambda connection: connection.execute(sql, parameters).fetchall())

    async def fetchone(self, sql: str, parameters: Sequence[Any] = ()) -> Row | None:
        """Run one query and return its first row, if any."""
        rows = await self.run(lambda connection: connection.execute(sql, parameters).fetchmany(1))
        return rows[0] if rows else None

    def run_sync(self, work: Callable[[Connection], T]) -> T:
        """For code already on a database thread (rare); refuses to run anywhere else."""
        if threading.get_ident() not in self._worker_threads:
            raise RuntimeError("run_sync called outside the database thread")
        return self._transaction(work)

    # ---- on a database thread -----------------------------------------------------------------

    def _transaction(self, work: Callable[[Connection], T]) -> T:
        if self._postgres is not None:
            return self._postgres.transaction(work)
        connection = self._require_connection()
        try:
            with connection:
                return work(connection)
        except sqlite3.Error as exc:
            raise DatabaseError(f"database {self.label}: {exc}") from exc

    async def _submit(self, work: Callable[[], T]) -> T:
        if self._executor is None:
            raise DatabaseError(f"database {self.label} is not open")
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    def _require_connection(self) -> sqlite3.Connection:
        if self._connection is None:
            raise DatabaseError(f"database {self.label} is not open")
        return self._connection

    def _open_sync(self) -> None:
        assert self.path is not None
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
            self._migrate_sqlite(connection)
        except sqlite3.Error as exc:
            connection.close()
            raise DatabaseError(f"cannot use database {self.path}: {_reason(exc)}") from None
        except DatabaseError:
            connection.close()
            raise
        self._connection = connection

    def _migrate_sqlite(self, connection: sqlite3.Connection) -> None:
        with connection:
            connection.execute(expand_tokens(_BOOKKEEPING, "sqlite"))
        for migration in self._pending(connection):
            with connection:
                connection.execute("BEGIN")  # DDL too: a failed migration leaves nothing behind
                for statement in _statements(expand_tokens(migration.sql, "sqlite")):
                    connection.execute(statement)
                connection.execute(
                    "INSERT INTO schema_migrations (component, version) VALUES (?, ?)",
                    (migration.component, migration.version),
                )

    def _migrate_postgres(self, connection: "PgConnection") -> None:
        """Inside the one transaction that holds the migration lock (backend/storage/postgres.py):
        every missing migration is applied, or none."""
        from backend.storage.postgres import run_script

        run_script(connection, [_BOOKKEEPING])
        for migration in self._pending(connection):
            run_script(connection, _statements(migration.sql))
            connection.execute(
                "INSERT INTO schema_migrations (component, version) VALUES (?, ?)",
                (migration.component, migration.version),
            )

    def _pending(self, connection: Connection) -> list[Migration]:
        """The migrations not applied yet, in order; DatabaseError for a newer schema."""
        applied: dict[str, int] = {}
        for component, version in connection.execute(
            "SELECT component, MAX(version) FROM schema_migrations GROUP BY component"
        ):
            applied[component] = version
        known: dict[str, int] = {}
        for migration in self._migrations:
            known[migration.component] = max(known.get(migration.component, 0), migration.version)
        where = self.path if self.path is not None else self.label
        for component, version in applied.items():
            if version > known.get(component, version):
                raise DatabaseError(
                    f"database {where} has {component} schema v{version}, newer than "
                    f"this bridge knows (v{known[component]}): upgrade, or use another data dir"
                )
        return [m for m in self._migrations if m.version > applied.get(m.component, 0)]

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
