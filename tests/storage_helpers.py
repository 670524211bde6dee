"""The `database_target` fixture: a store test runs once on SQLite and once on PostgreSQL.

Import it into a test module (`from tests.storage_helpers import database_target`) and build
`Database(database_target, MIGRATIONS)`: a SQLite file in the test's folder, or a fresh database
on the worker's throwaway PostgreSQL (testkit/postgres.py; started only when a test asks for it).
"""

from pathlib import Path

import pytest

from testkit.postgres import postgres_available

ENGINES = ("sqlite", "postgresql")


@pytest.fixture(params=ENGINES)
def database_target(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """The SQLite file's path or a PostgreSQL URL (a fresh, empty database)."""
    if request.param == "sqlite":
        return tmp_path / "bridge.sqlite3"
    if not postgres_available():
        pytest.skip("PostgreSQL is not installed (scripts/test installs it)")
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture(params=ENGINES)
def bridge_database_url(request: pytest.FixtureRequest) -> str | None:
    """The `database_url` setting of a bridge under test: None (SQLite in its data dir) or a
    fresh PostgreSQL database."""
    if request.param == "sqlite":
        return None
    if not postgres_available():
        pytest.skip("PostgreSQL is not installed (scripts/test installs it)")
    url: str = request.getfixturevalue("postgres_url")
    return url
