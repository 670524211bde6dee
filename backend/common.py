"""Small helpers that several packages share: times for JSON, text clipped for logs and people,
the address a local client uses to reach a listener, the listening socket of an HTTP server, and
the bounded table (`Lru`) of per-device or per-key state, token buckets (`TokenBucket`, and
`KeyedBuckets` of them per key), and the waits between reconnects (`Backoff`).

Standard library only, and nothing of `backend` imported: every package may use it.
"""

import random
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})  # listen addresses meaning "every interface"


def iso_time(timestamp: float | None) -> str | None:
    """A Unix timestamp as ISO 8601 in UTC (what the APIs show), None kept as None."""
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, UTC).isoformat()


def excerpt(text: object, limit: int = 120) -> str:
    """Untrusted text as it may appear in a log line or an error: the characters themselves (a
    non-string as its repr), at most `limit` of them, and the full length when cut, so one huge
    value cannot flood a log while a reader still sees what it was."""
    text = text if isinstance(text, str) else repr(text)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"


def clip(text: object, limit: int, *, at_word: bool = True) -> str:
    """Text for a person or a model: whitespace folded to single spaces, at most `limit`
    characters, ending with an ellipsis when cut. `at_word` cuts at a word boundary when one
    is in the second half (readable), otherwise the whole budget is used. None reads as ""."""
    flat = " ".join(("" if text is None else str(text)).split())
    if len(flat) <= limit:
        return flat
    cut = flat[: limit - 1]
    if at_word:
        space = cut.rfind(" ")
        if space > limit // 2:
            cut = cut[:space]
        cut = cut.rstrip(" ,;:")
    return cut + "…"


def reachable_host(host: str) -> str:
    """The address a client on this machine uses for a listener bound to `host`: loopback of
    the same family for a wildcard (`::` is IPv6, which may be IPv6-only), `host` otherwise."""
    if host == "::":
        return "::1"
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def url_host(host: str) -> str:
    """`host` as it stands in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def tcp_listener(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A bound, listening, non-blocking TCP socket for an HTTP server on `host:port`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted connections only when it does,
    # and without it every kept-alive HTTP response waited ~40 ms for a delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class Lru(OrderedDict[K, V]):
    """A table of at most `limit` entries, most recently put last: `put` makes a key the newest
    and drops the oldest beyond the limit. For per-device or per-key state that strangers can
    make grow (device ids, session ids, digests), so memory stays bounded."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: K, value: V) -> None:
        """Store `value` as the newest entry, evicting the oldest past `limit`."""
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class TokenBucket:
    """`rate` tokens a second, at most `burst` held (full at the start); `take` spends one.
    `missed` counts the takes refused since the last one that succeeded."""

    __slots__ = ("burst", "missed", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = now
        self.missed = 0

    def refill(self, now: float) -> float:
        """The tokens held at `now` (a clock that goes back adds none)."""
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        return self.tokens

    def take(self, now: float) -> bool:
        """Spend a token; False (and one more `missed`) when there is none."""
        if self.refill(now) >= 1.0:
            self.tokens -= 1.0
            return True
        self.missed += 1
        return False


class KeyedBuckets:
    """A `TokenBucket` per key (an address, a device), made full on first use; the `limit`
    most recently used are kept, so keys that strangers invent cost bounded memory (a key
    evicted comes back with a full bucket: the bound is on memory, not on a stranger)."""

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        limit: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.clock = clock
        self._buckets: Lru[str, TokenBucket] = Lru(limit)
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def bucket(self, key: str, now: float | None = None) -> TokenBucket:
        """The key's bucket, made the most recently used (and full, at `now` or the clock's
        time, when new)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket(self.rate, self.burst, self.clock() if now is None else now)
            before = len(self._buckets)
            self._buckets.put(key, bucket)
            self.evicted += before + 1 - len(self._buckets)
        else:
            self._buckets.move_to_end(key)
        return bucket

    def peek(self, key: str) -> TokenBucket | None:
        """The key's bucket if it has one, left where it is."""
        return self._buckets.get(key)

    def take(self, key: str) -> bool:
        """Spend one of the key's tokens; False when it has none."""
        return self.bucket(key).take(self.clock())


class Backoff:
    """The waits between reconnect attempts: `initial_s`, doubling per failed attempt up to
    `max_s`, each times a random factor from `jitter` so that clients which lost the same peer
    do not come back in step. `reset()` after a connection that worked."""

    def __init__(
        self, initial_s: float, max_s: float, *, jitter: tuple[float, float] = (0.5, 1.0)
    ) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter = jitter
        self.attempts = 0

    def next_wait(self) -> float:
        """The wait before the next attempt (counts one more failed attempt)."""
        base = min(self.max_s, self.initial_s * 2.0 ** min(self.attempts, 30))
        self.attempts += 1
        return base * random.uniform(*self.jitter)

    def reset(self) -> None:
        """Start again from `initial_s` (the last attempt connected)."""
        self.attempts = 0
