"""Errors of provisioning; each maps to one HTTP status in `backend.api.errors.ERROR_TABLE`."""

from backend.errors import BridgeError


class ProvisioningError(BridgeError):
    """Base class: the message is one line for an operator."""


class InvalidInput(ProvisioningError):
    """A value an operator gave that cannot be used (HTTP 422)."""


class UnknownActivation(ProvisioningError):
    """No pending activation has this code, or none is pending for this device."""

    def __init__(self, target: str) -> None:
        super().__init__(
            f"no pending activation {target[:80]!r} (see `esp32-bridge devices pending`)"
        )
        self.target = target


class AmbiguousActivation(ProvisioningError):
    """Several pending activations claim one device id (different Client-Ids): a stranger who
    knows the MAC may be one of them, so only the code on the device's screen picks it."""

    def __init__(self, device_id: str, remotes: list[str | None]) -> None:
        addresses = ", ".join(sorted({r or "unknown" for r in remotes}))
        super().__init__(
            f"{len(remotes)} pending activations claim {device_id!r} (different Client-Ids, "
            f"from {addresses}); approve by code: `esp32-bridge devices approve CODE` with the "
            "code the device shows (`esp32-bridge devices pending` lists each candidate)"
        )
        self.device_id = device_id


class NotVerified(ProvisioningError):
    """The device sent a serial number whose key it has not proven (HMAC challenge)."""


class NotProvisioned(ProvisioningError):
    """The device has no credentials (never approved)."""

    def __init__(self, device_id: str) -> None:
        super().__init__(f"device {device_id!r} was never approved")
        self.device_id = device_id


class TooManyPending(ProvisioningError):
    """The cap on pending activations is reached (in all, or for one device id)."""


class UnknownEnrollment(ProvisioningError):
    """No enrollment code has this id."""

    def __init__(self, enrollment_id: str) -> None:
        super().__init__(f"no enrollment code {enrollment_id[:40]!r}")


class UnknownRelease(ProvisioningError):
    """No release is published for this board and version."""

    def __init__(self, board: str, version: str) -> None:
        super().__init__(f"no published firmware {version!r} for board {board!r}")


class InvalidRelease(ProvisioningError):
    """A firmware release that cannot be published (bad version, missing file)."""


class UnknownSerialKey(ProvisioningError):
    """No HMAC key is registered for this serial number."""

    def __init__(self, serial: str) -> None:
        super().__init__(f"no key registered for serial number {serial[:64]!r}")
