"""Pending activations in memory, shared out so that nobody's requests block someone else's.

- The table is shared out by address: one address holds at most `max_pending // 64` requests,
  one IPv4 /24 or IPv6 /64 at most `max_pending // 16` (addresses in `exempt` networks, loopback
  by default, are not capped); past its share a request is refused (TooManyPending, 503).
  When the whole table is full (many prefixes, or an exempt one), a new request takes the place
  of the least recently seen request of the prefix holding the most.
- A Device-Id is never reserved: it keeps up to `MAX_PENDING_PER_DEVICE` candidates (each with
  its own code, Client-Id and address); one more takes the place of the least recently seen
  candidate of the prefix holding the most of them.

A request the device stops polling is forgotten after `ttl_s`. Writing is the owner's
(`ProvisioningStore`): it hears of every change (`on_changed`) and removal (`on_removed`).
"""

import secrets
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from backend.logs import LogBudget
from backend.provisioning.errors import TooManyPending
from backend.provisioning.ratelimit import partition_of
from backend.provisioning.records import PendingActivation
from backend.transports.throttle import ExemptNetworks

log = structlog.get_logger("provisioning")

MAX_PENDING_PER_DEVICE = 8  # candidates per Device-Id (a new one replaces one)
CODE_DIGITS = 6


