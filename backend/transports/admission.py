"""Who may connect: one place that turns a handshake's fields into a `DeviceIdentity` or a refusal.

Every transport collects the same fields (a credential, Device-Id, Client-Id, Protocol-Version)
from wherever its handshake carries them (HTTP headers and query on WebSocket, CONNECT fields
and topics on MQTT) and asks `Admission.admit`. The checks live here once: the credential,
Device-Id syntax, MAC normalisation (stock firmware sends lower case; some clients do not) and the
binary protocol version.
"""

import re
from dataclasses import dataclass
from typing import Protocol

from backend.auth import token_matches
from backend.metrics import record_handshake_refused
from backend.transports.base import DeviceIdentity
from backend.transports.errors import HandshakeRefused

_DEVICE_ID = re.compile(r"^[A-Za-z0-9:_.\-]{1,64}$")
SUPPORTED_PROTOCOL_VERSIONS = ("1", "2", "3")


@dataclass(frozen=True, slots=True)
class HandshakeRequest:
    """The identity fields of one handshake, as the transport found them (None when absent)."""

    transport: str
    credential: str | None = None
    device_id: str | None = None
    client_id: str | None = None
    protocol_version: str | None = None
    remote: str | None = None


class DeviceCredentials(Protocol):
    """Decides whether `presented` lets `device_id` in; returns a refusal reason or None."""

    def refusal(self, device_id: str, presented: str | None) -> str | None:
        """Why this device's presented credential is refused, or None to admit it."""


class SharedDeviceToken:
    """Every device presents the same token (`Bearer <token>` or the raw token)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def refusal(self, device_id: str, presented: str | None) -> str | None:
        """Admit only the shared device token (compared in constant time)."""
        if token_matches(presented, self._token):
            return None
        return "missing device token" if not presented else "invalid device token"


class HandshakeLimits(Protocol):
    """Rate limits for handshakes: a refusal reason (answered 429) or None."""

    def ip_refusal(self, remote: str | None) -> str | None:
        """Why a handshake from this address is refused now, or None."""

    def device_refusal(self, device_id: str) -> str | None:
        """Why a handshake for this device id is refused now, or None."""

    def penalize(self, device_id: str) -> None:
        """`device_id` was cut off for breaking a bound: hold its next handshake off."""


class NoDeviceAuth:
    """Device auth switched off (`device_auth = false`): anyone with a valid Device-Id."""

    def refusal(self, device_id: str, presented: str | None) -> str | None:
        """Admit every device (device auth switched off)."""
        return None


class Admission:
    """Checks handshakes for every transport with the same rules."""

    def __init__(
        self, credentials: DeviceCredentials, limits: HandshakeLimits | None = None
    ) -> None:
        self.credentials = credentials
        self.limits = limits

    def admit(self, request: HandshakeRequest) -> DeviceIdentity:
        """The device's identity, or HandshakeRefused (429 too many handshakes from that
        address, 400 malformed fields, 401 credential, 429 too many for that device)."""
        limits = self.limits
        transport = request.transport
        if limits is not None and (refusal := limits.ip_refusal(request.remote)) is not None:
            raise _counted(transport, "address_rate", HandshakeRefused(429, refusal))
        try:
            device_id = normalize_device_id(request.device_id)
            version = _protocol_version(request.protocol_version)
        except HandshakeRefused as malformed:
            raise _counted(transport, "malformed", malformed) from None
        refusal = self.credentials.refusal(device_id, request.credential)
        if refusal is not None:
            raise _counted(transport, "credential", HandshakeRefused(401, refusal))
        # Counted per device only once the credential holds: a stranger cannot spend a device's
        # budget (strangers are bounded per address above), and a revoked device hears 401.
        if limits is not None and (refusal := limits.device_refusal(device_id)) is not None:
            raise _counted(transport, "device_rate", HandshakeRefused(429, refusal))
        client_id = (request.client_id or "").strip() or None
        if client_id is not None and len(client_id) > 128:
            too_long = HandshakeRefused(400, "Client-Id longer than 128 characters")
            raise _counted(transport, "malformed", too_long)
        return DeviceIdentity(
            device_id=device_id,
            client_id=client_id,
            protocol_version=version,
            transport=request.transport,
            remote=request.remote,
        )

    def cut_off(self, device_id: str) -> None:
        """A transport closed `device_id`'s link for a policy violation (1008): its next
        handshakes wait (`handshake_device`'s burst / rate; 10 s by default), so a flooding
        device costs a few connections a minute, not one per second."""
        if self.limits is not None:
            self.limits.penalize(device_id)


def _counted(transport: str, reason: str, refused: HandshakeRefused) -> HandshakeRefused:
    """`refused`, counted in bridge_handshakes_refused_total."""
    record_handshake_refused(transport, reason)
    return refused


def normalize_device_id(raw: str | None) -> str:
    """A valid Device-Id, MAC addresses in lower case; HandshakeRefused(400) otherwise."""
    device_id = (raw or "").strip()
    if not device_id:
        raise HandshakeRefused(400, "missing Device-Id header")
    if not _DEVICE_ID.match(device_id):
        raise HandshakeRefused(400, "malformed Device-Id")
    return device_id.lower() if ":" in device_id else device_id


def _protocol_version(raw: str | None) -> int:
    value = (raw or "1").strip()
    if value not in SUPPORTED_PROTOCOL_VERSIONS:
        shown = value if len(value) <= 16 else value[:16] + "…"
        raise HandshakeRefused(400, f"unsupported Protocol-Version {shown!r}")
    return int(value)
