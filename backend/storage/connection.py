"""The connection surface stores program against: the part of sqlite3's that both engines give.

`Database.run(work)` hands `work` a `Connection`: sqlite3's own on SQLite, a thin adapter over a
psycopg connection on PostgreSQL (backend/storage/postgres.py). Rows answer `row["column"]` and
`row[0]`, like `sqlite3.Row`.
"""

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol


class Row(Protocol):
    """One result row: by column name or by position, iterable, with its column names."""

    def __getitem__(self, key: int | str, /) -> Any:
        """The value of a column, by position or name."""
        ...

    def __len__(self) -> int:
        """How many columns the row has."""
        ...

    def __iter__(self) -> Iterator[Any]:
        """The values in column order."""
        ...

    def keys(self) -> list[str]:
        """The column names, in order."""
        ...


class Cursor(Protocol):
    """The result of one statement."""

    @property
    def rowcount(self) -> int:
        """Rows changed by an INSERT, UPDATE or DELETE."""
        ...

    def fetchone(self) -> Any:
        """The next row (a `Row`), or None."""
        ...

    def fetchmany(self, size: int = ..., /) -> list[Any]:
        """Up to `size` more rows."""
        ...

    def fetchall(self) -> list[Any]:
        """Every remaining row."""
        ...

    def __iter__(self) -> Iterator[Any]:
        """The remaining rows."""
        ...


class Connection(Protocol):
    """Statements with `?` placeholders, inside the transaction `Database.run` opened."""

    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Cursor:
        """Run one statement."""
        ...

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Cursor:
        """Run one statement once per parameter row."""
        ...
