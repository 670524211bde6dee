"""Audit that survives `kill -9` (issue #33): a real `esp32-bridge serve` process under continuous
tool calls through the admin API is killed with SIGKILL five times and restarted on the same
data directory; every call that was answered 200 has its audit row, exactly once.

Each call sends a value no other call sends, so its row is found by the SHA-256 of its arguments
(the audit log keeps only that). Without the audit journal (backend/devices/audit.py) the rows
of the last write-behind batch (up to 0.5 s of calls) were lost at each kill."""

import asyncio
import contextlib
import itertools
import os
import random
import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from backend.devices import DeviceRegistry
from backend.devices.audit import (
    AUDIT_MIGRATIONS,
    JOURNAL_FILE,
    AuditLog,
    _insert,
    arguments_digest,
)
from backend.devices.state import EventKind
from backend.storage import Database, DatabaseError
from backend.storage.database import DATABASE_FILE
from simulator import SimulatedDevice
from testkit.cluster import Balancer
from testkit.cluster_processes import (
    ADMIN_TOKEN,
    DEVICE_TOKEN,
    ServeInstance,
    serve_env,
    wait_until,
)

KILLS = {"sqlite": 5, "postgresql": 1}  # the figure on SQLite; PostgreSQL: the same path
WORKERS = 8  # concurrent callers
TOOL = "sim.synthetic_000"


@pytest.fixture(params=["sqlite", "postgresql"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, str | None]]:
    """The engine's name and None (SQLite in the data directory) or a PostgreSQL URL."""
    if request.param == "sqlite":
        yield "sqlite", None
    else:
        yield "postgresql", request.getfixturevalue("postgres_url")


def stored_digests(data_dir: Path, database_url: str | None) -> Counter[str]:
    """How many rows of TOOL each arguments digest has, read from the database directly."""
    query = "SELECT arguments_sha256 FROM audit_log WHERE tool = ?"
    if database_url is None:
        with contextlib.closing(
            sqlite3.connect(f"file:{data_dir / DATABASE_FILE}?mode=ro", uri=True)
        ) as db:
            return Counter(row[0] for row in db.execute(query, (TOOL,)))
    import psycopg

    with psycopg.connect(database_url) as db:
        rows = db.execute(query.replace("?", "%s"), (TOOL,)).fetchall()
    return Counter(row[0] for row in rows)


@pytest.mark.slow  # a bridge process killed mid-traffic (any timing: every 200 needs its row)
@pytest.mark.timeout(400)  # six serve starts; slow on a loaded 2-core machine
async def test_every_answered_call_has_its_row_after_kill_9s(
    tmp_path: Path, engine: tuple[str, str | None]
) -> None:
    name, database_url = engine
    data_dir = tmp_path / "bridge"
    settings = {"database_url": database_url} if database_url else {}  # else SQLite in data_dir
    bridge = ServeInstance("solo", data_dir, serve_env(**settings))
    balancer = Balancer()  # a stable address for the device across restarts (new ports)
    await balancer.start()
    device = SimulatedDevice(balancer.url, DEVICE_TOKEN, index=7, reconnect_min_s=0.2,
                             extra_tools=1)  # fmt: skip
    values = itertools.count(1)
    answered: list[int] = []  # the values of the calls answered 200
    failed = 0
    try:
        await bridge.start()
        balancer.backends[:] = [("127.0.0.1", bridge.ws_port)]
        device.start()
        for _kill in range(KILLS[name]):
            async with httpx.AsyncClient(
                base_url=bridge.api_url,
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                timeout=10,
            ) as http:

                async def ready(http: httpx.AsyncClient = http) -> bool:
                    reply = await http.get(f"/api/devices/{device.device_id}")
                    return reply.status_code == 200 and reply.json()["state"] == "ready"

                await wait_until(ready, 30, "the device ready")
                stop = asyncio.Event()

                async def caller(http: httpx.AsyncClient = http, stop: asyncio.Event = stop) -> int:
                    failures = 0
                    while not stop.is_set():
                        value = next(values)
                        try:
                            reply = await http.post(
                                f"/api/devices/{device.device_id}/tools/call",
                                json={"name": TOOL, "arguments": {"value": value}},
                            )
                        except httpx.HTTPError:
                            failures += 1  # the bridge died under it: not answered
                            await asyncio.sleep(0.01)
                            continue
                        if reply.status_code == 200:
                            answered.append(value)
                        else:
                            failures += 1
                    return failures

                callers = [asyncio.create_task(caller()) for _ in range(WORKERS)]
                before = len(answered)
                await asyncio.sleep(0.6 + random.random() * 0.6)  # mid-batch, wherever it is
                async with asyncio.timeout(30):  # a loaded machine: some traffic first
                    while len(answered) - before <= 20:  # noqa: ASYNC110 - callers append
                        await asyncio.sleep(0.05)
                await bridge.kill()
                await asyncio.sleep(0.3)  # the callers see the dead bridge
                stop.set()
                failed += sum(await asyncio.gather(*callers))
                assert len(answered) - before > 20, "traffic flowed before the kill"
            await bridge.start()  # the same data directory
            balancer.backends[:] = [("127.0.0.1", bridge.ws_port)]

        expected = Counter(arguments_digest({"value": value}) for value in answered)
        began = time.monotonic()

        async def all_rows() -> bool:  # the restarted bridge writes what the journal held
            return not expected - stored_digests(data_dir, database_url)

        with contextlib.suppress(AssertionError):
            await wait_until(all_rows, 15, "every answered call's row")
        stored = stored_digests(data_dir, database_url)
        missing = expected - stored
        assert not missing, (
            f"{len(missing)} of {len(expected)} calls answered 200 have no audit row "
            f"({failed} calls failed at the kills; waited {time.monotonic() - began:.1f} s)"
        )
        twice = [digest for digest, count in stored.items() if count > 1]
        assert not twice, f"{len(twice)} rows written twice (a journal replayed after commit)"
        # The journals the killed bridges left were recovered and deleted.
        await wait_until(lambda: _async(not journal_files(data_dir, ".*")), 10, "journals gone")
    finally:
        with contextlib.suppress(Exception):
            await device.stop()
        with contextlib.suppress(Exception):
            await bridge.stop()
        await balancer.stop()


