"""Whether an outside service of the chat (the model service, a web search provider) answers,
reported in the log when that changes, not on every turn.

A model service that is down stays down for many turns; each turn still notes the failure in its
own metadata (`offline_reason`, `search_error`), but the log says it once: a warning when the
service starts failing (or fails in a new way: a wrong API key after a refused connection), the
same failure again at debug, and a warning when it answers again.

The libraries the chat's HTTP goes through (ddgs and primp's Rust crates, httpx, httpcore) log
each failed engine or request on their own (ddgs: `Error in engine duckduckgo: DNSError...` at
INFO); `quiet_libraries` demotes those records to DEBUG, so they reach the log only at debug
level, through the same handler and renderer as every other line.
"""

import logging
from typing import Any

# Libraries whose own log lines are transport detail: each failed request, engine or retry
# (primp logs through its Rust crates: the DNS resolver, the HTTP client).
NOISY_LIBRARIES = (
    "ddgs",
    "primp",
    "httpx",
    "httpcore",
    "hickory_net",
    "hickory_resolver",
    "hyper",
    "hyper_util",
    "reqwest",
)


class Reachability:
    """The state of one outside service, logged on change: `failed` at warning for a new kind
    of failure and at debug for the same again, `answered` at warning once after failures.

    `kind` tells failures apart ("unreachable", "HTTP 401", "timeout"): the same kind again is
    the same problem, whatever its message says this time. The reason goes in the field
    `reason_key` names.
    """

    __slots__ = ("_failures", "_fields", "_kind", "_log", "_reason_key", "_service")

    def __init__(self, log: Any, service: str, reason_key: str = "reason", **fields: Any) -> None:
        self._log = log
        self._service = service  # the log events' subject: "chat model", "search provider"
        self._reason_key = reason_key
        self._fields = fields  # what names the service in every line (provider, url)
        self._kind: str | None = None
        self._failures = 0

    @property
    def failing(self) -> bool:
        """Whether the last exchange failed."""
        return self._kind is not None

    def failed(self, kind: str, reason: str, **detail: Any) -> None:
        """One failure: a warning when it is new (the service answered before, or failed in
        another way), else debug with the count of failures in a row."""
        self._failures += 1
        fields = {**self._fields, self._reason_key: reason, **detail}
        if kind == self._kind:
            self._log.debug(f"{self._service} failed", failures=self._failures, **fields)
            return
        self._kind = kind
        self._log.warning(f"{self._service} failed", **fields)

    def answered(self) -> None:
        """A good exchange: after failures, one warning that the service is back."""
        if self._kind is None:
            return
        self._log.warning(f"{self._service} answers again", failures=self._failures, **self._fields)
        self._kind = None
        self._failures = 0


class _Demoted(logging.Filter):
    """Turns a library's record into a DEBUG one; drops it when the log does not show DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True  # a library's own error (a bug) is no transport detail
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


_DEMOTED = _Demoted()


def quiet_libraries(prefixes: tuple[str, ...] = NOISY_LIBRARIES) -> None:
    """Demote the records of the loggers named `prefixes` and of their sub-loggers that exist
    now to DEBUG (a filter applies to its own logger only: call it again after importing a
    library that makes more, as ddgs does for each of its modules)."""
    names = {*prefixes, *logging.root.manager.loggerDict}
    for name in names:
        if name.split(".")[0] in prefixes:
            logger = logging.getLogger(name)
            if _DEMOTED not in logger.filters:
                logger.addFilter(_DEMOTED)
