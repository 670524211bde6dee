"""Log lines for events that a misbehaving peer can repeat at will (drops, refusals).

The first few occurrences of each key are logged as they happen; after that one counted summary
line per interval, and `flush` writes what is left (call it when the owner goes away). The number
of keys is bounded, so a peer that invents new keys cannot grow it without limit.
"""

import time
from collections.abc import Callable
from typing import Protocol


class WarningLogger(Protocol):
    def warning(self, event: str, **fields: object) -> object: ...


class RateLimitedLog:
    __slots__ = (
        "_clock",
        "_counts",
        "_event",
        "_first",
        "_interval",
        "_last",
        "_log",
        "_max_keys",
        "_suppressed",
    )

    def __init__(
        self,
        logger: WarningLogger,
        event: str,
        *,
        first: int = 3,
        summary_interval_s: float = 60.0,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._event = event
        self._first = first
        self._interval = summary_interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._counts: dict[str, int] = {}
        self._suppressed: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def hit(self, key: str, **fields: object) -> None:
        """One occurrence of `key`; `fields` go into the line when one is written."""
        count = self._counts.get(key)
        if count is None:
            self._evict()
            count = 0
        count += 1
        self._counts[key] = count
        now = self._clock()
        if count <= self._first:
            self._log.warning(self._event, reason=key, count=count, **fields)
            self._last[key] = now
            return
        self._suppressed[key] = self._suppressed.get(key, 0) + 1
        if now - self._last.get(key, now) >= self._interval:
            self._summary(key, now)

    def count(self, key: str) -> int:
        return self._counts.get(key, 0)

    def flush(self) -> None:
        now = self._clock()
        for key in list(self._suppressed):
            self._summary(key, now)

    def _summary(self, key: str, now: float) -> None:
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            self._log.warning(
                self._event + " (summary)",
                reason=key,
                since_last_line=suppressed,
                total=self._counts.get(key, 0),
            )
        self._last[key] = now

    def _evict(self) -> None:
        while len(self._counts) >= self._max_keys:
            oldest = next(iter(self._counts))
            self._counts.pop(oldest)
            self._last.pop(oldest, None)
            self._suppressed.pop(oldest, None)
