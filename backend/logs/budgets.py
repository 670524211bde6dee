"""Bounds on what one noisy source writes to the log: a budget per event and key (`LogBudget`),
per device across its links (`DeviceBudgets`, `DeviceLog`), for lines a device earns by
connecting (`LineRate`), and for events of the whole process (`EventBudget`)."""

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from backend.common import KeyedBuckets


class LogBudget:
    """Bounds what one noisy source (a device, a peer) can write to the log.

    The first `burst` lines of an event (per `key`, when one is given: a reason, a peer) are
    written in full; after that the event is only counted, and one summary line with the count
    is written at most every `interval_s` seconds. A device that sends junk at line rate thus
    costs a few lines per interval, not one per frame. At most `max_keys` keys are tracked (the
    oldest is forgotten), so a peer that invents keys cannot grow it.
    """

    __slots__ = (
        "_burst",
        "_clock",
        "_counts",
        "_interval_s",
        "_last_summary",
        "_log",
        "_max_keys",
        "_suppressed",
    )

    def __init__(
        self,
        log: Any,
        *,
        burst: int = 3,
        interval_s: float = 10.0,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._burst = burst
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._counts: dict[tuple[str, str | None], int] = {}
        self._suppressed: dict[tuple[str, str | None], int] = {}
        self._last_summary: dict[tuple[str, str | None], float] = {}

    def warning(self, event: str, *, key: str | None = None, **fields: Any) -> None:
        """Log a warning within the event's budget (per `key`)."""
        self._emit("warning", event, key, fields)

    def info(self, event: str, *, key: str | None = None, **fields: Any) -> None:
        """Log at info within the event's budget (per `key`)."""
        self._emit("info", event, key, fields)

    def count(self, event: str, key: str | None = None) -> int:
        """How many lines of the event (and key) were asked for so far, written or not."""
        return self._counts.get((event, key), 0)

    def rebind(self, log: Any) -> None:
        """Write the next lines through `log` (a device's new link), keeping the counts."""
        self._log = log

    def close(self) -> None:
        """Write the pending summaries (when the source goes away)."""
        now = self._clock()
        for slot in list(self._suppressed):
            self._flush(slot, now)

    def close_as_one(self, event: str) -> None:
        """Write every pending count in one `event` line ({event: count}) instead of one line
        each: a source that comes back often costs one line per visit."""
        if not self._suppressed:
            return
        now = self._clock()
        counts: dict[str, int] = {}
        for slot, suppressed in self._suppressed.items():
            name = slot[0] if slot[1] is None else f"{slot[0]} ({slot[1]})"
            counts[name] = counts.get(name, 0) + suppressed
            self._last_summary[slot] = now
        self._suppressed.clear()
        self._log.warning(event, repeated=counts)

    def _emit(self, level: str, event: str, key: str | None, fields: dict[str, Any]) -> None:
        slot = (event, key)
        count = self._counts.get(slot)
        if count is None:
            self._evict()
            count = 0
        count += 1
        self._counts[slot] = count
        if count <= self._burst:
            if key is not None:
                fields["count"] = count  # the n-th time for this reason
            getattr(self._log, level)(event, **fields)
            return
        self._suppressed[slot] = self._suppressed.get(slot, 0) + 1
        now = self._clock()
        last = self._last_summary.get(slot)
        if last is None:
            self._last_summary[slot] = now  # the first summary comes one interval later
        elif now - last >= self._interval_s:
            self._flush(slot, now)

    def _flush(self, slot: tuple[str, str | None], now: float) -> None:
        event, key = slot
        suppressed = self._suppressed.pop(slot, 0)
        self._last_summary[slot] = now
        if suppressed:
            extra = {} if key is None else {"reason": key}
            self._log.warning(
                f"{event} (repeated)", repeated=suppressed, total=self._counts.get(slot, 0), **extra
            )

    def _evict(self) -> None:
        while len(self._counts) >= self._max_keys:
            oldest = next(iter(self._counts))
            self._counts.pop(oldest)
            self._suppressed.pop(oldest, None)
            self._last_summary.pop(oldest, None)


class LineRate:
    """At most `burst` lines at once and `per_minute` a minute per key (a device): for lines
    a device earns just by connecting (ready, disconnected), which a reconnect loop would
    otherwise turn into unbounded volume. `allow(key)` is None for a line to leave out, else the
    number left out since the last one written (for its `suppressed` field). At most
    `max_keys` keys are kept, the least recently used go."""

    __slots__ = ("_buckets",)

    def __init__(
        self,
        *,
        burst: int = 10,
        per_minute: float = 10.0,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._buckets = KeyedBuckets(per_minute / 60.0, burst, limit=max_keys, clock=clock)

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, key: str) -> int | None:
        """None to leave the line out, else how many were left out since the last one written."""
        bucket = self._buckets.bucket(key)
        if not bucket.take(self._buckets.clock()):
            return None
        left_out, bucket.missed = bucket.missed, 0
        return left_out


class DeviceBudgets:
    """A `LogBudget` per device that outlives its links: a device that reconnects carries on
    with its budget instead of starting a fresh burst, so reconnecting does not buy it more
    lines. Budgets are made on first use; the `max_devices` most recently used are kept."""

    __slots__ = ("_budgets", "_burst", "_interval_s", "_max_devices", "lifecycle")

    def __init__(
        self, *, burst: int = 5, interval_s: float = 60.0, max_devices: int = 1024
    ) -> None:
        # Lines a device earns by connecting (ready, disconnected): a rate, not a burst, since a
        # stock WebSocket device connects anew for every conversation.
        self.lifecycle = LineRate()
        self._burst = burst
        self._interval_s = interval_s
        self._max_devices = max_devices
        self._budgets: OrderedDict[str, LogBudget] = OrderedDict()

    def get(self, device_id: str, log: Any) -> LogBudget:
        """`device_id`'s budget, writing through `log` from now on."""
        budget = self._budgets.pop(device_id, None)
        if budget is None:
            budget = LogBudget(log, burst=self._burst, interval_s=self._interval_s)
            while len(self._budgets) >= self._max_devices:
                self._budgets.popitem(last=False)
        else:
            budget.rebind(log)
        self._budgets[device_id] = budget
        return budget

    def flush(self, device_id: str) -> None:
        """Write `device_id`'s pending counts in one line (its link ended); its counts stay."""
        budget = self._budgets.get(device_id)
        if budget is not None:
            budget.close_as_one("device log lines suppressed")

    def __len__(self) -> int:
        return len(self._budgets)


class EventBudget:
    """One event that a peer can repeat under many reasons (`key`): a `LogBudget` per key."""

    __slots__ = ("_budget", "_event")

    def __init__(
        self,
        log: Any,
        event: str,
        *,
        first: int = 3,
        summary_interval_s: float = 60.0,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._event = event
        self._budget = LogBudget(
            log, burst=first, interval_s=summary_interval_s, max_keys=max_keys, clock=clock
        )

    def hit(self, key: str, **fields: Any) -> None:
        """One occurrence of `key`; `fields` go into the line when one is written."""
        self._budget.warning(self._event, key=key, reason=key, **fields)

    def count(self, key: str) -> int:
        """How many lines of the event were asked for under `key`."""
        return self._budget.count(self._event, key)

    def flush(self) -> None:
        """Write the pending summaries."""
        self._budget.close()


class DeviceLog:
    """A logger for one device link: every line carries `device_id` and `session_id`.

    It holds two strings instead of a bound structlog logger (a context dict and a wrapper per
    device), which matters with ten thousand idle devices; the binding happens per line, and
    device lines are rare (connect, ready, disconnect, trouble).
    """

    __slots__ = ("_logger", "device_id", "session_id")

    def __init__(self, logger: Any, device_id: str, session_id: str) -> None:
        self._logger = logger
        self.device_id = device_id
        self.session_id = session_id

    def _bound(self) -> Any:
        return self._logger.bind(device_id=self.device_id, session_id=self.session_id)

    def debug(self, event: str, **fields: Any) -> None:
        """Log at debug with the device's ids."""
        self._bound().debug(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        """Log at info with the device's ids."""
        self._bound().info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        """Log a warning with the device's ids."""
        self._bound().warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        """Log an error with the device's ids."""
        self._bound().error(event, **fields)

    def exception(self, event: str, **fields: Any) -> None:
        """Log an error with the device's ids and the current traceback."""
        self._bound().exception(event, **fields)
