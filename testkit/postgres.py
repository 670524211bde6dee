"""A real, throwaway PostgreSQL for tests: `initdb` into a temporary directory, the server on a
Unix socket of its own (no TCP port, so parallel workers never collide), stopped at the end.

Never the cluster the machine may already run on 5432. The distribution's binaries
(/usr/lib/postgresql/<version>/bin) are used; `initdb` refuses to run as root, so as root the
cluster is made and run by the `postgres` account. Every test gets a database of its own
(`PostgresServer.new_database`), created from `template0` and dropped at the end.
"""

import contextlib
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

START_TIMEOUT_S = 30.0
SUPERUSER = "bridge"


def _bin_dir() -> Path | None:
    base = Path("/usr/lib/postgresql")
    if base.is_dir():
        versions = sorted(
            (p for p in base.iterdir() if (p / "bin" / "initdb").exists()),
            key=lambda p: int(p.name) if p.name.isdigit() else 0,
        )
        if versions:
            return versions[-1] / "bin"
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


def postgres_available() -> bool:
    """Whether the server binaries are installed (scripts/test installs them)."""
    return _bin_dir() is not None


def _as_owner() -> tuple[list[str], int | None, int | None]:
    """The command prefix, uid and gid to run the server as (`postgres` when we are root)."""
    if os.getuid() != 0:
        return [], None, None
    account = pwd.getpwnam("postgres")
    return ["runuser", "-u", "postgres", "--"], account.pw_uid, account.pw_gid


class PostgresServer:
    """One server; `url(database)` for psycopg, `new_database()` for a fresh, empty database."""

    def __init__(self) -> None:
        bin_dir = _bin_dir()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL is not installed (scripts/test installs it)")
        self.bin_dir = bin_dir
        # Short path: a Unix socket's path must fit in 107 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root
        self.log_path = self.root / "server.log"
        self._prefix, uid, gid = _as_owner()
        if uid is not None and gid is not None:
            os.chown(self.root, uid, gid)
        self._counter = itertools.count(1)
        self._created: list[str] = []

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self._prefix, *args], capture_output=True, text=True, check=check, timeout=120
        )

    def start(self) -> None:
        """Create the cluster (first time only) and start the server; waits until it answers."""
        if not (self.data / "PG_VERSION").exists():
            self._run(
                str(self.bin_dir / "initdb"),
                "-D", str(self.data),
                "-U", SUPERUSER,
                "--auth=trust",
                "--no-sync",
                "-E", "UTF8",
                "--locale=C",
            )  # fmt: skip
        options = (
            f"-k {self.socket_dir} -c listen_addresses='' -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            str(self.bin_dir / "pg_ctl"),
            "-D", str(self.data),
            "-l", str(self.log_path),
            "-o", options,
            "-w", "-t", str(int(START_TIMEOUT_S)),
            "start",
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while self._psql("postgres", "SELECT 1", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"postgres did not start:\n{self.log_path.read_text()}")
            time.sleep(0.05)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`immediate` is the closest to a crash); the cluster stays."""
        self._run(
            str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop",
            check=False,
        )  # fmt: skip

    def destroy(self) -> None:
        """Stop the server and delete the cluster."""
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        """A libpq URL for `database` over the Unix socket."""
        return f"postgresql://{SUPERUSER}@/{database}?host={self.socket_dir}"

    def _psql(
        self, database: str, sql: str, *, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", self.url(database), "-c", sql],
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def new_database(self) -> str:
        """Create an empty database and return its URL."""
        name = f"t{os.getpid()}_{next(self._counter)}"
        self._psql("postgres", f"CREATE DATABASE {name} TEMPLATE template0")
        self._created.append(name)
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Drop a database made by `new_database` (its connections are cut first)."""
        name = url.rsplit("/", 1)[1].split("?", 1)[0]
        self._psql("postgres", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", check=False)


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """A started server, destroyed at the end."""
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.destroy()
