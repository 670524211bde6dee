"""The provisioning tables in the bridge database: their schema (`PROVISIONING_MIGRATIONS`) and
the rows of the records, written and read on the database's thread."""

import json
from collections.abc import Iterable
from typing import Any

from backend.provisioning.records import Enrollment, PendingActivation, Provisioned
from backend.storage import Connection, Migration, Row

PROVISIONING_MIGRATIONS = (
    Migration(
        "provisioning",
        1,
        """
        CREATE TABLE provisioned_devices (
            device_id TEXT PRIMARY KEY,
            client_id TEXT,
            serial_number TEXT,
            status TEXT NOT NULL CHECK (status IN ('approved', 'revoked')),
            generation INTEGER NOT NULL,
            token_hash TEXT,
            transport TEXT,
            approved_at {real} NOT NULL,
            approved_by TEXT NOT NULL,
            revoked_at {real},
            revoked_by TEXT
        );
        CREATE TABLE activation_requests (
            code TEXT PRIMARY KEY,
            device_id TEXT NOT NULL,
            client_id TEXT NOT NULL,
            serial_number TEXT,
            challenge TEXT NOT NULL,
            hmac_verified INTEGER NOT NULL DEFAULT 0,
            remote TEXT,
            info TEXT,
            created_at {real} NOT NULL,
            last_seen {real} NOT NULL
        );
        CREATE TABLE serial_keys (
            serial_number TEXT PRIMARY KEY,
            hmac_key TEXT NOT NULL,
            created_at {real} NOT NULL
        );
        CREATE TABLE enrollment_codes (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            code_hash TEXT NOT NULL UNIQUE,
            uses_left INTEGER NOT NULL,
            transport TEXT,
            expires_at {real},
            created_at {real} NOT NULL,
            revoked_at {real}
        );
        """,
    ),
)

_DEVICE_COLUMNS = (
    "device_id, client_id, serial_number, status, generation, token_hash, transport,"
    " approved_at, approved_by, revoked_at, revoked_by"
)


def _upsert(table: str, columns: str, key: str) -> str:
    """`INSERT ... ON CONFLICT (key) DO UPDATE` of every other column: the portable form of
    sqlite's `INSERT OR REPLACE` (nothing references these rows, so replacing and updating a
    row are the same)."""
    names = [name.strip() for name in columns.split(",")]
    updates = ", ".join(f"{name} = excluded.{name}" for name in names if name != key)
    marks = ", ".join("?" for _ in names)
    return (
        f"INSERT INTO {table} ({columns}) VALUES ({marks})"
        f" ON CONFLICT ({key}) DO UPDATE SET {updates}"
    )


_UPSERT_DEVICE = _upsert("provisioned_devices", _DEVICE_COLUMNS, "device_id")
_UPSERT_PENDING = _upsert(
    "activation_requests",
    "code, device_id, client_id, serial_number, challenge, hmac_verified, remote, info,"
    " created_at, last_seen",
    "code",
)


def upsert_device(c: Connection, device: Provisioned) -> None:
    """Write a device's row, replacing the one it had."""
    c.execute(
        _UPSERT_DEVICE,
        (
            device.device_id,
            device.client_id,
            device.serial_number,
            device.status,
            device.generation,
            device.token_hash,
            device.transport,
            device.approved_at,
            device.approved_by,
            device.revoked_at,
            device.revoked_by,
        ),
    )


def write_grant(c: Connection, device: Provisioned, codes: Iterable[str]) -> None:
    """An approval in one transaction: the device's row, and its pending requests gone (also
    those another instance answered)."""
    upsert_device(c, device)
    c.executemany("DELETE FROM activation_requests WHERE code = ?", [(code,) for code in codes])
    c.execute("DELETE FROM activation_requests WHERE device_id = ?", (device.device_id,))


def write_pending(c: Connection, rows: list[tuple[Any, ...]], dropped: set[str]) -> None:
    """The pending activations that changed (`rows`) and those that went (`dropped` codes)."""
    if dropped:
        c.executemany("DELETE FROM activation_requests WHERE code = ?", [(d,) for d in dropped])
    c.executemany(_UPSERT_PENDING, rows)


def pending_row(p: PendingActivation) -> tuple[Any, ...]:
    """The `activation_requests` row of a pending activation, as `write_pending` takes it."""
    return (
        p.code,
        p.device_id,
        p.client_id,
        p.serial_number,
        p.challenge,
        int(p.hmac_verified),
        p.remote,
        json.dumps(p.info, separators=(",", ":")),
        p.created_at,
        p.last_seen,
    )


def provisioned_from_row(row: Row) -> Provisioned:
    """A `provisioned_devices` row as its record."""
    return Provisioned(
        device_id=row["device_id"],
        client_id=row["client_id"],
        serial_number=row["serial_number"],
        status=row["status"],
        generation=row["generation"],
        token_hash=row["token_hash"],
        transport=row["transport"],
        approved_at=row["approved_at"],
        approved_by=row["approved_by"],
        revoked_at=row["revoked_at"],
        revoked_by=row["revoked_by"],
    )


def pending_from_row(row: Row) -> PendingActivation:
    """An `activation_requests` row as its record (an `info` that is not an object reads as {})."""
    info = json.loads(row["info"]) if row["info"] else {}
    return PendingActivation(
        code=row["code"],
        device_id=row["device_id"],
        client_id=row["client_id"],
        serial_number=row["serial_number"],
        challenge=row["challenge"],
        remote=row["remote"],
        info=info if isinstance(info, dict) else {},
        created_at=row["created_at"],
        last_seen=row["last_seen"],
        hmac_verified=bool(row["hmac_verified"]),
    )


def enrollment_from_row(row: Row) -> Enrollment:
    """An `enrollment_codes` row as its record."""
    return Enrollment(
        id=row["id"],
        name=row["name"],
        code_hash=row["code_hash"],
        uses_left=row["uses_left"],
        transport=row["transport"],
        expires_at=row["expires_at"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
    )
