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
which the operator never sees on the real device's screen). Nobody's requests can block someone
else's activation (`backend.provisioning.pending` shares the table out); the operator approves
the candidate whose code the device shows, and approval by device id is refused while there
are several.

On a database other bridges share (PostgreSQL, `Database.shared`) the others' writes must be
seen here: the tables are read again every `refresh_s` (PROVISIONING_REFRESH_S, 2 s) by a task
and merged (`refresh`): devices approved, re-approved or revoked elsewhere (a device whose
credential went away or changed is reported to `on_lost`, which closes its link here), serial
keys, enrollment codes, and pending activations (those written elsewhere are added, those
deleted elsewhere dropped unless changed here and not written yet). A token check that misses
reads that device's row in the background (at most once a second per device id, at most
`MAX_READS_IN_FLIGHT` at a time), so the device's next attempt finds a fresh approval before the
next refresh. A new pending activation is written before it is answered, and an OTA check, an
activation poll or an approval that does not find its device or request in memory reads the
database first: whichever instance a device or the operator reaches, it is the same request
with the same code. An operator action reads the device's row before it changes it, and
enrollment uses are counted in the database (`uses_left - 1`), so no instance writes back a stale
record.

The records are `backend.provisioning.records`, their rows and schema
`backend.provisioning.tables`.
"""

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import structlog

from backend.provisioning.errors import (
    AmbiguousActivation,
    InvalidInput,
    NotProvisioned,
    NotVerified,
    UnknownActivation,
    UnknownEnrollment,
    UnknownSerialKey,
)
from backend.provisioning.pending import PendingActivations
from backend.provisioning.records import (
    Enrollment,
    HmacCheck,
    PendingActivation,
    Provisioned,
    Transport,
)
from backend.provisioning.tables import (
    enrollment_from_row,
    pending_from_row,
    pending_row,
    provisioned_from_row,
    upsert_device,
    write_grant,
    write_pending,
)
from backend.provisioning.tokens import bare_token, derive_token, hmac_sha256_hex, token_hash
from backend.storage import Connection, Database, DatabaseError, Row, WriteBehind
from backend.transports.errors import TopicError
from backend.transports.mqtt_topics import device_key

log = structlog.get_logger("provisioning")

ENROLLMENT_PREFIX = "enr-"
PROVISIONING_REFRESH_S = 2.0  # on a shared database: how stale the index may get
READ_THROUGH_S = 1.0  # a missed lookup reads the database at most this often per key
MAX_READS_IN_FLIGHT = 16  # background read-throughs at once (a flood of bad tokens waits)
REVOKED = "device credentials revoked"
REPLACED = "device credentials replaced"
_NO_TOKEN = hashlib.sha256(b"no device token").digest()


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
        shared: bool | None = None,
        refresh_s: float | None = None,
        on_lost: Callable[[str, str], None] = lambda _device_id, _reason: None,
    ) -> None:
        """`shared`: whether other bridges write the database too (default: `database.shared`);
        `refresh_s`: how often it is read again then (default PROVISIONING_REFRESH_S; None when
        not shared); `on_lost(device_id, reason)`: a refresh found the device's credential
        revoked or replaced by another instance."""
        self._db = database
        self.shared = database.shared if shared is None else shared
        self.refresh_s = (
            refresh_s
            if refresh_s is not None
            else (PROVISIONING_REFRESH_S if self.shared else None)
        )
        self._on_lost = on_lost
        self._refresher: asyncio.Task[None] | None = None
        self._reads: set[asyncio.Task[None]] = set()
        self._looked_up: OrderedDict[object, float] = OrderedDict()  # key -> monotonic time
        self._secret = secret
        self.require_hmac = require_hmac
        self._clock = clock
        self._devices: dict[str, Provisioned] = {}
        self._tokens: dict[str, bytes] = {}  # active device id -> SHA-256 of its token
        self._by_key: dict[str, str] = {}  # broker username (device key) -> device id
        self._pending = PendingActivations(
            max_pending=max_pending,
            ttl_s=pending_ttl_s,
            exempt=exempt,
            clock=clock,
            on_changed=self._mark,
            on_removed=self._forget,
        )
        self._serial_keys: dict[str, bytes] = {}
        self._enrollments: dict[str, Enrollment] = {}  # id -> code
        self._enrollment_by_hash: dict[str, str] = {}
        self._dirty: set[str] = set()
        self._dropped: set[str] = set()
        self._writer = WriteBehind(
            self._expire_and_write, name="provisioning-writer", interval_s=flush_interval_s
        )
        self._lock = asyncio.Lock()  # operator actions and refreshes, one at a time
        # Pending rows are written (write-behind) or merged (refresh), never both at once.
        self._pending_lock = asyncio.Lock()

    # ---- lifecycle ----------------------------------------------------------------------------

    async def load(self) -> None:
        """Read devices, pending requests, serial keys and enrollment codes into memory."""
        devices, pending, keys, enrollments = await self._db.run(_read_tables)
        for row in devices:
            self._index(provisioned_from_row(row))
        now = self._clock()
        for row in sorted(pending, key=lambda r: float(r["last_seen"])):  # oldest first
            request = pending_from_row(row)
            if now - request.last_seen < self._pending.ttl_s:
                self._pending.add(request)
            else:
                self._dropped.add(request.code)
        for row in keys:
            self._serial_keys[row["serial_number"]] = bytes.fromhex(row["hmac_key"])
        for row in enrollments:
            self._index_enrollment(enrollment_from_row(row))
        log.info(
            "provisioning loaded",
            approved=len(self._tokens),
            pending=len(self._pending),
            serial_keys=len(self._serial_keys),
        )

    def start(self) -> None:
        """Start the write-behind task (and, on a shared database, the refresh task)."""
        self._writer.start()
        if self.refresh_s is not None and self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(
                self._refresh_forever(self.refresh_s), name="provisioning-refresh"
            )

    async def stop(self) -> None:
        """Stop the tasks and write what is left (a failing database is not raised)."""
        refresher, self._refresher = self._refresher, None
        for task in [*([refresher] if refresher is not None else []), *self._reads]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
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
        self._read_through(device_id)  # approved or re-approved elsewhere: the next try may pass
        return "invalid device token"

    def verify(self, username: str, password: str) -> bool:
        """`CredentialProvider` for a broker: username = device key, password = its token."""
        device_id = self._by_key.get(username)
        return device_id is not None and self.refusal(device_id, password) is None

    def device(self, device_id: str) -> Provisioned | None:
        """The provisioning record of the device, if any."""
        return self._devices.get(device_id)

    def devices(self) -> list[Provisioned]:
        """Every provisioned device, by id."""
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
                current = await self._current(device.device_id)
                if current is not None and current.generation != device.generation:
                    return self.token(current)  # approved again elsewhere meanwhile
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
    def per_address(self) -> int:
        """How many pending activations one address may hold."""
        return self._pending.per_address

    @property
    def per_prefix(self) -> int:
        """How many pending activations one IPv4 /24 or IPv6 /64 may hold."""
        return self._pending.per_prefix

    @property
    def pending_count(self) -> int:
        """How many activations are pending."""
        return len(self._pending)

    def pending(self) -> list[PendingActivation]:
        """Every pending activation, oldest first."""
        return self._pending.all()

    def pending_json(self) -> list[dict[str, Any]]:
        """Every pending request; `candidates` counts the requests that claim its Device-Id."""
        return [
            {
                **p.to_json(key_registered=p.serial_number in self._serial_keys),
                "candidates": self._pending.candidate_count(p.device_id),
            }
            for p in self.pending()
        ]

    async def find_pending(self, device_id: str, client_id: str) -> PendingActivation | None:
        """The pending activation of this (Device-Id, Client-Id), or None; on a shared database
        one another instance wrote is read when it is not in memory."""
        found = self._pending.find(device_id, client_id)
        if found is None and self.shared and self._first_lookup(("pending", device_id, client_id)):
            with _memory_if_unreachable("pending activation"):
                await self._read_pending_of(device_id, client_id)
            found = self._pending.find(device_id, client_id)
        return found

    async def lookup_approved(self, device_id: str, client_id: str | None) -> Provisioned | None:
        """`approved_for`; on a shared database a miss reads the device's row first (approved
        through another instance), at most once a second per device."""
        device = self.approved_for(device_id, client_id)
        if device is None and self.shared and self._first_lookup(device_id):
            with _memory_if_unreachable("device"):
                async with self._lock:
                    await self._current(device_id)
            device = self.approved_for(device_id, client_id)
        return device

    def candidates(self, device_id: str) -> list[PendingActivation]:
        """The pending requests that claim this Device-Id, oldest first."""
        return self._pending.candidates(device_id)

    async def request_activation(
        self,
        device_id: str,
        client_id: str,
        *,
        serial_number: str | None,
        remote: str | None,
        info: dict[str, Any],
    ) -> PendingActivation:
        """The pending activation of this (device, client): the same code while it polls, a new
        one the first time. TooManyPending when the address's or prefix's share is used up.
        On a shared database the one another instance gave is found, and a new one is written
        before it is answered, so the device's next poll finds it on any instance."""
        known = await self.find_pending(device_id, client_id)
        request = self._pending.request(
            device_id, client_id, serial_number=serial_number, remote=remote, info=info
        )
        if self.shared and (known is None or known.code != request.code):
            try:
                await self.flush()  # new requests arriving together share one transaction
            except DatabaseError as exc:
                log.warning("new activation request not written yet", error=str(exc))
        return request

    def seen(self, request: PendingActivation) -> None:
        """The device behind `request` polled: the last of its prefix a newcomer replaces."""
        self._pending.seen(request)

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
        if request is None and self.shared:
            await self.refresh()  # a request another instance answered
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

    async def reject(self, code: str, *, by: str) -> PendingActivation:
        """Forget the pending activation with this code (raises UnknownActivation); a device that
        polls again gets a new code, which needs its own approval."""
        code = code.strip()
        request = self._pending.get(code)
        if request is None and self.shared:
            await self.refresh()  # a request another instance answered
            request = self._pending.get(code)
        if request is None:
            raise UnknownActivation(code)
        self._pending.remove(request.code)
        await self.flush()
        log.info("activation rejected", device_id=request.device_id, code=request.code, by=by)
        return request

    async def approve_request(
        self, request: PendingActivation, *, by: str, transport: Transport | None = None
    ) -> Provisioned:
        """Approve a pending request: grant its device a credential for its Client-Id."""
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
            previous = await self._current(device_id)
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
            codes = [p.code for p in self._pending.candidates(device_id)]
            await self._db.run(lambda c: write_grant(c, device, codes))
            for code in codes:
                self._pending.remove(code)
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
            device = await self._current(device_id)
            if device is None:
                raise NotProvisioned(device_id)
            if device.active:
                device = replace(device, status="revoked", revoked_at=self._clock(), revoked_by=by)
                await self._write_device(device)
                self._index(device)
                log.info("device revoked", device_id=device_id, by=by)
        return device

    async def set_transport(self, device_id: str, transport: Transport | None) -> Provisioned:
        """Set (or clear, None) the transport the device is told to use; raises NotProvisioned."""
        async with self._lock:
            device = await self._current(device_id)
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
        async with self._lock:  # a refresh that read before this insert does not drop it
            await self._db.execute(
                "INSERT INTO enrollment_codes (id, name, code_hash, uses_left, transport,"
                " expires_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
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
            self._index_enrollment(enrollment)
        log.info("enrollment code created", enrollment_id=enrollment.id, uses=uses)
        return enrollment, code

    def enrollment(self, code: str) -> Enrollment | None:
        """The usable enrollment with this code, or None."""
        found = self._enrollment_by_hash.get(token_hash(code))
        enrollment = self._enrollments.get(found) if found is not None else None
        if enrollment is None or not enrollment.usable(self._clock()):
            return None
        return enrollment

    async def lookup_enrollment(self, code: str) -> Enrollment | None:
        """`enrollment`; on a shared database a code not in memory is looked for in the
        database (created on another instance), at most once a second per code."""
        digest = token_hash(code)
        if digest not in self._enrollment_by_hash and self.shared and self._first_lookup(digest):
            with _memory_if_unreachable("enrollment code"):
                await self._read_enrollment(digest)
        return self.enrollment(code)

    async def _read_enrollment(self, digest: str) -> None:
        async with self._lock:
            row = await self._db.fetchone(
                "SELECT * FROM enrollment_codes WHERE code_hash = ?", (digest,)
            )
            if row is not None:
                self._index_enrollment(enrollment_from_row(row))

    async def use_enrollment(self, enrollment: Enrollment) -> bool:
        """Take one use, counted in the database (other instances use the code too); False
        when none is left any more."""
        now = self._clock()

        def take(c: Connection) -> tuple[int, Row | None]:
            taken = c.execute(
                "UPDATE enrollment_codes SET uses_left = uses_left - 1 WHERE id = ?"
                " AND uses_left > 0 AND revoked_at IS NULL"
                " AND (expires_at IS NULL OR expires_at > ?)",
                (enrollment.id, now),
            ).rowcount
            row = c.execute(
                "SELECT * FROM enrollment_codes WHERE id = ?", (enrollment.id,)
            ).fetchone()
            return taken, row

        async with self._lock:
            current = self._enrollments.get(enrollment.id)
            if current is None or not current.usable(now):
                return False
            taken, row = await self._db.run(take)
            if row is not None:
                self._index_enrollment(enrollment_from_row(row))
        return taken == 1

    def enrollments(self) -> list[Enrollment]:
        """Every enrollment code, oldest first."""
        return sorted(self._enrollments.values(), key=lambda e: (e.created_at, e.id))

    async def revoke_enrollment(self, enrollment_id: str) -> Enrollment:
        """Revoke an enrollment code (idempotent); raises UnknownEnrollment."""
        if self.shared:
            await self.refresh()  # a code created on another instance
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
        """Register (or replace) a serial number's HMAC key; raises InvalidInput on a bad serial or
        key size."""
        serial_number = serial_number.strip()
        if not serial_number or len(serial_number) > 64 or not serial_number.isprintable():
            raise InvalidInput("a serial number is 1 to 64 printable characters")
        if not 16 <= len(key) <= 64:
            raise InvalidInput("a serial key is 16 to 64 bytes (32 to 128 hex digits)")
        async with self._lock:
            await self._db.execute(
                "INSERT INTO serial_keys (serial_number, hmac_key, created_at) VALUES (?, ?, ?)"
                " ON CONFLICT (serial_number) DO UPDATE SET hmac_key = excluded.hmac_key,"
                " created_at = excluded.created_at",
                (serial_number, key.hex(), self._clock()),
            )
            self._serial_keys[serial_number] = key
        log.info("serial key registered", serial=serial_number)

    async def remove_serial_key(self, serial_number: str) -> None:
        """Forget a serial number's key; raises UnknownSerialKey."""
        async with self._lock:
            removed = await self._db.execute(
                "DELETE FROM serial_keys WHERE serial_number = ?", (serial_number,)
            )
            known = self._serial_keys.pop(serial_number, None) is not None
        if not removed and not known:
            raise UnknownSerialKey(serial_number)

    def serial_numbers(self) -> list[str]:
        """The serial numbers with a key, sorted (never the keys)."""
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

    # ---- several instances on one database -------------------------------------------------------

    async def sync(self) -> None:
        """On a shared database, read the tables again now (before an operator's decision)."""
        if self.shared:
            await self.refresh()

    async def refresh(self) -> None:
        """Read the tables again and merge what other instances wrote (see the module
        docstring); a device whose credential went away or changed is reported to `on_lost`."""
        async with self._lock, self._pending_lock:
            # Rows become records on the database thread: the event loop only merges.
            tables = await self._db.run(_read_records)
            stored = {device.device_id: device for device in tables.devices}
            for device in tables.devices:
                if self._devices.get(device.device_id) != device:
                    self._apply(device)
            for device_id in [d for d in self._devices if d not in stored]:
                self._apply(None, device_id)
            self._merge_pending(tables.pending)
            self._serial_keys = tables.serial_keys
            self._enrollments, self._enrollment_by_hash = {}, {}
            for enrollment in tables.enrollments:
                self._index_enrollment(enrollment)

    async def _refresh_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(max(every_s, 0.1))
            try:
                await self.refresh()
            except DatabaseError as exc:  # the database is away: keep the index, try again
                log.warning("could not refresh the provisioning index", error=str(exc))

    def _merge_pending(self, stored: list[PendingActivation]) -> None:
        """Add or update the requests other instances wrote; drop those deleted elsewhere
        (approved, expired, replaced) unless changed here and not written yet. Runs under
        `_pending_lock`: no write is in flight, so what is not dirty here is in the database."""
        now = self._clock()
        codes = set()
        for request in stored:
            codes.add(request.code)
            if request.code in self._dropped or now - request.last_seen >= self._pending.ttl_s:
                continue  # removed here (the delete is not written yet), or expired
            if self.approved_for(request.device_id, request.client_id) is not None:
                self._pending.remove(request.code)  # left over from before an approval
                continue
            self._pending.absorb(request)
        for code in self._pending.codes():
            if code not in codes and code not in self._dirty:
                self._pending.remove(code, notify=False)

    async def _read_pending_of(self, device_id: str, client_id: str) -> None:
        """Merge the stored requests of this (Device-Id, Client-Id) (another instance's)."""
        async with self._pending_lock:
            rows = await self._db.fetchall(
                "SELECT * FROM activation_requests WHERE device_id = ? AND client_id = ?",
                (device_id, client_id),
            )
            now = self._clock()
            for row in rows:
                request = pending_from_row(row)
                if (
                    request.code not in self._dropped
                    and now - request.last_seen < self._pending.ttl_s
                ):
                    self._pending.absorb(request)

    async def _current(self, device_id: str) -> Provisioned | None:
        """The device's record, read from a shared database first (another instance may have
        changed it); call under `_lock`."""
        if self.shared:
            row = await self._db.fetchone(
                "SELECT * FROM provisioned_devices WHERE device_id = ?", (device_id,)
            )
            self._apply(provisioned_from_row(row) if row is not None else None, device_id)
        return self._devices.get(device_id)

    def _apply(self, stored: Provisioned | None, device_id: str | None = None) -> None:
        """Index a device's stored record (None: its row is gone); a credential that was usable
        here and is revoked or replaced is reported to `on_lost`."""
        key = stored.device_id if stored is not None else device_id
        assert key is not None
        known = self._devices.get(key)
        if known == stored:
            return
        if stored is not None:
            self._index(stored)
        elif known is not None:
            self._index(replace(known, status="revoked", token_hash=None))
            del self._devices[key]
        if known is None or not known.active:
            return
        if stored is None or not stored.active:
            log.info("device revoked on another instance", device_id=key)
            self._on_lost(key, REVOKED)
        elif stored.token_hash != known.token_hash:
            log.info("device credentials replaced on another instance", device_id=key)
            self._on_lost(key, REPLACED)

    def _first_lookup(self, key: object) -> bool:
        """Whether a database lookup of `key` may run now: at most one per READ_THROUGH_S."""
        now = time.monotonic()
        while self._looked_up:
            oldest, at = next(iter(self._looked_up.items()))
            if now - at < READ_THROUGH_S:
                break
            del self._looked_up[oldest]
        if key in self._looked_up:
            return False
        self._looked_up[key] = now
        return True

    def _read_through(self, device_id: str) -> None:
        """A token check missed: on a shared database read the device's row in the background
        (`refusal` is synchronous), bounded per device and in all."""
        if not self.shared or len(self._reads) >= MAX_READS_IN_FLIGHT:
            return
        if not self._first_lookup(device_id):
            return
        try:
            task = asyncio.get_running_loop().create_task(self._reread(device_id))
        except RuntimeError:  # no event loop (a synchronous caller): the refresh will do
            return
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)

    async def _reread(self, device_id: str) -> None:
        try:
            async with self._lock:
                await self._current(device_id)
        except DatabaseError as exc:
            log.warning("could not read a device's credentials", error=str(exc))

    # ---- internals -------------------------------------------------------------------------------

    def _index_enrollment(self, enrollment: Enrollment) -> None:
        self._enrollments[enrollment.id] = enrollment
        self._enrollment_by_hash[enrollment.code_hash] = enrollment.id

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

    def _mark(self, code: str) -> None:
        self._dirty.add(code)
        self._writer.wake()

    def _forget(self, code: str) -> None:
        self._dirty.discard(code)
        self._dropped.add(code)
        self._writer.wake()

    async def flush(self) -> None:
        """Write pending activations that changed (one transaction), after any write in
        progress."""
        await self._writer.flush()

    async def _write_pending(self) -> None:
        async with self._pending_lock:
            dirty, self._dirty = self._dirty, set()
            dropped, self._dropped = self._dropped, set()
            requests = [self._pending.get(code) for code in dirty]
            rows = [pending_row(request) for request in requests if request is not None]
            if not rows and not dropped:
                return
            try:
                await self._db.run(lambda c: write_pending(c, rows, dropped))
            except DatabaseError as exc:
                log.error("pending activations not written; will retry", error=str(exc))
                self._dirty |= dirty
                self._dropped |= dropped
                raise

    async def _expire_and_write(self) -> None:
        self._pending.expire()
        await self._write_pending()

    async def _write_device(self, device: Provisioned) -> None:
        await self._db.run(lambda c: upsert_device(c, device))


