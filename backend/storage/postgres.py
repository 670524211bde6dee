"""The PostgreSQL engine: psycopg 3 (sync) with a small connection pool, statements on threads.

`Database` runs each `work(connection)` on a thread of its own pool (as many threads as the
pool has connections), so the event loop never waits on the network. `work` gets `PgConnection`,
the sqlite3-like surface of backend/storage/connection.py: `?` placeholders are translated to
psycopg's `%s`, rows answer by name and by position, BYTEA comes back as `bytes`.

Every failure is a `DatabaseError` naming the server (its URL without the password) in one line,
within a bounded time: `connect_timeout`, the pool's wait for a connection, and TCP keepalives
plus `tcp_user_timeout` so a dropped network ends a statement instead of hanging it. A
connection is checked as it leaves the pool, so after the server comes back the next `run`
works (the pool reconnects by itself).
"""

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import psycopg
import psycopg_pool
from psycopg._cursor_base import BaseCursor
from psycopg.rows import RowMaker

from backend.storage.dialect import describe_url, expand_tokens, to_pyformat
from backend.storage.errors import DatabaseError

T = TypeVar("T")

# One lock id for every bridge sharing the database: migrations run one instance at a time.
MIGRATION_LOCK_ID = 0x6573_7033_3262_7264  # "esp32brd"


class PgRow:
    """One row: `row["column"]` and `row[0]`, iterable, `keys()`, like sqlite3.Row."""

    __slots__ = ("_names", "_values")

    def __init__(self, names: dict[str, int], values: Sequence[Any]) -> None:
        self._names = names
        self._values = values

    def __getitem__(self, key: int | str) -> Any:
        """The value by column position or name (KeyError / IndexError like sqlite3.Row)."""
        if isinstance(key, str):
            return self._values[self._names[key]]
        return self._values[key]

    def __len__(self) -> int:
        """How many columns."""
        return len(self._values)

    def __iter__(self) -> Iterator[Any]:
        """The values in column order."""
        return iter(self._values)

    def __eq__(self, other: object) -> bool:
        """Equal to another row with the same columns and values."""
        if not isinstance(other, PgRow):
            return NotImplemented
        return self._names == other._names and tuple(self._values) == tuple(other._values)

    __hash__: ClassVar[None]  # type: ignore[assignment]

    def keys(self) -> list[str]:
        """The column names in order."""
        return list(self._names)

    def __repr__(self) -> str:
        """The row as its column names and values."""
        return f"PgRow({dict(zip(self._names, self._values, strict=True))!r})"


def _row_factory(cursor: BaseCursor[Any, Any]) -> RowMaker[PgRow]:
    description = cursor.description or []
    names = {column.name: index for index, column in enumerate(description)}
    if len(names) < len(description):  # a repeated name: sqlite3.Row answers its first one
        names = {}
        for index, column in enumerate(description):
            names.setdefault(column.name, index)

    def make(values: Sequence[Any]) -> PgRow:
        return PgRow(names, [bytes(v) if isinstance(v, memoryview) else v for v in values])

    return make


class PgConnection:
    """The sqlite3-like connection `work` gets on PostgreSQL (inside the `run` transaction)."""

    __slots__ = ("raw",)

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.raw = raw

    def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> psycopg.Cursor[PgRow]:
        """One statement with `?` placeholders."""
        cursor = self.raw.cursor(row_factory=_row_factory)
        return cursor.execute(to_pyformat(sql), tuple(parameters))

    def executemany(
        self, sql: str, parameters: Iterable[Sequence[Any]], /
    ) -> psycopg.Cursor[PgRow]:
        """One statement per parameter row (pipelined by psycopg: one round trip for many)."""
        cursor = self.raw.cursor(row_factory=_row_factory)
        rows = [tuple(row) for row in parameters]
        if rows:
            cursor.executemany(to_pyformat(sql), rows)
        return cursor


def connect_kwargs(connect_timeout_s: float) -> dict[str, Any]:
    """libpq options so that no wait is unbounded: connecting, and a network that drops
    mid-statement (keepalives, then `tcp_user_timeout` for unacknowledged data)."""
    return {
        "connect_timeout": max(1, round(connect_timeout_s)),
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "tcp_user_timeout": int(connect_timeout_s * 3 * 1000),
        "application_name": "esp32-mcp-bridge",
    }


class PostgresEngine:
    """A pool of connections to one PostgreSQL database (see the module docstring)."""

    def __init__(
        self, url: str, *, pool_size: int, connect_timeout_s: float, pool_timeout_s: float
    ) -> None:
        self.url = url
        self.label = describe_url(url)
        self.pool_size = pool_size
        self._kwargs = connect_kwargs(connect_timeout_s)
        self._pool_timeout_s = pool_timeout_s
        self._pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]] | None = None
        self._last_error: str | None = None
        self._lock = threading.Lock()

    # ---- on a worker thread -------------------------------------------------------------------

    def open(self, migrate: Callable[[PgConnection], None]) -> None:
        """Connect once directly (so a bad URL, password or database is a clear error), migrate
        under an advisory lock, then open the pool."""
        try:
            with psycopg.connect(self.url, **self._kwargs) as raw, raw.transaction():
                raw.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_ID,))
                migrate(PgConnection(raw))
        except psycopg.Error as exc:
            raise self.error(exc, "cannot open") from None
        engine = self

        class _Recording(psycopg.Connection[Any]):
            """Remembers why the pool's last connection attempt failed (for the error)."""

            @classmethod
            def connect(cls, *args: Any, **kwargs: Any) -> Any:
                try:
                    return super().connect(*args, **kwargs)
                except psycopg.Error as exc:
                    engine._last_error = _one_line(exc)
                    raise

        self._pool = psycopg_pool.ConnectionPool(
            self.url,
            connection_class=_Recording,
            kwargs=self._kwargs,
            min_size=1,
            max_size=self.pool_size,
            timeout=self._pool_timeout_s,
            check=psycopg_pool.ConnectionPool.check_connection,
            # Give up retrying a lost connection soon; the next run asks for a fresh one at once
            # instead of waiting out a long backoff after the server is back.
            reconnect_timeout=max(1.0, self._pool_timeout_s),
            name="bridge-db",
            open=False,
        )
        self._pool.open(wait=False)

    def transaction(self, work: Callable[[PgConnection], T]) -> T:
        """`work` in one transaction on one pooled connection; DatabaseError on any failure."""
        pool = self._pool
        if pool is None:
            raise DatabaseError(f"database {self.label} is not open")
        try:
            with pool.connection() as raw, raw.transaction():
                return work(PgConnection(raw))
        except psycopg_pool.PoolTimeout:
            why = f" (last error: {self._last_error})" if self._last_error else ""
            raise DatabaseError(
                f"database {self.label}: no connection within {self._pool_timeout_s:g} s{why}"
            ) from None
        except psycopg.Error as exc:
            raise self.error(exc, "database") from None

    def close(self) -> None:
        """Close the pool (waits for connections in use to come back)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout=self._pool_timeout_s)

    def error(self, exc: BaseException, doing: str) -> DatabaseError:
        """A DatabaseError naming the server (never the password), in one line."""
        return DatabaseError(f"{doing} {self.label}: {_one_line(exc)}")


def run_script(connection: PgConnection, statements: Iterable[str]) -> None:
    """DDL statements as they are (no placeholders: a `%` in them is text)."""
    for statement in statements:
        connection.raw.execute(expand_tokens(statement, "postgresql").encode())


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
