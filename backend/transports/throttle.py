"""Token buckets per key (a device id, an address), in bounded tables, and the networks that
are exempt from per-address limits; `ConnectionGuard`, which every device listener (WebSocket,
MQTT) applies at accept time. Also used by `backend.provisioning.ratelimit` for handshakes, OTA
checks and activation.
"""

import ipaddress
import resource
import time
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Self

import structlog

from backend.common import KeyedBuckets
from backend.logs import LogBudget
from backend.metrics import record_connection_refused

if TYPE_CHECKING:
    from backend.config import Settings

log = structlog.get_logger("transport.throttle")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class KeyedLimiter(KeyedBuckets):
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
        super().__init__(per_s, burst, limit=max_keys, clock=clock)
        self.refused = 0

    def allow(self, key: str) -> bool:
        """Take a token from the key's bucket; False when it is empty."""
        if self.take(key):
            return True
        self.refused += 1
        return False

    def penalize(self, key: str) -> None:
        """Empty `key`'s bucket and take a whole burst more: its next request is allowed only
        after `burst / per_s` seconds (a device cut off for breaking a bound)."""
        bucket = self.bucket(key)
        bucket.tokens = min(bucket.refill(self.clock()), 0.0) - bucket.burst


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


class ConnectionGuard:
    """Drops unwanted TCP connections at accept time, before a byte of them is parsed.

    - Connections still in their handshake are capped (slowloris, idle sockets, an attempt to
      exhaust descriptors): past the cap a new one is dropped at once.
    - One address may open `per_address` connections at a burst, then at a steady rate: a
      connection storm from one host is dropped before its requests are parsed (loopback is
      addresses in `rate_limit_exempt`, loopback by default, are not limited: a local fleet
      simulation is not an attack).
    - An address whose handshakes keep being refused (bad tokens, too many attempts) goes in a
      penalty box: `penalty_refusals` refusals within `penalty_s` block it for `penalty_s`, so a
      storm of doomed handshakes costs a few parsed requests, not thousands.
    - One address may hold at most `max_pending_per_address` connections in their handshake at
      once (exempt networks aside): a host that opens idle sockets slowly, within the rate,
      still cannot fill the global cap and lock everyone else out.
    """

    def __init__(
        self,
        limit: int,
        per_address: KeyedLimiter | None = None,
        *,
        exempt: ExemptNetworks | None = None,
        penalty_refusals: int = 20,
        penalty_s: float = 10.0,
        logger: Any = None,
        max_pending_per_address: int | None = None,
        transport: str = "other",
    ) -> None:
        self.limit = limit
        self.transport = transport  # the metrics' label
        self._log = logger if logger is not None else log
        self._per_address = per_address
        self._exempt = exempt if exempt is not None else ExemptNetworks(())
        self.pending: dict[Hashable, str | None] = {}  # connection -> its address
        self._pending_per_address: dict[str, int] = {}
        self._max_pending_per_address = max_pending_per_address
        self.refused = 0
        self._budget = LogBudget(self._log)
        self._penalty_refusals = penalty_refusals
        self._penalty_s = penalty_s
        self._refusals = KeyedLimiter(penalty_refusals / penalty_s, penalty_refusals)
        self._blocked_until: dict[str, float] = {}

    @classmethod
    def for_listener(
        cls, settings: "Settings", logger: Any = None, *, transport: str = "other"
    ) -> Self:
        """The guard of a device listener (WebSocket, MQTT), from the shared settings."""
        rate = settings.rate_limits["connection_ip"]
        return cls(
            handshake_cap(settings.max_pending_handshakes),
            KeyedLimiter(rate.per_s, rate.burst),
            exempt=ExemptNetworks(settings.rate_limit_exempt),
            logger=logger,
            max_pending_per_address=settings.max_pending_handshakes_per_address,
            transport=transport,
        )

    def admit(self, connection: Hashable, address: str | None) -> bool:
        """Admit a new connection or say no (penalty box, pending cap, per-address rate)."""
        if address is not None and self._is_blocked(address):
            self.refused += 1
            record_connection_refused(self.transport, "penalty_box")
            self._budget.warning("connection dropped: address in the penalty box", remote=address)
            return False
        if (
            address is not None
            and self._per_address is not None
            and address not in self._exempt
            and not self._per_address.allow(address)
        ):
            self.refused += 1
            record_connection_refused(self.transport, "address_rate")
            self._budget.warning("connection dropped: too many from this address", remote=address)
            return False
        if len(self.pending) >= self.limit:
            self.refused += 1
            record_connection_refused(self.transport, "pending_cap")
            self._budget.warning("connection refused: too many handshakes in progress",
                                 limit=self.limit, refused=self.refused)  # fmt: skip
            return False
        if address is not None and address not in self._exempt and self._holds_its_share(address):
            self.refused += 1
            record_connection_refused(self.transport, "address_pending")
            self._budget.warning("connection dropped: too many handshakes from this address",
                                 remote=address)  # fmt: skip
            return False
        self.pending[connection] = address
        if address is not None:
            self._pending_per_address[address] = self._pending_per_address.get(address, 0) + 1
        return True

    def _holds_its_share(self, address: str) -> bool:
        cap = self._max_pending_per_address
        return cap is not None and self._pending_per_address.get(address, 0) >= cap

    def handshake_refused(self, address: str | None) -> None:
        """A handshake from `address` was refused; too many and the address is blocked."""
        if address is None or self._refusals.allow(address) or self._is_blocked(address):
            return
        self._blocked_until[address] = time.monotonic() + self._penalty_s
        if len(self._blocked_until) > 10_000:
            now = time.monotonic()
            self._blocked_until = {a: t for a, t in self._blocked_until.items() if t > now}
        self._log.warning("address in the penalty box", remote=address, seconds=self._penalty_s)

    def _is_blocked(self, address: str) -> bool:
        until = self._blocked_until.get(address)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        del self._blocked_until[address]
        return False

    def done(self, connection: Hashable) -> None:
        """The connection finished its handshake or went away: it no longer counts as pending."""
        if connection not in self.pending:
            return
        address = self.pending.pop(connection)
        if address is not None:
            left = self._pending_per_address.get(address, 1) - 1
            if left > 0:
                self._pending_per_address[address] = left
            else:
                self._pending_per_address.pop(address, None)


def handshake_cap(configured: int) -> int:
    """At most half the open-file limit may wait in handshakes, whatever the setting: the
    other half stays for devices that finished theirs, the API and the database."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return configured if soft == resource.RLIM_INFINITY else max(1, min(configured, soft // 2))