def _read_tables(c: Connection) -> tuple[list[Row], list[Row], list[Row], list[Row]]:
    """Devices, pending requests, serial keys and enrollment codes (one transaction)."""
    return (
        c.execute("SELECT * FROM provisioned_devices").fetchall(),
        c.execute("SELECT * FROM activation_requests").fetchall(),
        c.execute("SELECT * FROM serial_keys").fetchall(),
        c.execute("SELECT * FROM enrollment_codes").fetchall(),
    )


@dataclass(frozen=True, slots=True)
class _Records:
    """The provisioning tables as records."""

    devices: list[Provisioned]
    pending: list[PendingActivation]
    serial_keys: dict[str, bytes]
    enrollments: list[Enrollment]


def _read_records(c: Connection) -> _Records:
    """`_read_tables` turned into records (on the database thread)."""
    devices, pending, keys, enrollments = _read_tables(c)
    return _Records(
        [provisioned_from_row(row) for row in devices],
        [pending_from_row(row) for row in pending],
        {row["serial_number"]: bytes.fromhex(row["hmac_key"]) for row in keys},
        [enrollment_from_row(row) for row in enrollments],
    )


@contextlib.contextmanager
def _memory_if_unreachable(what: str) -> Iterator[None]:
    """A lookup on the device path that cannot reach the database answers from memory."""
    try:
        yield
    except DatabaseError as exc:
        log.warning(f"could not look up a {what}; answering from memory", error=str(exc))
