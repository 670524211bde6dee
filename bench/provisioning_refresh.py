"""What the provisioning store's refresh costs on a shared PostgreSQL (docs/provisioning.md,
"Several instances"): each instance reads the four provisioning tables every 2 s and merges them.

Fills one database with `--devices` approved devices and `--pending` pending activations through
store `a`, then times `refresh()` of store `b` holding the same state (the steady case: nothing
changed), and one after `--changed` devices were revoked on `a`. PostgreSQL runs as the tests'
throwaway cluster (testkit/postgres.py) on a Unix socket of this machine.

    .venv/bin/python -m bench.provisioning_refresh [--devices 10000] [--pending 4096]
"""

import argparse
import asyncio
import statistics
import time

from backend.provisioning.records import PendingActivation, Provisioned
from backend.provisioning.store import ProvisioningStore
from backend.provisioning.tables import PROVISIONING_MIGRATIONS, pending_row, upsert_device
from backend.provisioning.tokens import derive_token, token_hash
from backend.storage import Connection, Database
from testkit.postgres import postgres_available, running_postgres

SECRET = b"bench secret"


def _device_id(index: int) -> str:
    return "02:00:" + ":".join(f"{byte:02x}" for byte in index.to_bytes(4, "big"))


def _fill(c: Connection, devices: int, pending: int) -> None:
    now = time.time()
    for i in range(devices):
        device_id = _device_id(i)
        upsert_device(
            c,
            Provisioned(
                device_id, f"client-{i}", None, "approved", 1,
                token_hash(derive_token(SECRET, device_id, 1)), None, now, "bench",
            ),
        )  # fmt: skip
    rows = [
        pending_row(
            PendingActivation(
                f"{i:06d}",
                _device_id(devices + i),
                f"client-{i}",
                None,
                "c" * 32,
                f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}",
                {},
                now,
                now,
            )
        )
        for i in range(pending)
    ]
    c.executemany(
        "INSERT INTO activation_requests (code, device_id, client_id, serial_number, challenge,"
        " hmac_verified, remote, info, created_at, last_seen)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        rows,
    )


async def _timed(store: ProvisioningStore, reps: int) -> tuple[list[float], float]:
    """Each refresh's time, and the longest the event loop went without a turn meanwhile."""
    stalls: list[float] = []

    async def probe() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stalls.append(now - last)
            last = now

    prober = asyncio.create_task(probe())
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        await store.refresh()
        times.append(time.perf_counter() - began)
    prober.cancel()
    return times, max(stalls, default=0.0)


async def main(devices: int, pending: int, changed: int, reps: int) -> None:
    """Print the refresh times (median and worst, milliseconds)."""
    if not postgres_available():
        raise SystemExit("PostgreSQL is not installed (scripts/test installs it)")
    with running_postgres() as server:
        url = server.new_database()
        dbs = [Database(url, PROVISIONING_MIGRATIONS) for _ in range(2)]
        for db in dbs:
            await db.open()
        await dbs[0].run(lambda c: _fill(c, devices, pending))
        a, b = (ProvisioningStore(db, SECRET, max_pending=pending * 2) for db in dbs)
        for store in (a, b):
            await store.load()
        steady, stall = await _timed(b, reps)
        for i in range(changed):
            await a.revoke(_device_id(i), by="bench")
        after_change, _stall = await _timed(b, 1)
        print(f"{devices} devices, {pending} pending, PostgreSQL on a local Unix socket")
        print(
            f"refresh, nothing changed: median {statistics.median(steady) * 1000:.1f} ms,"
            f" worst {max(steady) * 1000:.1f} ms ({reps} runs);"
            f" longest event-loop stall {stall * 1000:.1f} ms"
        )
        print(f"refresh after {changed} revocations elsewhere: {after_change[0] * 1000:.1f} ms")
        for db in dbs:
            await db.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--pending", type=int, default=4096)
    parser.add_argument("--changed", type=int, default=100)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.devices, args.pending, args.changed, args.reps))
