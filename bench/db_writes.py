"""Benchmark: the device catalogue's writes at 10,000 devices, SQLite against PostgreSQL.

The real `DeviceCatalog` flush (`_write_pending`: one transaction of upserts, plus the tool list
and the orphan sweep) on a real `Database` of each engine, in the same run:

1. First flush: 10,000 devices never stored before (one tool list shared by all).
2. Flush of 10,000 changed device records (every row exists: the upsert's update path).
3. Reconnect storm: all 10,000 devices reconnect; the write-behind turns it into flushes of
   1,000 changed records each (10 transactions), as its 0.5 s interval does for a storm that
   takes a few seconds.

SQLite: the bridge's file (WAL, synchronous=NORMAL) in a temporary folder. PostgreSQL: a
throwaway cluster (testkit/postgres.py) on a Unix socket of the same machine, switched back to
`fsync=on`, `synchronous_commit=on`, `full_page_writes=on` so both engines make commits durable.
Each figure is the median of the repetitions. Target: each 10,000-record flush within 1 s on
both engines (the catalogue's flush interval is 0.5 s; a slower flush only merges more changes).
"""

import asyncio
import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from backend.devices.catalog import DEVICE_MIGRATIONS, DeviceCatalog
from backend.devices.registry import DeviceRegistry
from backend.devices.state import DeviceRecord, ToolSet
from backend.mcp_session.models import parse_tools
from backend.storage import Database
from bench.common import bench_main, quiet_logging, ratio, table, verdict
from bench.report import environment
from testkit.postgres import PostgresServer, postgres_available, running_postgres
from testkit.stock_device import stock_tools

NAME = "db_writes"
DEVICES_FULL = 10_000
DEVICES_QUICK = 500
REPS_FULL = 5
REPS_QUICK = 1
STORM_BATCHES = 10
TARGET_S = 1.0


def records(count: int, at: float) -> list[DeviceRecord]:
    tools = ToolSet.of(parse_tools(stock_tools()))
    info = {"name": "bread-compact-wifi", "version": "2.4.2"}
    return [
        DeviceRecord(
            device_id=f"a4:cf:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}:00",
            client_id=f"client-{i}",
            transport="websocket",
            first_seen=at,
            last_seen=at,
            server_info=info,
            tools=tools,
            tools_read_at=at,
        )
        for i in range(count)
    ]


async def flush_changed(
    catalog: DeviceCatalog, registry: DeviceRegistry, changed: list[DeviceRecord]
) -> float:
    """Put `changed` in the registry, mark them dirty as its events would, time one flush."""
    registry.load(changed)
    catalog._dirty.update(record.device_id for record in changed)
    began = time.perf_counter()
    await catalog.flush()
    return time.perf_counter() - began


async def measure(database: Database, count: int) -> dict[str, float]:
    """One repetition on a fresh schema: the three flushes, in seconds."""
    await database.open()
    try:
        registry = DeviceRegistry()
        catalog = DeviceCatalog(database, registry, flush_interval_s=3600)
        base = records(count, time.time())
        first = await flush_changed(catalog, registry, base)
        moved = [replace(r, last_seen=r.last_seen + 1, client_id=f"{r.client_id}-b") for r in base]
        changed = await flush_changed(catalog, registry, moved)
        storm = 0.0
        size = max(1, count // STORM_BATCHES)
        again = [replace(r, last_seen=r.last_seen + 2, client_id=f"{r.client_id}-c") for r in base]
        for start in range(0, count, size):
            storm += await flush_changed(catalog, registry, again[start : start + size])
        stored = await database.fetchone("SELECT COUNT(*) FROM devices")
        assert stored is not None and stored[0] == count, stored
        return {"first": first, "changed": changed, "storm": storm}
    finally:
        await database.close()


async def repeat(
    make: Callable[[], Awaitable[Database]], count: int, reps: int
) -> dict[str, float]:
    runs = [await measure(await make(), count) for _ in range(reps)]
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def restart_durable(server: PostgresServer) -> None:
    """The test cluster runs with fsync off; the benchmark's runs with PostgreSQL's defaults."""
    server.stop()
    options = f"-k {server.socket_dir} -c listen_addresses=''"
    server._run(
        str(server.bin_dir / "pg_ctl"), "-D", str(server.data), "-l", str(server.log_path),
        "-o", options, "-w", "start",
    )  # fmt: skip


@contextlib.asynccontextmanager
async def engines() -> AsyncIterator[tuple[Callable[[], Awaitable[Database]], ...]]:
    folder = Path(tempfile.mkdtemp(prefix="bench-db-"))
    counter = iter(range(1_000_000))

    async def sqlite() -> Database:
        return Database(folder / f"bench{next(counter)}.sqlite3", DEVICE_MIGRATIONS)

    try:
        if not postgres_available():
            yield (sqlite,)
            return
        with running_postgres() as server:
            await asyncio.to_thread(restart_durable, server)

            async def postgres() -> Database:
                url = await asyncio.to_thread(server.new_database)
                return Database(url, DEVICE_MIGRATIONS)

            yield sqlite, postgres
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


async def run(quick: bool) -> str:
    quiet_logging()
    count = DEVICES_QUICK if quick else DEVICES_FULL
    reps = REPS_QUICK if quick else REPS_FULL
    async with engines() as makers:
        sqlite = await repeat(makers[0], count, reps)
        postgres = await repeat(makers[1], count, reps) if len(makers) > 1 else None
    labels = {
        "first": f"first flush: {count:,} new devices, one transaction",
        "changed": f"flush of {count:,} changed device records",
        "storm": f"reconnect storm: {count:,} records in {STORM_BATCHES} flushes",
    }
    rows = []
    for key, label in labels.items():
        pg = postgres[key] if postgres is not None else None
        rows.append([label, seconds(sqlite[key]), seconds(pg), ratio(pg or 0.0, sqlite[key])])
    # The slowest single flush: a storm's total is STORM_BATCHES flushes.
    slowest = max(
        max(r["first"], r["changed"], r["storm"] / STORM_BATCHES)
        for r in (sqlite, *([postgres] if postgres else []))
    )
    met = postgres is not None and slowest < TARGET_S
    note = " — **quick run**" if quick else ""
    missing = "" if postgres is not None else " PostgreSQL is not installed: its column is n/a."
    return f"""## Database writes: SQLite vs PostgreSQL (catalogue, {count:,} devices)

{environment()}{note}.

The real `DeviceCatalog` flush (one transaction of upserts) on a real `Database` of each engine,
median of {reps} run(s), each on a fresh schema. SQLite: the bridge's file (WAL,
synchronous=NORMAL). PostgreSQL: a throwaway local cluster on a Unix socket with `fsync`,
`synchronous_commit` and `full_page_writes` on; psycopg 3 pipelines each `executemany`.{missing}

{table(["flush", "SQLite s", "PostgreSQL s", "PostgreSQL / SQLite"], rows)}

Target: every flush within {TARGET_S:g} s on both engines: {verdict(met)} (slowest single flush
{seconds(slowest)} s).
"""


def main() -> None:
    bench_main(NAME, __doc__ or NAME, run)


if __name__ == "__main__":
    main()
