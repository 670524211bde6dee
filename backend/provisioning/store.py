"""Who may connect: approved devices, pending activations, enrollment codes, serial keys.

Everything the device path reads is in memory: the handshake check (`refusal`, the
`DeviceCredentials` of `backend.transports.admission`) and the broker login check (`verify`, a
`CredentialProvider` of `backend.transports.mqtt_credentials`) are a dictionary lookup and one
constant-time comparison, never a database round trip. Approvals, revocations, enrollment uses
and serial keys are written before they take effect (an approval the database does not hold
never hands out a token); pending activations are written behind, batched, so a storm of new
devices costs one transaction per flush, and their codes survive a restart.

A pending activation belongs to one (Device-Id, Client-Id) pair: it keeps its code while the
device polls, and one the device stops polling is forgotten after `pending_ttl_s`. Approval
binds the device's credentials to that Client-Id: the OTA endpoint hands the token only to the
same Client-Id (a stranger who knows the MAC address gets an activation code of their own,
which the operator never sees on the real device's screen).

Nobody's requests can block someone else's activation:

- The table is shared out by address: one address holds at most `max_pending // 64` requests,
  one IPv4 /24 or IPv6 /64 at most `max_pending // 16` (addresses in `exempt` networks, loopback
  by default, are not capped); past its share a request is refused (TooManyPending, 503).
  When the whole table is full (many prefixes, or an exempt one), a new request takes the place
  of the least recently seen request of the prefix holding the most.
- A Device-Id is never reserved: it keeps up to `MAX_PENDING_PER_DEVICE` candidates (each with
  its own code, Client-Id and address); one more takes the place of the least recently seen
  candidate of the prefix holding the most of them. The operator approves the candidate whose
  code the device shows; approval by device id is refused while there are several.
"""

import asyncio
import contextlib
import hashlib
import hmac
import json
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import structlog

from backend.common import iso_time
from backend.logs import LogBudget
from backend.provisioning.errors import (
    AmbiguousActivation,
    InvalidInput,
    NotProvisioned,
    NotVerified,
    TooManyPending,
    UnknownActivation,
    UnknownEnrollment,
    UnknownSerialKey,
)
from backend.provisioning.ratelimit import partition_of
from backend.provisioning.tokens import bare_token, derive_token, hmac_sha256_hex, token_hash
from backend.storage import Database, DatabaseError, Migration, WriteBehind
from backend.transports.mqtt_topics import TopicError, device_key
from backend.transports.throttle import ExemptNetworks

