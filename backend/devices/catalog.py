"""The persistent device catalogue: every device ever seen, with its last tool list.

The registry owns device state; the catalogue follows its events and keeps the database (SQLite or
PostgreSQL) in step, so devices are still listed (offline, with cached tools) after they disconnect
and after a restart. Writes never happen on the device path: an event only marks a device dirty,
and a writer task flushes all dirty devices in one transaction at most every `flush_interval_s`. A
device row is written only when something worth keeping changed (new device, identity, server info,
tool list, going offline), and a tool list only when its digest is new, so a reconnect storm of a
thousand devices costs at most a thousand row writes, batched. Every `heartbeat_s` the devices
online at that moment have their `last_seen` refreshed in the next batched flush (one write per
device, folded into its row write when it has one anyway), so after a crash a device that was
online is shown as last seen at most one heartbeat before the crash, not when it connected. Stored
`last_seen` never moves backwards.
"""

import json
import time
from collections.abc import Iterable
from typing import Any

import structlog

from backend.devices.registry import DeviceRegistry
from backend.devices.state import DeviceEvent, DeviceRecord, EventKind, ToolSet
from backend.mcp_session.models import parse_tools
from backend.storage import Connection, Database, DatabaseError, Migration, Row, WriteBehind

log = structlog.get_logger("devices.catalog")

DEVICE_MIGRATIONS = (
    Migration(
        "devices",
        1,
        """
        CREATE TABLE tool_lists (
            digest TEXT PRIMARY KEY,
            tools TEXT NOT NULL,
            created_at {real} NOT NULL
        );
        CREATE TABLE devices (
            device_id TEXT PRIMARY KEY,
            client_id TEXT,
            transport TEXT NOT NULL,
            board TEXT,
            firmware TEXT,
            server_info TEXT,
            tools_digest TEXT REFERENCES tool_lists (digest),
            tool_count INTEGER NOT NULL DEFAULT 0,
            tools_read_at {real},
            first_seen {real} NOT NULL,
            last_seen {real} NOT NULL
        );
        """,
    ),
    # What a device reports at its OTA check: board, chip, firmware, network, system info.
    Migration(
        "devices",
        2,
        """
        ALTER TABLE devices ADD COLUMN ota TEXT;
        ALTER TABLE devices ADD COLUMN ota_at {real};
        """,
    ),
    # What an admin wrote about a device: a display name and notes (PUT /api/devices/{id}/notes).
    Migration(
        "devices",
        3,
        """
        ALTER TABLE devices ADD COLUMN name TEXT;
        ALTER TABLE devices ADD COLUMN notes TEXT;
        """,
    ),
)

_UPSERT = """
INSERT INTO devices (device_id, client_id, transport, board, firmware, server_info,
                     tools_digest, tool_count, tools_read_at, first_seen, last_seen, ota, ota_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (device_id) DO UPDATE SET
    client_id = excluded.client_id, transport = excluded.transport, board = excluded.board,
    firmware = excluded.firmware, server_info = excluded.server_info,
    tools_digest = excluded.tools_digest, tool_count = excluded.tool_count,
    tools_read_at = excluded.tools_read_at,
    last_seen = CASE WHEN excluded.last_seen > devices.last_seen
                     THEN excluded.last_seen ELSE devices.last_seen END,
    ota = excluded.ota, ota_at = excluded.ota_at
"""
# A heartbeat's `last_seen` for a live device whose row needs no other change.
_TOUCH = "UPDATE devices SET last_seen = ? WHERE device_id = ? AND last_seen < ?"
# An admin's name and notes: written apart from _UPSERT, so the instance a device is connected
# to (which writes its rows) never overwrites them with a copy older than the edit.
_ANNOTATE = "UPDATE devices SET name = ?, notes = ? WHERE device_id = ?"
_DROP_ORPHAN_TOOL_LISTS = """
DELETE FROM tool_lists WHERE digest NOT IN
    (SELECT tools_digest FROM devices WHERE tools_digest IS NOT NULL)
"""


