"""Who owns what, in the shared database: instances, device leases and MQTT shard leases.

A lease is a row (owner instance, epoch, expiry). A device's lease is taken by the instance its
newest connection reached: a claim always wins and bumps the epoch, so the previous owner learns
(from the fleet event, or at its next renewal) that its link is stale and closes it. An instance
renews all its leases in one statement every few seconds; one that dies stops renewing and its
leases expire. MQTT shard leases are claimed only when free or expired. Times are wall-clock
seconds (`time.time()`), written by the instance that claims or renews.

Every method is one transaction, in SQL both engines run (`?` placeholders, `ON CONFLICT`,
`RETURNING`).
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass

from backend.devices.state import ToolSet
from backend.mcp_session.models import parse_tools
from backend.storage import Connection, Database, Migration, Row

CLUSTER_MIGRATIONS = (
    Migration(
        "cluster",
        1,
        """
        CREATE TABLE cluster_instances (
            instance_id TEXT PRIMARY KEY,
            api_url TEXT,
            started_at {real} NOT NULL,
            heartbeat_at {real} NOT NULL,
            draining INTEGER NOT NULL DEFAULT 0
        );
        CREATE TABLE device_leases (
            device_id TEXT PRIMARY KEY,
            instance_id TEXT NOT NULL,
            epoch INTEGER NOT NULL,
            expires_at {real} NOT NULL,
            transport TEXT NOT NULL
        );
        CREATE INDEX device_leases_by_instance ON device_leases (instance_id);
        CREATE TABLE shard_leases (
            shard INTEGER PRIMARY KEY,
            instance_id TEXT,
            expires_at {real} NOT NULL
        );
        """,
    ),
)

_CLAIM = """
INSERT INTO device_leases (device_id, instance_id, epoch, expires_at, transport)
VALUES (?, ?, 1, ?, ?)
ON CONFLICT (device_id) DO UPDATE SET
    instance_id = excluded.instance_id,
    epoch = device_leases.epoch + 1,
    expires_at = excluded.expires_at,
    transport = excluded.transport
RETURNING epoch
"""


@dataclass(frozen=True, slots=True)
class InstanceRow:
    """One instance as the database knows it."""

    instance_id: str
    api_url: str | None
    started_at: float
    heartbeat_at: float
    draining: bool


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """One device lease."""

    device_id: str
    instance_id: str
    epoch: int
    expires_at: float
    transport: str


@dataclass(frozen=True, slots=True)
class Renewal:
    """What one renewal found: this instance's device leases (id -> epoch), its shards, and
    every instance row (for liveness)."""

    devices: dict[str, int]
    shards: frozenset[int]
    instances: list[InstanceRow]


class LeaseTable:
    """The cluster's tables, for one instance (`instance_id`)."""

    def __init__(self, database: Database, instance_id: str, ttl_s: float) -> None:
        self.database = database
        self.instance_id = instance_id
        self.ttl_s = ttl_s

    async def join(self, api_url: str | None, now: float) -> None:
        """Record this instance as started (a restart keeps its row and clears `draining`)."""

        def work(c: Connection) -> None:
            c.execute(
                "INSERT INTO cluster_instances (instance_id, api_url, started_at, heartbeat_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (instance_id) DO UPDATE SET"
                " api_url = excluded.api_url, started_at = excluded.started_at,"
                " heartbeat_at = excluded.heartbeat_at, draining = 0",
                (self.instance_id, api_url, now, now),
            )

        await self.database.run(work)

    async def set_api_url(self, api_url: str) -> None:
        """Record where this instance's admin API listens (for `cluster status`)."""
        await self.database.execute(
            "UPDATE cluster_instances SET api_url = ? WHERE instance_id = ?",
            (api_url, self.instance_id),
        )

    async def leave(self) -> None:
        """Give up every lease and mark this instance stopped (heartbeat 0)."""

        def work(c: Connection) -> None:
            c.execute("DELETE FROM device_leases WHERE instance_id = ?", (self.instance_id,))
            c.execute(
                "UPDATE shard_leases SET instance_id = NULL, expires_at = 0 WHERE instance_id = ?",
                (self.instance_id,),
            )
            c.execute(
                "UPDATE cluster_instances SET heartbeat_at = 0 WHERE instance_id = ?",
                (self.instance_id,),
            )

        await self.database.run(work)

    async def set_draining(self, draining: bool) -> None:
        """Mark this instance draining (it takes no new devices) or not."""
        await self.database.execute(
            "UPDATE cluster_instances SET draining = ? WHERE instance_id = ?",
            (int(draining), self.instance_id),
        )

    async def claim(self, devices: Iterable[tuple[str, str]], now: float) -> dict[str, int]:
        """Take the leases of these (device id, transport) pairs; their new epochs by id."""
        pairs = list(devices)
        expires = now + self.ttl_s

        def work(c: Connection) -> dict[str, int]:
            epochs: dict[str, int] = {}
            for device_id, transport in pairs:
                row = c.execute(
                    _CLAIM, (device_id, self.instance_id, expires, transport)
                ).fetchone()
                epochs[device_id] = int(row[0])
            return epochs

        return await self.database.run(work) if pairs else {}

    async def release(self, device_id: str, epoch: int) -> None:
        """Give up one device's lease, if it is still this instance's claim."""
        await self.database.execute(
            "DELETE FROM device_leases WHERE device_id = ? AND instance_id = ? AND epoch = ?",
            (device_id, self.instance_id, epoch),
        )

    async def release_all(self) -> None:
        """Give up every device lease of this instance (a drain)."""
        await self.database.execute(
            "DELETE FROM device_leases WHERE instance_id = ?", (self.instance_id,)
        )

    async def renew(
        self,
        now: float,
        shard_count: int,
        shard_target: int | None,
        *,
        held: dict[str, tuple[int, str]] | None = None,
        present: frozenset[str] = frozenset(),
    ) -> Renewal:
        """Heartbeat, extend every lease of this instance, and (with MQTT shards) keep at most
        `shard_target` shards, taking free or expired ones up to it, but never one whose owner
        is `present` (still on the broker: it rides out a database outage). Also removes leases
        that expired long ago (their instance is gone).

        `held` (device id -> (epoch, transport)), after a database outage: the devices this
        instance still serves. Their leases are written back where nobody else took them (a
        long outage lets them expire and be purged), and leases of devices it no longer serves
        (a release that failed meanwhile) are given up."""
        expires = now + self.ttl_s
        me = self.instance_id

        def work(c: Connection) -> Renewal:
            c.execute(
                "UPDATE cluster_instances SET heartbeat_at = ? WHERE instance_id = ?", (now, me)
            )
            if held is not None:
                _reconcile(c, me, held, expires)
            c.execute(
                "UPDATE device_leases SET expires_at = ? WHERE instance_id = ?", (expires, me)
            )
            c.execute("DELETE FROM device_leases WHERE expires_at < ?", (now - 10 * self.ttl_s,))
            owned = {
                str(row[0]): int(row[1])
                for row in c.execute(
                    "SELECT device_id, epoch FROM device_leases WHERE instance_id = ?", (me,)
                )
            }
            shards = (
                _renew_shards(c, me, now, expires, shard_count, shard_target, present)
                if shard_target is not None
                else frozenset()
            )
            instances = [_instance(row) for row in c.execute(_INSTANCES)]
            return Renewal(owned, shards, instances)

        return await self.database.run(work)

    async def instances(self) -> list[InstanceRow]:
        """Every instance row."""
        return [_instance(row) for row in await self.database.fetchall(_INSTANCES)]

    async def leases(self) -> list[LeaseRow]:
        """Every device lease."""
        rows = await self.database.fetchall(
            "SELECT device_id, instance_id, epoch, expires_at, transport FROM device_leases"
            " ORDER BY device_id"
        )
        return [LeaseRow(str(r[0]), str(r[1]), int(r[2]), float(r[3]), str(r[4])) for r in rows]

    async def tool_list(self, digest: str) -> ToolSet | None:
        """A tool list the device catalogue stored (by its digest), or None."""
        row = await self.database.fetchone(
            "SELECT tools FROM tool_lists WHERE digest = ?", (digest,)
        )
        return None if row is None else ToolSet.of(parse_tools(json.loads(row[0])))

    async def shard_owners(self) -> dict[int, tuple[str | None, float]]:
        """Every MQTT shard's owner and expiry."""
        rows = await self.database.fetchall(
            "SELECT shard, instance_id, expires_at FROM shard_leases ORDER BY shard"
        )
        return {int(r[0]): (r[1], float(r[2])) for r in rows}