log = structlog.get_logger("provisioning")

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
            approved_at REAL NOT NULL,
            approved_by TEXT NOT NULL,
            revoked_at REAL,
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
            created_at REAL NOT NULL,
            last_seen REAL NOT NULL
        );
        CREATE TABLE serial_keys (
            serial_number TEXT PRIMARY KEY,
            hmac_key TEXT NOT NULL,
            created_at REAL NOT NULL
        );
        CREATE TABLE enrollment_codes (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            code_hash TEXT NOT NULL UNIQUE,
            uses_left INTEGER NOT NULL,
            transport TEXT,
            expires_at REAL,
            created_at REAL NOT NULL,
            revoked_at REAL
        );
        """,
    ),
)

MAX_PENDING_PER_DEVICE = 8  # candidates per Device-Id (a new one replaces one)
CODE_DIGITS = 6
ENROLLMENT_PREFIX = "enr-"
Transport = Literal["websocket", "mqtt"]
HmacCheck = Literal["verified", "no_key", "no_hmac", "invalid"]
_NO_TOKEN = hashlib.sha256(b"no device token").digest()


@dataclass(frozen=True, slots=True)
class Provisioned:
    """A device the operator approved (or that was approved by policy), active or revoked."""

    device_id: str
    client_id: str | None
    serial_number: str | None
    status: Literal["approved", "revoked"]
    generation: int
    token_hash: str | None
    transport: Transport | None
    approved_at: float
    approved_by: str
    revoked_at: float | None = None
    revoked_by: str | None = None

    @property
    def active(self) -> bool:
        return self.status == "approved"

    def to_json(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "client_id": self.client_id,
            "serial_number": self.serial_number,
            "status": self.status,
            "generation": self.generation,
            "transport": self.transport,
            "approved_at": _iso(self.approved_at),
            "approved_by": self.approved_by,
            "revoked_at": _iso(self.revoked_at),
            "revoked_by": self.revoked_by,
        }


@dataclass(slots=True)
class PendingActivation:
    """A device waiting for the operator: the code it shows, the challenge it answers."""

    code: str
    device_id: str
    client_id: str
    serial_number: str | None
    challenge: str
    remote: str | None
    info: dict[str, Any]
    created_at: float
    last_seen: float
    hmac_verified: bool = False
    polls: int = field(default=0, compare=False)

    def to_json(self, *, key_registered: bool) -> dict[str, Any]:
        serial = None
        if self.serial_number is not None:
            serial = (
                "verified"
                if self.hmac_verified
                else ("waiting for the device's HMAC" if key_registered else "no key registered")
            )
        return {
            "code": self.code,
            "device_id": self.device_id,
            "client_id": self.client_id,
            "serial_number": self.serial_number,
            "serial_check": serial,
            "remote": self.remote,
            "board": self.info.get("board_type"),
            "firmware": self.info.get("firmware_version"),
            "chip": self.info.get("chip"),
            "created_at": _iso(self.created_at),
            "last_seen": _iso(self.last_seen),
        }


@dataclass(frozen=True, slots=True)
class Enrollment:
    """A code that approves devices by itself, `uses_left` more times, until `expires_at`."""

    id: str
    name: str
    code_hash: str
    uses_left: int
    transport: Transport | None
    expires_at: float | None
    created_at: float
    revoked_at: float | None = None

    def usable(self, now: float) -> bool:
        return (
            self.revoked_at is None
            and self.uses_left > 0
            and (self.expires_at is None or now < self.expires_at)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "uses_left": self.uses_left,
            "transport": self.transport,
            "expires_at": _iso(self.expires_at),
            "created_at": _iso(self.created_at),
            "revoked_at": _iso(self.revoked_at),
        }


class ProvisioningStore:
    """The provisioning tables and their in-memory index; open the database with
    PROVISIONING_MIGRATIONS first."""

    def __init__(
        self,
        database: Database,
        secret: bytes,
        *,
        max_pending: int = 4096,
        pending_ttl_s: float = 86400.0,
        require_hmac: bool = False,
        exempt: Iterable[str] = (),
        flush_interval_s: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = database
        self._secret = secret
        self.max_pending = max_pending
        self.per_address = max(1, max_pending // 64)
        self.per_prefix = max(self.per_address, max_pending // 16)
        self._exempt = ExemptNetworks(exempt)
        # Requests that replace another (a full table, a contested Device-Id) are what a flood
        # looks like: a few are logged, then one count a minute.
        self._churn = LogBudget(log, burst=5, interval_s=60.0)
        self.pending_ttl_s = pending_ttl_s
        self.require_hmac = require_hmac
        self._clock = clock
        self._devices: dict[str, Provisioned] = {}
        self._tokens: dict[str, bytes] = {}  # active device id -> SHA-256 of its token
        self._by_key: dict[str, str] = {}  # broker username (device key) -> device id
        self._pending: dict[str, PendingActivation] = {}  # code -> request
        self._pending_of: dict[tuple[str, str], str] = {}  # (device id, client id) -> code
        self._candidates: dict[str, dict[str, None]] = {}  # device id -> its codes
        self._partition: dict[str, tuple[str, str]] = {}  # code -> (address, prefix)
        self._by_address: dict[str, int] = {}  # address -> pending requests
        self._by_prefix: dict[str, dict[str, None]] = {}  # prefix -> codes, least recent first
        self._serial_keys: dict[str, bytes] = {}
        self._enrollments: dict[str, Enrollment] = {}  # id -> code
        self._enrollment_by_hash: dict[str, str] = {}
        self._dirty: set[str] = set()
        self._dropped: set[str] = set()
        self._writer = WriteBehind(
            self._expire_and_flush, name="provisioning-writer", interval_s=flush_interval_s
        )
        self._lock = asyncio.Lock()

    # ---- lifecycle ----------------------------------------------------------------------------

    async def load(self) -> None:
        def read(c: sqlite3.Connection) -> tuple[list[sqlite3.Row], ...]:
            return (
                c.execute("SELECT * FROM provisioned_devices").fetchall(),
                c.execute("SELECT * FROM activation_requests").fetchall(),
                c.execute("SELECT * FROM serial_keys").fetchall(),
                c.execute("SELECT * FROM enrollment_codes").fetchall(),
            )

        devices, pending, keys, enrollments = await self._db.run(read)
        for row in devices:
            self._index(_provisioned(row))
        now = self._clock()
        for row in sorted(pending, key=lambda r: float(r["last_seen"])):  # oldest first
            request = _pending(row)
            if now - request.last_seen < self.pending_ttl_s:
                self._add_pending(request)
            else:
                self._dropped.add(request.code)
        for row in keys:
            self._serial_keys[row["serial_number"]] = bytes.fromhex(row["hmac_key"])
        for row in enrollments:
            enrollment = _enrollment(row)
            self._enrollments[enrollment.id] = enrollment
            self._enrollment_by_hash[enrollment.code_hash] = enrollment.id
        log.info(
            "provisioning loaded",
            approved=len(self._tokens),
            pending=len(self._pending),
            serial_keys=len(self._serial_keys),
        )

    def start(self) -> None:
        self._writer.start()

    async def stop(self) -> None:
        await self._writer.stop()
        with contextlib.suppress(DatabaseError):
            await self.flush()

    # ---- the device path (memory only) ----------------------------------------------------------

    def refusal(self, device_id: str, presented: str | None) -> str | None:
        """`DeviceCredentials` for `Admission`: only the device's own token lets it in."""
        if not presented:
            return "missing device token"
        digest = hashlib.sha256(bare_token(presented).encode()).digest()
        expected = self._tokens.get(device_id)
        # Compare even when the device has no token, so timing does not tell which ids do.
        if hmac.compare_digest(digest, expected or _NO_TOKEN) and expected is not None:
            return None
        return "invalid device token"

    def verify(self, username: str, password: str) -> bool:
        """`CredentialProvider` for a broker: username = device key, password = its token."""
        device_id = self._by_key.get(username)
        return device_id is not None and self.refusal(device_id, password) is None

    def device(self, device_id: str) -> Provisioned | None:
        return self._devices.get(device_id)

    def devices(self) -> list[Provisioned]:
        return sorted(self._devices.values(), key=lambda d: d.device_id)

    def approved_for(self, device_id: str, client_id: str | None) -> Provisioned | None:
        """The device's active credentials if they are bound to this Client-Id."""
        device = self._devices.get(device_id)
        if device is None or not device.active:
            return None
        if device.client_id is not None and device.client_id != client_id:
            return None
        return device

    def token(self, device: Provisioned) -> str:
        """The device's token (derived again, never stored)."""
        return derive_token(self._secret, device.device_id, device.generation)

    async def deliver(self, device: Provisioned) -> str:
        """The token to hand the device; if the secret changed since approval, the device gets
        a token that works again (its stored hash is replaced)."""
        token = self.token(device)
        digest = token_hash(token)
        if digest != device.token_hash:
            async with self._lock:
                current = self._devices.get(device.device_id)
                if current is not None and current.active and current.token_hash != digest:
                    updated = replace(current, token_hash=digest)
                    await self._write_device(updated)
                    self._index(updated)
                    log.warning(
                        "device token re-issued: the credential secret changed",
                        device_id=device.device_id,
                    )
        return token

    # ---- pending activations ---------------------------------------------------------------------

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def pending(self) -> list[PendingActivation]:
        self._expire()
        return sorted(self._pending.values(), key=lambda p: (p.created_at, p.code))

    def pending_json(self) -> list[dict[str, Any]]:
        """Every pending request; `candidates` counts the requests that claim its Device-Id."""
        return [
            {
                **p.to_json(key_registered=p.serial_number in self._serial_keys),
                "candidates": len(self._candidates.get(p.device_id, ())),
            }
            for p in self.pending()
        ]

    def find_pending(self, device_id: str, client_id: str) -> PendingActivation | None:
        code = self._pending_of.get((device_id, client_id))
        return self._pending.get(code) if code is not None else None

    def candidates(self, device_id: str) -> list[PendingActivation]:
        """The pending requests that claim this Device-Id, oldest first."""
        codes = self._candidates.get(device_id, {})
        return sorted((self._pending[c] for c in codes), key=lambda p: (p.created_at, p.code))

    def request_activation(
        self,
        device_id: str,
        client_id: str,
        *,
        serial_number: str | None,
        remote: str | None,
        info: dict[str, Any],
    ) -> PendingActivation:
        """The pending activation of this (device, client): the same code while it polls, a new
        one the first time. TooManyPending when the address's or prefix's share is used up."""
        now = self._clock()
        existing = self.find_pending(device_id, client_id)
        if existing is not None and now - existing.last_seen < self.pending_ttl_s:
            self.seen(existing)
            existing.remote = remote
            existing.info = info
            existing.polls += 1
            if serial_number is not None and existing.serial_number != serial_number:
                existing.serial_number = serial_number
                existing.hmac_verified = False
            self._mark(existing.code)
            return existing
        if existing is not None:
            self._remove_pending(existing.code)
        address, prefix = partition_of(remote)
        self._check_share(remote, address, prefix)
        replaced = self._make_room_for_candidate(device_id, prefix) or self._make_room(prefix)
        request = PendingActivation(
            code=self._new_code(),
            device_id=device_id,
            client_id=client_id,
            serial_number=serial_number,
            challenge=secrets.token_hex(16),
            remote=remote,
            info=info,
            created_at=now,
            last_seen=now,
        )
        self._add_pending(request)
        self._mark(request.code)
        fields: dict[str, Any] = {
            "device_id": device_id,
            "code": request.code,
            "remote": remote,
            "board": info.get("board_type"),
            "candidates": len(self._candidates.get(device_id, ())),
        }
        if replaced is None:
            log.info("activation requested", **fields)
        else:
            self._churn.info(
                "activation requested in place of another",
                replaced_device_id=replaced.device_id,
                replaced_remote=replaced.remote,
                **fields,
            )
        return request

    def seen(self, request: PendingActivation) -> None:
        """The device behind `request` polled (an OTA check or an activation poll): it is the
        most recently seen of its prefix, the last one a newcomer would replace."""
        request.last_seen = self._clock()
        members = self._by_prefix.get(self._partition.get(request.code, ("", ""))[1])
        if members is not None and request.code in members:
            del members[request.code]
            members[request.code] = None

    def check_hmac(self, request: PendingActivation, body: dict[str, Any]) -> HmacCheck:
        """Check an activation body (§5.3) against the request's challenge and the serial
        number's registered key; a verified request is remembered."""
        answer = body.get("hmac")
        if not isinstance(answer, str):
            return "no_hmac"
        serial = body.get("serial_number")
        serial = serial if isinstance(serial, str) and serial else request.serial_number
        if serial is None or (
            request.serial_number is not None and serial != request.serial_number
        ):
            return "invalid"
        key = self._serial_keys.get(serial)
        if key is None:
            return "no_key"
        challenge = body.get("challenge")
        if not isinstance(challenge, str) or not hmac.compare_digest(
            challenge.encode(), request.challenge.encode()
        ):
            return "invalid"
        expected = hmac_sha256_hex(key, request.challenge)
        if not hmac.compare_digest(expected.encode(), answer.strip().lower().encode()):
            return "invalid"
        if not request.hmac_verified:
            request.hmac_verified = True
            request.serial_number = serial
            self._mark(request.code)
            log.info("activation serial verified", device_id=request.device_id, serial=serial)
        return "verified"

    # ---- operator actions (written before they take effect) --------------------------------------

    async def approve(
        self, target: str, *, by: str, transport: Transport | None = None
    ) -> Provisioned:
        """Approve the pending activation with this code, or the only one of this device id."""
        target = target.strip()
        request = self._pending.get(target)
        if request is None:
            device_id = target.lower() if ":" in target else target
            candidates = [p for p in self.pending() if p.device_id == device_id]
            if not candidates:
                raise UnknownActivation(target)
            if len(candidates) > 1:
                raise AmbiguousActivation(device_id, [p.remote for p in candidates])
            request = candidates[0]
        self._check_verified(request)
        return await self.approve_request(request, by=by, transport=transport)

    async def approve_request(
        self, request: PendingActivation, *, by: str, transport: Transport | None = None
    ) -> Provisioned:
        return await self.grant(
            request.device_id,
            request.client_id,
            serial_number=request.serial_number,
            by=by,
            transport=transport,
        )

    async def grant(
        self,
        device_id: str,
        client_id: str | None,
        *,
        serial_number: str | None = None,
        by: str,
        transport: Transport | None = None,
    ) -> Provisioned:
        """Give the device new credentials bound to `client_id`; its pending requests go."""
        async with self._lock:
            previous = self._devices.get(device_id)
            generation = previous.generation + 1 if previous is not None else 1
            if transport is None and previous is not None:
                transport = previous.transport
            device = Provisioned(
                device_id=device_id,
                client_id=client_id,
                serial_number=serial_number,
                status="approved",
                generation=generation,
                token_hash=token_hash(derive_token(self._secret, device_id, generation)),
                transport=transport,
                approved_at=self._clock(),
                approved_by=by,
            )
            codes = [p.code for p in self._pending.values() if p.device_id == device_id]
            await self._db.run(lambda c: _write_grant(c, device, codes))
            for code in codes:
                self._remove_pending(code)
            self._index(device)
        log.info(
            "device approved",
            device_id=device_id,
            by=by,
            generation=generation,
            transport=transport,
        )
        return device

    async def revoke(self, device_id: str, *, by: str) -> Provisioned:
        """Revoke the device's credentials: its token stops working at once."""
        async with self._lock:
            device = self._devices.get(device_id)
            if device is None:
                raise NotProvisioned(device_id)
            if device.active:
                device = replace(device, status="revoked", revoked_at=self._clock(), revoked_by=by)
                await self._write_device(device)
                self._index(device)
                log.info("device revoked", device_id=device_id, by=by)
        return device

    async def set_transport(self, device_id: str, transport: Transport | None) -> Provisioned:
        async with self._lock:
            device = self._devices.get(device_id)
            if device is None:
                raise NotProvisioned(device_id)
            device = replace(device, transport=transport)
            await self._write_device(device)
            self._index(device)
        return device

    def _check_verified(self, request: PendingActivation) -> None:
        if request.serial_number is None or request.hmac_verified:
            return
        if request.serial_number in self._serial_keys:
            raise NotVerified(
                f"{request.device_id} sent serial number {request.serial_number!r}, whose key is "
                "registered, and has not answered the challenge with it yet"
            )
        if self.require_hmac:
            raise NotVerified(
                f"{request.device_id} sent serial number {request.serial_number!r} and no key "
                "is registered for it (activation_require_hmac)"
            )

    # ---- enrollment codes ------------------------------------------------------------------------

    async def create_enrollment(
        self,
        name: str,
        *,
        uses: int = 1,
        ttl_s: float | None = 3600.0,
        transport: Transport | None = None,
    ) -> tuple[Enrollment, str]:
        """A new enrollment code (shown once; only its hash is kept)."""
        name = " ".join(name.split())[:100] or "enrollment"
        if uses < 1:
            raise InvalidInput("an enrollment code needs at least one use")
        code = ENROLLMENT_PREFIX + secrets.token_urlsafe(15)
        now = self._clock()
        enrollment = Enrollment(
            id=secrets.token_hex(6),
            name=name,
            code_hash=token_hash(code),
            uses_left=uses,
            transport=transport,
            expires_at=now + ttl_s if ttl_s is not None else None,
            created_at=now,
        )
        await self._db.execute(
            "INSERT INTO enrollment_codes (id, name, code_hash, uses_left, transport, expires_at,"
            " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                enrollment.id,
                enrollment.name,
                enrollment.code_hash,
                enrollment.uses_left,
                enrollment.transport,
                enrollment.expires_at,
                enrollment.created_at,
            ),
        )
        self._enrollments[enrollment.id] = enrollment
        self._enrollment_by_hash[enrollment.code_hash] = enrollment.id
        log.info("enrollment code created", enrollment_id=enrollment.id, uses=uses)
        return enrollment, code

    def enrollment(self, code: str) -> Enrollment | None:
        """The usable enrollment with this code, or None."""
        found = self._enrollment_by_hash.get(token_hash(code))
        enrollment = self._enrollments.get(found) if found is not None else None
        if enrollment is None or not enrollment.usable(self._clock()):
            return None
        return enrollment

    async def use_enrollment(self, enrollment: Enrollment) -> bool:
        """Take one use (written first); False when none is left any more."""
        async with self._lock:
            current = self._enrollments.get(enrollment.id)
            if current is None or not current.usable(self._clock()):
                return False
            used = replace(current, uses_left=current.uses_left - 1)
            await self._db.execute(
                "UPDATE enrollment_codes SET uses_left = ? WHERE id = ?", (used.uses_left, used.id)
            )
            self._enrollments[used.id] = used
        return True

    def enrollments(self) -> list[Enrollment]:
        return sorted(self._enrollments.values(), key=lambda e: (e.created_at, e.id))

    async def revoke_enrollment(self, enrollment_id: str) -> Enrollment:
        async with self._lock:
            enrollment = self._enrollments.get(enrollment_id)
            if enrollment is None:
                raise UnknownEnrollment(enrollment_id)
            if enrollment.revoked_at is None:
                enrollment = replace(enrollment, revoked_at=self._clock())
                await self._db.execute(
                    "UPDATE enrollment_codes SET revoked_at = ? WHERE id = ?",
                    (enrollment.revoked_at, enrollment_id),
                )
                self._enrollments[enrollment_id] = enrollment
        return enrollment

    # ---- serial keys (HMAC-SHA256 of the activation challenge, §5.3) ----------------------------

    async def set_serial_key(self, serial_number: str, key: bytes) -> None:
        serial_number = serial_number.strip()
        if not serial_number or len(serial_number) > 64 or not serial_number.isprintable():
            raise InvalidInput("a serial number is 1 to 64 printable characters")
        if not 16 <= len(key) <= 64:
            raise InvalidInput("a serial key is 16 to 64 bytes (32 to 128 hex digits)")
        await self._db.execute(
            "INSERT INTO serial_keys (serial_number, hmac_key, created_at) VALUES (?, ?, ?)"
            " ON CONFLICT (serial_number) DO UPDATE SET hmac_key = excluded.hmac_key,"
            " created_at = excluded.created_at",
            (serial_number, key.hex(), self._clock()),
        )
        self._serial_keys[serial_number] = key
        log.info("serial key registered", serial=serial_number)

    async def remove_serial_key(self, serial_number: str) -> None:
        if serial_number not in self._serial_keys:
            raise UnknownSerialKey(serial_number)
        await self._db.execute("DELETE FROM serial_keys WHERE serial_number = ?", (serial_number,))
        self._serial_keys.pop(serial_number, None)

    def serial_numbers(self) -> list[str]:
        return sorted(self._serial_keys)

    # ---- broker logins ---------------------------------------------------------------------------

    def broker_logins(self) -> list[tuple[str, str]]:
        """(username, password) of every active device that has a device key (MQTT)."""
        logins = []
        for device in self.devices():
            if device.active:
                with contextlib.suppress(TopicError):
                    logins.append((device_key(device.device_id), self.token(device)))
        return logins

    # ---- internals -------------------------------------------------------------------------------

    def _index(self, device: Provisioned) -> None:
        self._devices[device.device_id] = device
        try:
            key: str | None = device_key(device.device_id)
        except TopicError:
            key = None
        if device.active and device.token_hash is not None:
            self._tokens[device.device_id] = bytes.fromhex(device.token_hash)
            if key is not None:
                self._by_key[key] = device.device_id
        else:
            self._tokens.pop(device.device_id, None)
            if key is not None:
                self._by_key.pop(key, None)

    def _new_code(self) -> str:
        while True:
            code = str(secrets.randbelow(10**CODE_DIGITS)).zfill(CODE_DIGITS)
            if code not in self._pending:
                return code

    def _add_pending(self, request: PendingActivation) -> None:
        address, prefix = partition_of(request.remote)
        self._pending[request.code] = request
        self._pending_of[(request.device_id, request.client_id)] = request.code
        self._candidates.setdefault(request.device_id, {})[request.code] = None
        self._partition[request.code] = (address, prefix)
        self._by_address[address] = self._by_address.get(address, 0) + 1
        self._by_prefix.setdefault(prefix, {})[request.code] = None

    def _remove_pending(self, code: str) -> None:
        request = self._pending.pop(code, None)
        if request is None:
            return
        self._pending_of.pop((request.device_id, request.client_id), None)
        _discard(self._candidates, request.device_id, code)
        address, prefix = self._partition.pop(code)
        left = self._by_address.get(address, 1) - 1
        if left > 0:
            self._by_address[address] = left
        else:
            self._by_address.pop(address, None)
        _discard(self._by_prefix, prefix, code)
        self._dirty.discard(code)
        self._dropped.add(code)
        self._writer.wake()

    def _check_share(self, ip: str | None, address: str, prefix: str) -> None:
        """TooManyPending when this address or prefix holds its share of the table already."""
        if ip is not None and ip in self._exempt:
            return
        if self._by_address.get(address, 0) >= self.per_address:
            self._expire()
        if self._by_address.get(address, 0) >= self.per_address:
            raise TooManyPending(
                f"{self.per_address} activations are pending from this address already"
            )
        if len(self._by_prefix.get(prefix, ())) >= self.per_prefix:
            self._expire()
        if len(self._by_prefix.get(prefix, ())) >= self.per_prefix:
            raise TooManyPending(
                f"{self.per_prefix} activations are pending from this network already"
            )

    def _make_room_for_candidate(self, device_id: str, prefix: str) -> PendingActivation | None:
        """A Device-Id with all its candidates taken loses one, never the newcomer: the least
        recently seen of the prefix that holds the most of them (the newcomer counted)."""
        codes = self._candidates.get(device_id, {})
        if len(codes) < MAX_PENDING_PER_DEVICE:
            return None
        groups: dict[str, list[PendingActivation]] = {}
        for code in codes:
            groups.setdefault(self._partition[code][1], []).append(self._pending[code])
        largest = max(len(members) + (key == prefix) for key, members in groups.items())
        crowded = [r for k, m in groups.items() if len(m) + (k == prefix) == largest for r in m]
        evicted = min(crowded, key=lambda r: (r.last_seen, r.created_at, r.code))
        self._remove_pending(evicted.code)
        return evicted

    def _make_room(self, prefix: str) -> PendingActivation | None:
        """A full table loses the least recently seen request of the prefix that holds the most
        (the newcomer counted): a flood from a few networks churns only itself."""
        if len(self._pending) < self.max_pending:
            return None
        self._expire()
        if len(self._pending) < self.max_pending:
            return None
        largest = max(len(m) + (k == prefix) for k, m in self._by_prefix.items())
        heads = [
            self._pending[next(iter(m))]
            for k, m in self._by_prefix.items()
            if m and len(m) + (k == prefix) == largest
        ]
        evicted = min(heads, key=lambda r: (r.last_seen, r.created_at, r.code))
        self._remove_pending(evicted.code)
        return evicted

    def _expire(self) -> None:
        cutoff = self._clock() - self.pending_ttl_s
        for code in [c for c, p in self._pending.items() if p.last_seen < cutoff]:
            self._remove_pending(code)

    def _mark(self, code: str) -> None:
        self._dirty.add(code)
        self._writer.wake()

    async def flush(self) -> None:
        """Write pending activations that changed (one transaction)."""
        dirty, self._dirty = self._dirty, set()
        dropped, self._dropped = self._dropped, set()
        rows = [_pending_row(self._pending[code]) for code in dirty if code in self._pending]
        if not rows and not dropped:
            return
        try:
            await self._db.run(lambda c: _write_pending(c, rows, dropped))
        except DatabaseError as exc:
            log.error("pending activations not written; will retry", error=str(exc))
            self._dirty |= dirty
            self._dropped |= dropped
            raise

    async def _expire_and_flush(self) -> None:
        self._expire()
        await self.flush()

    async def _write_device(self, device: Provisioned) -> None:
        await self._db.run(lambda c: _upsert_device(c, device))