class DeviceCatalog:
    """Keeps the `devices` tables in step with the registry, off the device path."""

    def __init__(
        self,
        database: Database,
        registry: DeviceRegistry,
        *,
        flush_interval_s: float = 0.5,
        heartbeat_s: float = 300.0,
    ) -> None:
        self._database = database
        self._registry = registry
        self._persisted: dict[str, DeviceRecord] = {}
        self._stored_digests: set[str] = set()
        self._dirty: set[str] = set()
        self._forgotten: set[str] = set()
        self._annotated: set[str] = set()
        # Live devices' last_seen from the latest heartbeat, not written yet (device id -> time).
        self._seen: dict[str, float] = {}
        self._writer = WriteBehind(
            self._write_pending,
            name="device-catalog",
            interval_s=flush_interval_s,
            heartbeat_s=heartbeat_s,
            on_heartbeat=self._mark_live_devices,
            depth=lambda: (
                len(self._dirty) + len(self._forgotten) + len(self._seen) + len(self._annotated)
            ),
        )
        self._unsubscribe: Any = None
        self.rows_written = 0  # device rows written since start (the tests count them)
        self.flushes = 0

    async def load(self) -> int:
        """Give the registry every device stored; returns how many."""
        devices, tool_lists = await self._database.run(_read_all)
        tool_sets = {
            digest: ToolSet.of(parse_tools(json.loads(text))) for digest, text in tool_lists
        }
        records = [_record(row, tool_sets) for row in devices]
        self._registry.load(records)
        self._persisted = {record.device_id: record for record in records}
        self._stored_digests = set(tool_sets)
        log.info("device catalogue loaded", devices=len(records))
        return len(records)

    def start(self) -> None:
        """Follow registry events and start the periodic writer."""
        self._unsubscribe = self._registry.subscribe(self._on_event)
        self._writer.start()

    async def stop(self) -> None:
        """Stop following events, then write what is still pending."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        await self._writer.stop()
        await self.flush()

    async def flush(self) -> None:
        """Write every pending change now (one transaction), after any write in progress."""
        await self._writer.flush()

    async def _write_pending(self) -> None:
        dirty, self._dirty = self._dirty, set()
        forgotten, self._forgotten = self._forgotten, set()
        seen, self._seen = self._seen, {}
        annotated, self._annotated = self._annotated, set()
        records = [r for r in map(self._registry.record, sorted(dirty)) if r is not None]
        notes = [
            (record.name, record.notes, record.device_id)
            for record in map(self._registry.record, sorted(annotated))
            if record is not None
        ]
        new_tool_sets = {
            record.tools.digest: record.tools
            for record in records
            if record.tools.digest and record.tools.digest not in self._stored_digests
        }
        # A device written anyway carries its heartbeat in its row: one write per device.
        rows = [_row(record, seen.get(record.device_id, record.last_seen)) for record in records]
        written = {record.device_id for record in records}
        touched = [(at, i, at) for i, at in sorted(seen.items()) if i not in written]
        if not rows and not touched and not forgotten and not notes:
            return
        try:
            stored = await self._database.run(
                lambda c: _write(c, rows, touched, new_tool_sets, forgotten, notes)
            )
        except DatabaseError as exc:
            log.error("device catalogue write failed; will retry", error=str(exc))
            self._dirty |= dirty
            self._forgotten |= forgotten
            self._annotated |= annotated - self._forgotten
            for device_id, at in seen.items():
                if device_id not in self._forgotten:
                    self._seen[device_id] = max(at, self._seen.get(device_id, at))
            raise
        for record in records:
            self._persisted[record.device_id] = record
        for device_id in forgotten:
            self._persisted.pop(device_id, None)
        self._stored_digests = stored
        self.rows_written += len(rows) + len(touched)
        self.flushes += 1

    # ---- events (on the device path: memory only) ---------------------------------------------

    def _on_event(self, event: DeviceEvent) -> None:
        if event.origin is not None:
            return  # another instance's device: that instance stores it
        kind = event.kind
        if kind is EventKind.TOOL_CALLED or kind is EventKind.VOICE_TURN:
            return  # every tool call: nothing to store, return at once
        if kind is EventKind.FORGOTTEN:
            self._dirty.discard(event.device_id)
            self._seen.pop(event.device_id, None)
            self._annotated.discard(event.device_id)
            self._forgotten.add(event.device_id)
        elif kind is EventKind.ANNOTATED:
            self._annotated.add(event.device_id)
            if event.device_id not in self._persisted:  # its row first: the notes update it
                self._dirty.add(event.device_id)
        elif kind is EventKind.DISCONNECTED or self._changed(event.device_id):
            self._forgotten.discard(event.device_id)
            self._dirty.add(event.device_id)
        else:
            return
        self._writer.wake()

    def _changed(self, device_id: str) -> bool:
        """Whether the registry knows something about the device that is not stored yet."""
        record = self._registry.record(device_id)
        stored = self._persisted.get(device_id)
        if record is None or record is stored:
            return False
        if stored is None:
            return True
        return (
            record.client_id != stored.client_id
            or record.transport != stored.transport
            or record.server_info != stored.server_info
            or record.tools is not stored.tools
            or record.ota != stored.ota
        )

    def _mark_live_devices(self) -> None:
        """On each heartbeat: every device online now was seen now. The next flush writes that
        `last_seen` (one batched transaction), so a crash loses at most one heartbeat of it.

        Memory only, on the event loop; the registry's own records keep their connect time (the
        API shows a live device as live, not by `last_seen`)."""
        now = time.time()
        for device in self._registry:
            self._seen[device.device_id] = now


def _read_all(
    connection: Connection,
) -> tuple[list[Row], list[tuple[str, str]]]:
    devices = connection.execute("SELECT * FROM devices").fetchall()
    tool_lists = [
        (row["digest"], row["tools"]) for row in connection.execute("SELECT * FROM tool_lists")
    ]
    return devices, tool_lists


def _record(row: Row, tool_sets: dict[str, ToolSet]) -> DeviceRecord:
    server_info = json.loads(row["server_info"]) if row["server_info"] else None
    ota = json.loads(row["ota"]) if row["ota"] else None
    digest = row["tools_digest"]
    return DeviceRecord(
        device_id=row["device_id"],
        client_id=row["client_id"],
        transport=row["transport"],
        first_seen=row["first_seen"],
        last_seen=row["last_seen"],
        server_info=server_info if isinstance(server_info, dict) else None,
        tools=tool_sets[digest] if digest in tool_sets else ToolSet.of(()),
        tools_read_at=row["tools_read_at"],
        ota=ota if isinstance(ota, dict) else None,
        ota_at=row["ota_at"],
        name=row["name"],
        notes=row["notes"],
    )


def _write(
    connection: Connection,
    rows: Iterable[tuple[Any, ...]],
    touched: Iterable[tuple[float, str, float]],
    tool_sets: dict[str, ToolSet],
    forgotten: set[str],
    notes: Iterable[tuple[str | None, str | None, str]] = (),
) -> set[str]:
    """Write one batch: whole rows, heartbeat-only `last_seen` updates, names and notes,
    deletions; returns the digests of the tool lists stored afterwards."""
    now = time.time()
    connection.executemany(
        "INSERT INTO tool_lists (digest, tools, created_at) VALUES (?, ?, ?)"
        " ON CONFLICT (digest) DO NOTHING",
        [
            (digest, json.dumps(tools.to_wire(), ensure_ascii=False, separators=(",", ":")), now)
            for digest, tools in tool_sets.items()
        ],
    )
    connection.executemany(_UPSERT, rows)
    connection.executemany(_TOUCH, touched)
    connection.executemany(_ANNOTATE, notes)
    if forgotten:
        connection.executemany(
            "DELETE FROM devices WHERE device_id = ?", [(device_id,) for device_id in forgotten]
        )
    connection.execute(_DROP_ORPHAN_TOOL_LISTS)
    return {row[0] for row in connection.execute("SELECT digest FROM tool_lists")}


def _row(record: DeviceRecord, last_seen: float) -> tuple[Any, ...]:
    """The _UPSERT parameters for `record`, with `last_seen` (its own or a later heartbeat)."""
    server_info = (
        json.dumps(dict(record.server_info), ensure_ascii=False, separators=(",", ":"))
        if record.server_info is not None
        else None
    )
    return (
        record.device_id,
        record.client_id,
        record.transport,
        record.board,
        record.firmware,
        server_info,
        record.tools.digest or None,
        len(record.tools),
        record.tools_read_at,
        record.first_seen,
        max(record.last_seen, last_seen),
        json.dumps(dict(record.ota), ensure_ascii=False, separators=(",", ":"))
        if record.ota is not None
        else None,
        record.ota_at,
    )
