"""Structured logging: JSON lines when not on a terminal, readable console output on one.

Every device log line carries `device_id` and `session_id` (bound by the device session).
Values under secret-looking keys are masked, so tokens never reach the logs; every URL in a line
(a field's value, a library's message, an exception's text) is redacted by `redact_urls`
(userinfo, query values, secret-looking path segments), and so are the records of the HTTP and
MCP client libraries' own loggers (`redact_library_urls`), whatever handler reads them.
"""

import logging
import sys
import time
from typing import Any

import structlog

from backend.logs.budgets import DeviceBudgets, DeviceLog, EventBudget, LineRate, LogBudget
from backend.logs.redaction import (
    MASK,
    UrlRedactingFilter,
    looks_random,
    mask_query_token,
    mask_uvicorn_query_tokens,
    redact_exception,
    redact_library_urls,
    redact_secrets,
    redact_text,
    redact_url,
    redact_url_values,
    redact_urls,
)

__all__ = [
    "MASK",
    "DeviceBudgets",
    "DeviceLog",
    "EventBudget",
    "LibraryNoiseFilter",
    "LineRate",
    "LogBudget",
    "UrlRedactingFilter",
    "configure_logging",
    "looks_random",
    "mask_query_token",
    "mask_uvicorn_query_tokens",
    "redact_exception",
    "redact_library_urls",
    "redact_secrets",
    "redact_text",
    "redact_url",
    "redact_url_values",
    "redact_urls",
]


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
        redact_url_values,
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
                redact_exception,  # a traceback quotes URLs (`HTTPStatusError: … for url '…'`)
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
    redact_library_urls()


class LibraryNoiseFilter(logging.Filter):
    """Caps what libraries log per failed connection (websockets writes a traceback for every
    handshake a client abandons; asyncio for every accept error): the first `burst` records of a
    kind are kept, on one line for expected network failures, then one counted line at most every
    `interval_s` seconds. A hostile client closing 2,000 idle sockets costs a few lines."""

    PREFIXES = ("websockets", "asyncio", "uvicorn")
    ONE_LINE = frozenset({"opening handshake failed"})  # a client gone mid-handshake: no bug
    MAX_KINDS = 256

    def __init__(self, burst: int = 3, interval_s: float = 10.0) -> None:
        super().__init__()
        self._burst = burst
        self._interval_s = interval_s
        self._seen: dict[tuple[str, str], list[float]] = {}  # key -> [count, suppressed, last]

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep the record within its kind's budget (shortened to one line); False drops it."""
        if not record.name.startswith(self.PREFIXES) or record.levelno < logging.WARNING:
            return True
        message = str(record.msg)
        if message in self.ONE_LINE and record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            record.msg = f"{message}: {type(error).__name__}: {error}"
            record.args = ()
            record.exc_info = None
        key = (record.name, message)
        if key not in self._seen and len(self._seen) >= self.MAX_KINDS:
            # Messages that all differ (a task's repr inside) share one budget, and the table
            # stays bounded.
            message = "other library messages"
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
        return True
