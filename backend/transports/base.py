"""The seam between a transport and the transport-agnostic device session."""

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """Who is on the other end, as announced during the transport handshake."""

    device_id: str
    client_id: str | None
    protocol_version: int
    remote: str | None = None


class LinkClosed(ConnectionError):
    """Sending on a link that is already closed."""


class DeviceLink(Protocol):
    """One live connection to one device, as the session sees it."""

    transport: str
    identity: DeviceIdentity

    async def send_text(self, text: str) -> None: ...

    async def send_binary(self, data: bytes) -> None: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...
