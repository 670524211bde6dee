"""Handshake rate limits: how often one device id, and one address, may try to connect.

A device that reconnects in a loop (or 500 connections claiming one Device-Id) would otherwise
cost a handshake, a session, an MCP initialize and log lines each time. Stock firmware connects
once per conversation, so a small burst and a slow refill never bother a real device.
"""

import ipaddress
import time
from collections import OrderedDict


class KeyedRate:
    """A token bucket per key, for at most `max_keys` keys (the least recently used go)."""

    def __init__(self, rate_per_s: float, burst: float, max_keys: int = 50_000) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, key: str) -> bool:
        now = time.monotonic()
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate_per_s)
        allowed = tokens >= 1
        self._buckets[key] = (tokens - 1 if allowed else tokens, now)
        if len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)
        return allowed


class HandshakeThrottle:
    """How often one device id may try to connect (any transport)."""

    def __init__(self, per_device: KeyedRate) -> None:
        self.per_device = per_device

    def refusal(self, device_id: str, remote: str | None) -> str | None:
        if not self.per_device.allow(device_id):
            return "too many connection attempts for this device"
        return None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False