class PendingActivations:
    """The pending activations by code, indexed by (Device-Id, Client-Id), by Device-Id, and by
    address and prefix for the fair shares."""

    def __init__(
        self,
        *,
        max_pending: int,
        ttl_s: float,
        exempt: Iterable[str],
        clock: Callable[[], float],
        on_changed: Callable[[str], None],
        on_removed: Callable[[str], None],
    ) -> None:
        self.max_pending = max_pending
        self.per_address = max(1, max_pending // 64)
        self.per_prefix = max(self.per_address, max_pending // 16)
        self.ttl_s = ttl_s
        self._exempt = ExemptNetworks(exempt)
        self._clock = clock
        self._on_changed = on_changed
        self._on_removed = on_removed
        # Requests that replace another (a full table, a contested Device-Id) are what a flood
        # looks like: a few are logged, then one count a minute.
        self._churn = LogBudget(log, burst=5, interval_s=60.0)
        self._requests: dict[str, PendingActivation] = {}  # code -> request
        self._of: dict[tuple[str, str], str] = {}  # (device id, client id) -> code
        self._candidates: dict[str, dict[str, None]] = {}  # device id -> its codes
        self._partition: dict[str, tuple[str, str]] = {}  # code -> (address, prefix)
        self._by_address: dict[str, int] = {}  # address -> pending requests
        self._by_prefix: dict[str, dict[str, None]] = {}  # prefix -> codes, least recent first

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, code: str) -> PendingActivation | None:
        """The request with this code, or None."""
        return self._requests.get(code)

    def all(self) -> list[PendingActivation]:
        """Every request still alive, oldest first."""
        self.expire()
        return sorted(self._requests.values(), key=lambda p: (p.created_at, p.code))

    def find(self, device_id: str, client_id: str) -> PendingActivation | None:
        """The request of this (Device-Id, Client-Id), or None."""
        code = self._of.get((device_id, client_id))
        return self._requests.get(code) if code is not None else None

    def candidates(self, device_id: str) -> list[PendingActivation]:
        """The requests that claim this Device-Id, oldest first."""
        codes = self._candidates.get(device_id, {})
        return sorted((self._requests[c] for c in codes), key=lambda p: (p.created_at, p.code))

    def candidate_count(self, device_id: str) -> int:
        """How many requests claim this Device-Id."""
        return len(self._candidates.get(device_id, ()))

    def request(
        self,
        device_id: str,
        client_id: str,
        *,
        serial_number: str | None,
        remote: str | None,
        info: dict[str, Any],
    ) -> PendingActivation:
        """The pending activation of this (device, client): the same code while it polls, a new
        one the first time. TooManyPending when the address's or prefix's share is used up."""
        now = self._clock()
        existing = self.find(device_id, client_id)
        if existing is not None and now - existing.last_seen < self.ttl_s:
            self.seen(existing)
            existing.remote = remote
            existing.info = info
            existing.polls += 1
            if serial_number is not None and existing.serial_number != serial_number:
                existing.serial_number = serial_number
                existing.hmac_verified = False
            self._on_changed(existing.code)
            return existing
        if existing is not None:
            self.remove(existing.code)
        address, prefix = partition_of(remote)
        self._check_share(remote, address, prefix)
        replaced = self._make_room_for_candidate(device_id, prefix) or self._make_room(prefix)
        request = PendingActivation(
            code=self._new_code(),
            device_id=device_id,
            client_id=client_id,
            serial_number=serial_number,
            challenge=secrets.token_hex(16),
            remote=remote,
            info=info,
            created_at=now,
            last_seen=now,
        )
        self.add(request)
        self._on_changed(request.code)
        fields: dict[str, Any] = {
            "device_id": device_id,
            "code": request.code,
            "remote": remote,
            "board": info.get("board_type"),
            "candidates": self.candidate_count(device_id),
        }
        if replaced is None:
            log.info("activation requested", **fields)
        else:
            self._churn.info(
                "activation requested in place of another",
                replaced_device_id=replaced.device_id,
                replaced_remote=replaced.remote,
                **fields,
            )
        return request

    def seen(self, request: PendingActivation) -> None:
        """The device behind `request` polled (an OTA check or an activation poll): it is the
        most recently seen of its prefix, the last one a newcomer would replace."""
        request.last_seen = self._clock()
        self._touch(request.code)

    def _touch(self, code: str) -> None:
        """The request is now the most recently seen of its prefix."""
        members = self._by_prefix.get(self._partition.get(code, ("", ""))[1])
        if members is not None and code in members:
            del members[code]
            members[code] = None

    def codes(self) -> list[str]:
        """The codes of every request held (expired ones included)."""
        return list(self._requests)

    def add(self, request: PendingActivation) -> None:
        """Index a request (a new one, or one read back from the database). When its (Device-Id,
        Client-Id) has another request already (two instances answered at once), the older one
        is the pair's: every instance picks the same."""
        address, prefix = partition_of(request.remote)
        self._requests[request.code] = request
        pair = (request.device_id, request.client_id)
        holder = self._requests.get(self._of.get(pair, ""))
        if holder is None or _age_order(request) < _age_order(holder):
            self._of[pair] = request.code
        self._candidates.setdefault(request.device_id, {})[request.code] = None
        self._partition[request.code] = (address, prefix)
        self._by_address[address] = self._by_address.get(address, 0) + 1
        self._by_prefix.setdefault(prefix, {})[request.code] = None

    def absorb(self, stored: PendingActivation) -> None:
        """Merge a request read from the database, which another instance may have written or
        updated (the device polled it): a new one is added; a known one takes the stored
        fields when they are more recent. A second request for the same (Device-Id, Client-Id)
        loses to the older one and is removed (the owner hears of it, so it is deleted)."""
        mine = self._requests.get(stored.code)
        if mine is None:
            self.add(stored)
        elif stored.last_seen > mine.last_seen:
            mine.last_seen = stored.last_seen
            mine.remote, mine.info = stored.remote, stored.info
            mine.serial_number, mine.hmac_verified = stored.serial_number, stored.hmac_verified
            self._touch(mine.code)
        holder = self._of.get((stored.device_id, stored.client_id))
        for code in list(self._candidates.get(stored.device_id, {})):
            if code != holder and self._requests[code].client_id == stored.client_id:
                self.remove(code)

    def remove(self, code: str, *, notify: bool = True) -> None:
        """Forget a request (approved, replaced, expired); the owner hears of it unless
        `notify` is False (it went from the database already)."""
        request = self._requests.pop(code, None)
        if request is None:
            return
        pair = (request.device_id, request.client_id)
        if self._of.get(pair) == code:
            del self._of[pair]
        _discard(self._candidates, request.device_id, code)
        address, prefix = self._partition.pop(code)
        left = self._by_address.get(address, 1) - 1
        if left > 0:
            self._by_address[address] = left
        else:
            self._by_address.pop(address, None)
        _discard(self._by_prefix, prefix, code)
        if notify:
            self._on_removed(code)

    def expire(self) -> None:
        """Forget the requests not seen for `ttl_s`."""
        cutoff = self._clock() - self.ttl_s
        for code in [c for c, p in self._requests.items() if p.last_seen < cutoff]:
            self.remove(code)

    def _new_code(self) -> str:
        while True:
            code = str(secrets.randbelow(10**CODE_DIGITS)).zfill(CODE_DIGITS)
            if code not in self._requests:
                return code

    def _check_share(self, ip: str | None, address: str, prefix: str) -> None:
        """TooManyPending when this address or prefix holds its share of the table already."""
        if ip is not None and ip in self._exempt:
            return
        if self._by_address.get(address, 0) >= self.per_address:
            self.expire()
        if self._by_address.get(address, 0) >= self.per_address:
            raise TooManyPending(
                f"{self.per_address} activations are pending from this address already"
            )
        if len(self._by_prefix.get(prefix, ())) >= self.per_prefix:
            self.expire()
        if len(self._by_prefix.get(prefix, ())) >= self.per_prefix:
            raise TooManyPending(
                f"{self.per_prefix} activations are pending from this network already"
            )

    def _make_room_for_candidate(self, device_id: str, prefix: str) -> PendingActivation | None:
        """A Device-Id with all its candidates taken loses one, never the newcomer: the least
        recently seen of the prefix that holds the most of them (the newcomer counted)."""
        codes = self._candidates.get(device_id, {})
        if len(codes) < MAX_PENDING_PER_DEVICE:
            return None
        groups: dict[str, list[PendingActivation]] = {}
        for code in codes:
            groups.setdefault(self._partition[code][1], []).append(self._requests[code])
        largest = max(len(members) + (key == prefix) for key, members in groups.items())
        crowded = [r for k, m in groups.items() if len(m) + (k == prefix) == largest for r in m]
        evicted = min(crowded, key=lambda r: (r.last_seen, r.created_at, r.code))
        self.remove(evicted.code)
        return evicted

    def _make_room(self, prefix: str) -> PendingActivation | None:
        """A full table loses the least recently seen request of the prefix that holds the most
        (the newcomer counted): a flood from a few networks churns only itself."""
        if len(self._requests) < self.max_pending:
            return None
        self.expire()
        if len(self._requests) < self.max_pending:
            return None
        largest = max(len(m) + (k == prefix) for k, m in self._by_prefix.items())
        heads = [
            self._requests[next(iter(m))]
            for k, m in self._by_prefix.items()
            if m and len(m) + (k == prefix) == largest
        ]
        evicted = min(heads, key=lambda r: (r.last_seen, r.created_at, r.code))
        self.remove(evicted.code)
        return evicted


def _age_order(request: PendingActivation) -> tuple[float, str]:
    """Oldest first; the code breaks ties, so every instance orders alike."""
    return (request.created_at, request.code)


def _discard(index: dict[str, dict[str, None]], key: str, code: str) -> None:
    members = index.get(key)
    if members is not None:
        members.pop(code, None)
        if not members:
            del index[key]
