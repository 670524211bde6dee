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

The records are `backend.provisioning.records`, their rows and schema
`backend.provisioning.tables`.
"""

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
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
from backend.transports.mqtt_topics import TopicError, device_key

log = structlog.get_logger("provisioning")

ENROLLMENT_PREFIX = "enr-"
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
    ) -> None:
        self._db = database
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
        self._lock = asyncio.Lock()

    # ---- lifecycle ----------------------------------------------------------------------------

    async def load(self) -> None:
        """Read devices, pending requests, serial keys and enrollment codes into memory."""

        def read(c: Connection) -> tuple[list[Row], ...]:
            return (
                c.execute("SELECT * FROM provisioned_devices").fetchall(),
                c.execute("SELECT * FROM activation_requests").fetchall(),
                c.execute("SELECT * FROM serial_keys").fetchall(),
                c.execute("SELECT * FROM enrollment_codes").fetchall(),
            )

        devices, pending, keys, enrollments = await self._db.run(read)
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
            enrollment = enrollment_from_row(row)
            self._enrollments[enrollment.id] = enrollment
            self._enrollment_by_hash[enrollment.code_hash] = enrollment.id
        log.info(
            "provisioning loaded",
            approved=len(self._tokens),
            pending=len(self._pending),
            serial_keys=len(self._serial_keys),
        )

    def start(self) -> None:
        """Start the write-behind task."""
        self._writer.start()

    async def stop(self) -> None:
        """Stop the write-behind task and write what is left (a failing database is not raised)."""
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

    def find_pending(self, device_id: str, client_id: str) -> PendingActivation | None:
        """The pending activation of this (Device-Id, Client-Id), or None."""
        return self._pending.find(device_id, client_id)

    def candidates(self, device_id: str) -> list[PendingActivation]:
        """The pending requests that claim this Device-Id, oldest first."""
        return self._pending.candidates(device_id)

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
        return self._pending.request(
            device_id, client_id, serial_number=serial_number, remote=remote, info=info
        )

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
        """Set (or clear, None) the transport the device is told to use; raises NotProvisioned."""
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
        """Every enrollment code, oldest first."""
        return sorted(self._enrollments.values(), key=lambda e: (e.created_at, e.id))

    async def revoke_enrollment(self, enrollment_id: str) -> Enrollment:
        """Revoke an enrollment code (idempotent); raises UnknownEnrollment."""
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
        if serial_number not in self._serial_keys:
            raise UnknownSerialKey(serial_number)
        await self._db.execute("DELETE FROM serial_keys WHERE serial_number = ?", (serial_number,))
        self._serial_keys.pop(serial_number, None)

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