_INSTANCES = (
    "SELECT instance_id, api_url, started_at, heartbeat_at, draining FROM cluster_instances"
    " ORDER BY instance_id"
)


def _instance(r: Row) -> InstanceRow:
    return InstanceRow(str(r[0]), r[1], float(r[2]), float(r[3]), bool(r[4]))


def _reconcile(c: Connection, me: str, held: dict[str, tuple[int, str]], expires: float) -> None:
    c.executemany(
        "INSERT INTO device_leases (device_id, instance_id, epoch, expires_at, transport)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (device_id) DO NOTHING",
        [
            (device_id, me, epoch, expires, transport)
            for device_id, (epoch, transport) in held.items()
        ],
    )
    ours = [
        str(row[0])
        for row in c.execute("SELECT device_id FROM device_leases WHERE instance_id = ?", (me,))
    ]
    c.executemany(
        "DELETE FROM device_leases WHERE device_id = ? AND instance_id = ?",
        [(device_id, me) for device_id in ours if device_id not in held],
    )


def _renew_shards(
    c: Connection,
    me: str,
    now: float,
    expires: float,
    count: int,
    target: int,
    present: frozenset[str] = frozenset(),
) -> frozenset[int]:
    c.executemany(
        "INSERT INTO shard_leases (shard, instance_id, expires_at) VALUES (?, NULL, 0)"
        " ON CONFLICT (shard) DO NOTHING",
        [(shard,) for shard in range(count)],
    )
    c.execute("UPDATE shard_leases SET expires_at = ? WHERE instance_id = ?", (expires, me))
    mine = sorted(
        int(row[0])
        for row in c.execute("SELECT shard FROM shard_leases WHERE instance_id = ?", (me,))
    )
    for shard in mine[target:]:  # more than a fair share: give the rest back for a newcomer
        c.execute(
            "UPDATE shard_leases SET instance_id = NULL, expires_at = 0"
            " WHERE shard = ? AND instance_id = ?",
            (shard, me),
        )
    mine = mine[:target]
    if len(mine) < target:
        free = [
            int(row[0])
            for row in c.execute(
                "SELECT shard, instance_id FROM shard_leases WHERE shard < ? AND"
                " (instance_id IS NULL OR expires_at < ?) ORDER BY shard",
                (count, now),
            )
            if row[1] is None or row[1] not in present  # expired, but its owner still serves it
        ]
        for shard in free[: target - len(mine)]:
            taken = c.execute(
                "UPDATE shard_leases SET instance_id = ?, expires_at = ?"
                " WHERE shard = ? AND (instance_id IS NULL OR expires_at < ?)",
                (me, expires, shard, now),
            ).rowcount
            if taken:
                mine.append(shard)
    return frozenset(mine)
