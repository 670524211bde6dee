"""Request rate limits per client IP and per Device-Id: token buckets in bounded tables.

One `Limits` instance holds a pair of buckets tables per kind (`handshake`, `ota`,
`activate`): a request is allowed when both its IP's bucket and its device's bucket have a
token. Tables keep at most `max_keys` buckets (least recently used go first), so a flood of
invented ids or addresses costs bounded memory. Addresses in `exempt` networks (loopback by
default: simulators and benchmarks on the bridge's machine) are not limited per IP; their
devices still are.
"""

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
        if ip is None or self._is_exempt(ip) or self._ip[kind].allow(ip):
            return None
        return f"too many {kind} requests from this address; slow down"

    def device_refusal(self, kind: str, device_id: str) -> str | None:
        if self._device[kind].allow(device_id):
            return None
        return f"too many {kind} requests for this device; slow down"

    def penalize(self, kind: str, device_id: str) -> None:
        self._device[kind].penalize(device_id)

    def refused(self) -> dict[str, int]:
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


class HandshakeLimiter:
    """The handshake part of `Limits`, in the shape `Admission` asks for."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits

    def ip_refusal(self, remote: str | None) -> str | None:
        return self._limits.ip_refusal("handshake", host_of(remote))

    def device_refusal(self, device_id: str) -> str | None:
        return self._limits.device_refusal("handshake", device_id)

    def penalize(self, device_id: str) -> None:
        self._limits.penalize("handshake", device_id)
