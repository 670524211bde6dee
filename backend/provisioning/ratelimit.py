"""Request rate limits per client IP and per Device-Id: token buckets in bounded tables.

One `Limits` instance holds a pair of buckets tables per kind (`handshake`, `ota`,
`activate`): a request is allowed when both its IP's bucket and its device's bucket have a
token. Tables keep at most `max_keys` buckets (least recently used go first), so a flood of
invented ids or addresses costs bounded memory. Addresses in `exempt` networks (loopback by
default: simulators and benchmarks on the bridge's machine) are not limited per IP; their
devices still are.

Per-device buckets are keyed by `device_key`: the Device-Id alone only for a request that
passed the Client-Id check (the Client-Id the device was approved with), the Device-Id and the
Client-Id otherwise, so a stranger who knows a device's MAC address spends buckets of its own,
never the device's. `partition_of` names the address and the prefix (IPv4 /24, IPv6 /64) that
pending activations are shared out by.
"""

import ipaddress
import time
from collections.abc import Callable, Iterable, Mapping

from backend.config import RateLimit
from backend.transports.throttle import ExemptNetworks, KeyedLimiter


class Limits:
    """Per-IP and per-device limits for each kind of request the devices make."""

    KINDS = ("handshake", "ota", "activate")

    def __init__(
        self,
        limits: Mapping[str, RateLimit],
        exempt: Iterable[str] = (),
        *,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ip: dict[str, KeyedLimiter] = {}
        self._device: dict[str, KeyedLimiter] = {}
        for kind in self.KINDS:
            by_ip, by_device = limits[f"{kind}_ip"], limits[f"{kind}_device"]
            self._ip[kind] = KeyedLimiter(by_ip.per_s, by_ip.burst, max_keys=max_keys, clock=clock)
            self._device[kind] = KeyedLimiter(
                by_device.per_s, by_device.burst, max_keys=max_keys, clock=clock
            )
        self._exempt = ExemptNetworks(exempt)

    def ip_refusal(self, kind: str, ip: str | None) -> str | None:
        """Why a request of this kind from this address is refused now, or None (exempt addresses
        never are)."""
        if ip is None or self._is_exempt(ip) or self._ip[kind].allow(ip):
            return None
        return f"too many {kind} requests from this address; slow down"

    def device_refusal(self, kind: str, device_id: str) -> str | None:
        """Why a request of this kind for this device is refused now, or None."""
        if self._device[kind].allow(device_id):
            return None
        return f"too many {kind} requests for this device; slow down"

    def penalize(self, kind: str, device_id: str) -> None:
        """Empty the device's bucket for this kind: it waits a whole burst before its next
        request."""
        self._device[kind].penalize(device_id)

    def refused(self) -> dict[str, int]:
        """How many requests were refused, by kind and by address or device."""
        counts = {f"{kind}_ip": limiter.refused for kind, limiter in self._ip.items()}
        counts.update({f"{kind}_device": lim.refused for kind, lim in self._device.items()})
        return counts

    def _is_exempt(self, ip: str) -> bool:
        return ip in self._exempt


def host_of(remote: str | None) -> str | None:
    """The IP of a transport's `remote` ("ip:port", IPv6 without brackets too)."""
    if not remote:
        return None
    host, sep, _port = remote.rpartition(":")
    return host.strip("[]") if sep else remote


def device_key(device_id: str, client_id: str | None, *, checked: bool) -> str:
    """The per-device bucket of a request: the device's own only once its Client-Id is checked."""
    return device_id if checked or client_id is None else f"{device_id} {client_id}"


UNKNOWN_ADDRESS = "unknown"


def partition_of(ip: str | None) -> tuple[str, str]:
    """(address, prefix) of a client IP: the prefix is its IPv4 /24 or IPv6 /64 (an IPv4-mapped
    IPv6 address counts as IPv4); anything unparseable shares one partition."""
    try:
        address = ipaddress.ip_address((ip or "").strip("[]").split("%", 1)[0])
    except ValueError:
        return UNKNOWN_ADDRESS, UNKNOWN_ADDRESS
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    bits = 24 if address.version == 4 else 64
    prefix = ipaddress.ip_network(f"{address}/{bits}", strict=False)
    return str(address), str(prefix)


class HandshakeLimiter:
    """The handshake part of `Limits`, in the shape `Admission` asks for."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits

    def ip_refusal(self, remote: str | None) -> str | None:
        """Why a device handshake from this address is refused now, or None."""
        return self._limits.ip_refusal("handshake", host_of(remote))

    def device_refusal(self, device_id: str) -> str | None:
        """Why a handshake for this device is refused now, or None."""
        return self._limits.device_refusal("handshake", device_id)

    def penalize(self, device_id: str) -> None:
        """Make the device wait a whole burst before its next handshake (it was cut off)."""
        self._limits.penalize("handshake", device_id)
