"""Request rate limits per client IP and per Device-Id: token buckets in bounded tables.

One `Limits` instance holds a pair of buckets tables per kind (`handshake`, `ota`,
`activate`): a request is allowed when both its IP's bucket and its device's bucket have a
token. Tables keep at most `max_keys` buckets (least recently used go first), so a flood of
invented ids or addresses costs bounded memory. Addresses in `exempt` networks (loopback by
default: simulators and benchmarks on the bridge's machine) are not limited per IP; their
devices still are.
"""

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from backend.config import RateLimit

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class KeyedLimiter:
    """A token bucket per key; `allow(key)` takes one token or says no."""

    def __init__(
        self,
        per_s: float,
        burst: int,
        *,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_s = per_s
        self.burst = burst
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self.refused = 0

    def allow(self, key: str) -> bool:
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            while len(self._buckets) >= self.max_keys:
                self._buckets.popitem(last=False)
            bucket = self._buckets[key] = _Bucket(float(self.burst), now)
        else:
            self._buckets.move_to_end(key)
            bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.per_s)
            bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        self.refused += 1
        return False

    def __len__(self) -> int:
        return len(self._buckets)


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
        self._exempt: list[Network] = [ipaddress.ip_network(net, strict=False) for net in exempt]

    def ip_refusal(self, kind: str, ip: str | None) -> str | None:
        if ip is None or self._is_exempt(ip) or self._ip[kind].allow(ip):
            return None
        return f"too many {kind} requests from this address; slow down"

    def device_refusal(self, kind: str, device_id: str) -> str | None:
        if self._device[kind].allow(device_id):
            return None
        return f"too many {kind} requests for this device; slow down"

    def refused(self) -> dict[str, int]:
        counts = {f"{kind}_ip": limiter.refused for kind, limiter in self._ip.items()}
        counts.update({f"{kind}_device": lim.refused for kind, lim in self._device.items()})
        return counts

    def _is_exempt(self, ip: str) -> bool:
        if not self._exempt:
            return False
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return any(address in network for network in self._exempt)


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
