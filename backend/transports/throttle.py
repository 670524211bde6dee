"""Token buckets per key (a device id, an address), in bounded tables, and the networks that
are exempt from per-address limits. Used at accept time by the WebSocket transport and by
`backend.provisioning.ratelimit` for handshakes, OTA checks and activation.
"""

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class KeyedLimiter:
    """A token bucket per key; `allow(key)` takes one token or says no. At most `max_keys`
    buckets are kept (the least recently used go), so invented keys cost bounded memory."""

    def __init__(
        self,
        per_s: float,
        burst: float,
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

    def penalize(self, key: str) -> None:
        """Empty `key`'s bucket and take a whole burst more: its next request is allowed only
        after `burst / per_s` seconds (a device cut off for breaking a bound)."""
        tokens = min(self._refilled(key), 0.0) - float(self.burst)
        self._buckets[key] = _Bucket(tokens, self._clock())
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)

    def _refilled(self, key: str) -> float:
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            return float(self.burst)
        elapsed = self._clock() - bucket.at
        return min(float(self.burst), bucket.tokens + elapsed * self.per_s)

    def __len__(self) -> int:
        return len(self._buckets)


class ExemptNetworks:
    """Addresses not limited per address (loopback by default: a simulated fleet or a
    benchmark on the bridge's own machine is not an attack)."""

    def __init__(self, networks: Iterable[str]) -> None:
        self._networks: list[Network] = [ipaddress.ip_network(n, strict=False) for n in networks]

    def __contains__(self, ip: object) -> bool:
        if not self._networks or not isinstance(ip, str):
            return False
        try:
            address = ipaddress.ip_address(ip.strip("[]"))
        except ValueError:
            return False
        return any(address in network for network in self._networks)