# ---- rows ----------------------------------------------------------------------------------------

_DEVICE_COLUMNS = (
    "device_id, client_id, serial_number, status, generation, token_hash, transport,"
    " approved_at, approved_by, revoked_at, revoked_by"
)


def _upsert_device(c: sqlite3.Connection, device: Provisioned) -> None:
    c.execute(
        f"INSERT OR REPLACE INTO provisioned_devices ({_DEVICE_COLUMNS})"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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


def _write_grant(c: sqlite3.Connection, device: Provisioned, codes: Iterable[str]) -> None:
    _upsert_device(c, device)
    c.executemany("DELETE FROM activation_requests WHERE code = ?", [(code,) for code in codes])


def _write_pending(c: sqlite3.Connection, rows: list[tuple[Any, ...]], dropped: set[str]) -> None:
    if dropped:
        c.executemany("DELETE FROM activation_requests WHERE code = ?", [(d,) for d in dropped])
    c.executemany(
        "INSERT OR REPLACE INTO activation_requests (code, device_id, client_id, serial_number,"
        " challenge, hmac_verified, remote, info, created_at, last_seen)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        rows,
    )


def _pending_row(p: PendingActivation) -> tuple[Any, ...]:
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


def _provisioned(row: sqlite3.Row) -> Provisioned:
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


def _pending(row: sqlite3.Row) -> PendingActivation:
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


def _enrollment(row: sqlite3.Row) -> Enrollment:
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


def _discard(index: dict[str, dict[str, None]], key: str, code: str) -> None:
    members = index.get(key)
    if members is not None:
        members.pop(code, None)
        if not members:
            del index[key]


def _iso(moment: float | None) -> str | None:
    return iso_time(moment)