async def _async(value: bool) -> bool:
    return value


# ---- the journal's mechanics, in process ---------------------------------------------------


def emit_call(registry: DeviceRegistry, value: int) -> None:
    registry.emit(
        EventKind.TOOL_CALLED, "a4:cf:00:00:00:01", tool=TOOL, outcome="ok", duration_ms=1.0,
        actor="admin", arguments={"value": value, "note": "private words"}, confirmed=False,
        error=None,
    )  # fmt: skip


async def stored_values(database: Database) -> Counter[str]:
    rows = await database.fetchall("SELECT arguments_sha256 FROM audit_log")
    return Counter(row["arguments_sha256"] for row in rows)


def journal_files(directory: Path, suffix: str = "*") -> list[Path]:
    return list(directory.glob(f"{JOURNAL_FILE}{suffix}"))


def digest_of(value: int) -> str:
    return arguments_digest({"value": value, "note": "private words"})


async def test_rows_not_flushed_when_the_process_died_are_written_at_the_next_start(
    tmp_path: Path,
) -> None:
    journal = tmp_path / JOURNAL_FILE
    database = Database(tmp_path / DATABASE_FILE, AUDIT_MIGRATIONS)
    await database.open()
    try:
        registry = DeviceRegistry()
        dead = AuditLog(database, registry, flush_interval_s=3600, journal=journal)
        dead.start()
        emit_call(registry, 1)
        emit_call(registry, 2)
        await dead.flush()  # committed: its journal is gone
        assert not journal_files(tmp_path, ".*")
        emit_call(registry, 3)
        emit_call(registry, 4)
        text = journal.read_text()
        assert "private" not in text and digest_of(3) in text  # only the digest is on disk
        # A batch committed just before the kill, whose journal was not deleted yet.
        emit_call(registry, 5)
        committed = journal.with_name(f"{JOURNAL_FILE}.1")
        journal.rename(committed)
        await database.run(lambda c: _insert(c, [dead._buffer.pop()]))
        assert dead._journal_fd is not None
        os.close(dead._journal_fd)  # the kill: no stop(), the buffer is gone with the process
        for task in asyncio.all_tasks():
            if task.get_name() in ("audit-log", "audit-prune"):
                task.cancel()

        registry = DeviceRegistry()
        audit = AuditLog(database, registry, flush_interval_s=3600, journal=journal)
        audit.start()
        emit_call(registry, 6)

        async def recovered() -> bool:
            return audit.recovered == 2

        await wait_until(recovered, 10, "the journal recovered")
        await audit.stop()
        assert await stored_values(database) == Counter(digest_of(v) for v in range(1, 7))
        assert not journal_files(tmp_path)  # a clean stop leaves none
    finally:
        await database.close()


async def test_a_database_down_fails_no_call_and_loses_no_row(tmp_path: Path) -> None:
    journal = tmp_path / JOURNAL_FILE
    database = Database(tmp_path / DATABASE_FILE, AUDIT_MIGRATIONS)
    await database.open()
    try:
        registry = DeviceRegistry()
        audit = AuditLog(database, registry, flush_interval_s=3600, journal=journal)
        audit.start()
        await database.execute("ALTER TABLE audit_log RENAME TO audit_log_away")
        emit_call(registry, 1)  # the event (the call) does not wait for the database
        with pytest.raises(DatabaseError):
            await audit.flush()
        emit_call(registry, 2)
        await audit.stop()  # its final flush fails too: the journal stays for the next start
        assert journal_files(tmp_path)
        await database.execute("ALTER TABLE audit_log_away RENAME TO audit_log")

        audit = AuditLog(database, DeviceRegistry(), flush_interval_s=3600, journal=journal)
        audit.start()

        async def recovered() -> bool:
            return audit.recovered == 2

        await wait_until(recovered, 10, "the journal recovered")
        await audit.stop()
        assert await stored_values(database) == Counter([digest_of(1), digest_of(2)])
    finally:
        await database.close()


async def test_an_unwritable_journal_fails_no_call(tmp_path: Path) -> None:
    database = Database(tmp_path / DATABASE_FILE, AUDIT_MIGRATIONS)
    await database.open()
    try:
        registry = DeviceRegistry()
        audit = AuditLog(database, registry, flush_interval_s=3600, journal=tmp_path / "j")
        audit.start()
        assert audit._journal_fd is not None
        os.close(audit._journal_fd)  # writes now fail (EBADF), like a full disk
        emit_call(registry, 1)
        assert audit.unjournaled == 1
        audit._journal_fd = None
        await audit.stop()
        assert await stored_values(database) == Counter([digest_of(1)])
    finally:
        await database.close()
