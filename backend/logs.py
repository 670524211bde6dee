"""Structured logging: JSON lines when not on a terminal, readable console output on one.

Every device log line carries `device_id` and `session_id` (bound by the device session).
Values under secret-looking keys are masked, so tokens never reach the logs.
"""

import functools
import logging
import sys
import time
from collections.abc import MutableMapping
from typing import Any

import structlog

_SECRET_KEYS = ("token", "authorization", "password", "secret")


@functools.cache
def _is_secret_key(key: str) -> bool:
    lowered = key.lower()
    return any(secret in lowered for secret in _SECRET_KEYS)


def redact_secrets(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for key in event:
        if _is_secret_key(key):
            event[key] = "***"
    return event


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Route structlog and the standard library (uvicorn, websockets) through one renderer."""
    json_output = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_output
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redact_secrets,
    ]
    structlog.configure(
        # filter_by_level first: a line below the level costs one check, not the processors.
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
            foreign_pre_chain=shared,
        )
    )
    handler.addFilter(LibraryNoiseFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # websockets logs handshake headers (with Authorization) at DEBUG; uvicorn's access log
    # would duplicate our own request logging.
    logging.getLogger("websockets").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


def clip(text: str, limit: int = 120) -> str:
    """Device-supplied text as it may appear in a log line: at most `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"


class LogBudget:
    """Bounds what one noisy source (a device) can write to the log.

    The first `burst` lines of an event are written in full; after that the event is only
    counted, and one summary line with the count is written at most every `interval_s` seconds.
    A device that sends junk at line rate thus costs a few lines per interval, not one per frame.
    """

    __slots__ = ("_burst", "_counts", "_interval_s", "_last_summary", "_log", "_suppressed")

    def __init__(self, log: Any, *, burst: int = 3, interval_s: float = 10.0) -> None:
        self._log = log
        self._burst = burst
        self._interval_s = interval_s
        self._counts: dict[str, int] = {}
        self._suppressed: dict[str, int] = {}
        self._last_summary: dict[str, float] = {}

    def warning(self, event: str, **fields: Any) -> None:
        self._emit("warning", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def _emit(self, level: str, event: str, fields: dict[str, Any]) -> None:
        count = self._counts.get(event, 0) + 1
        self._counts[event] = count
        if count <= self._burst:
            getattr(self._log, level)(event, **fields)
            return
        self._suppressed[event] = self._suppressed.get(event, 0) + 1
        now = time.monotonic()
        last = self._last_summary.get(event)
        if last is None:
            self._last_summary[event] = now  # the first summary comes one interval later
        elif now - last >= self._interval_s:
            self._flush(event, now)

    def total(self, event: str) -> int:
        return self._counts.get(event, 0)

    def close(self) -> None:
        """Write the pending summaries (when the source goes away)."""
        now = time.monotonic()
        for event in list(self._suppressed):
            self._flush(event, now)

    def _flush(self, event: str, now: float) -> None:
        suppressed = self._suppressed.pop(event, 0)
        self._last_summary[event] = now
        if suppressed:
            self._log.warning(
                f"{event} (repeated)", repeated=suppressed, total=self._counts.get(event, 0)
            )


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
        self._bound().debug(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._bound().info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._bound().warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._bound().error(event, **fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._bound().exception(event, **fields)


class LibraryNoiseFilter(logging.Filter):
    """Caps what libraries log per failed connection (websockets writes a traceback for every
    handshake a client abandons; asyncio for every accept error): the first `burst` records of a
    kind are kept, on one line for expected network failures, then one counted line at most every
    `interval_s` seconds. A hostile client closing 2,000 idle sockets costs a few lines."""

    PREFIXES = ("websockets", "asyncio", "uvicorn")
    ONE_LINE = frozenset({"opening handshake failed"})  # a client gone mid-handshake: no bug

    def __init__(self, burst: int = 3, interval_s: float = 10.0) -> None:
        super().__init__()
        self._burst = burst
        self._interval_s = interval_s
        self._seen: dict[tuple[str, str], list[float]] = {}  # key -> [count, suppressed, last]

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.PREFIXES) or record.levelno < logging.WARNING:
            return True
        message = str(record.msg)
        if message in self.ONE_LINE and record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            record.msg = f"{message}: {type(error).__name__}: {error}"
            record.args = ()
            record.exc_info = None
        key = (record.name, message)
        state = self._seen.setdefault(key, [0.0, 0.0, time.monotonic()])
        state[0] += 1
        if state[0] <= self._burst:
            return True
        state[1] += 1
        now = time.monotonic()
        if now - state[2] < self._interval_s:
            return False
        record.msg = f"{message} (repeated {int(state[1])} times, {int(state[0])} in all)"
        record.args = ()
        record.exc_info = None
        state[1] = 0
        state[2] = now
        if len(self._seen) > 256:
            self._seen.clear()  # bounded: at worst a few lines more
        return True
