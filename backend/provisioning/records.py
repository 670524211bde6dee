"""What provisioning remembers, as records: approved devices, pending activations, enrollment
codes (`backend.provisioning.tables` stores them, `ProvisioningStore` indexes them)."""

from dataclasses import dataclass, field
from typing import Any, Literal

from backend.common import iso_time

Transport = Literal["websocket", "mqtt"]
HmacCheck = Literal["verified", "no_key", "no_hmac", "invalid"]


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
        """Whether the device's credential is usable (approved, not revoked)."""
        return self.status == "approved"

    def to_json(self) -> dict[str, Any]:
        """The device as the API lists it (never its token)."""
        return {
            "device_id": self.device_id,
            "client_id": self.client_id,
            "serial_number": self.serial_number,
            "status": self.status,
            "generation": self.generation,
            "transport": self.transport,
            "approved_at": iso_time(self.approved_at),
            "approved_by": self.approved_by,
            "revoked_at": iso_time(self.revoked_at),
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
        """The request as the API lists it; `serial` says whether the device proved its serial."""
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
            "created_at": iso_time(self.created_at),
            "last_seen": iso_time(self.last_seen),
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
        """Whether the code may approve one more device at `now` (not revoked, uses left, not
        expired)."""
        return (
            self.revoked_at is None
            and self.uses_left > 0
            and (self.expires_at is None or now < self.expires_at)
        )

    def to_json(self) -> dict[str, Any]:
        """The code as the API lists it (never the code itself: only its hash is kept)."""
        return {
            "id": self.id,
            "name": self.name,
            "uses_left": self.uses_left,
            "transport": self.transport,
            "expires_at": iso_time(self.expires_at),
            "created_at": iso_time(self.created_at),
            "revoked_at": iso_time(self.revoked_at),
        }
