"""Structured logging: JSON lines when not on a terminal, readable console output on one.

Every device log line carries `device_id` and `session_id` (bound by the device session).
Values under secret-looking keys are masked, so tokens never reach the logs; every URL in a line
(a field's value, a library's message, an exception's text) is redacted by `redact_urls`
(userinfo, query values, secret-looking path segments), and so are the records of the HTTP and
MCP client libraries' own loggers (`redact_library_urls`), whatever handler reads them.
"""

import functools
import itertools
import logging
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from typing import Any
from urllib.parse import unquote

import structlog

from backend.common import KeyedBuckets

# Words that name a secret in a field's name (`token`, `admin_token`, `api_key`, `password`),
# and last words that make the field a measure of one instead (`first_token_ms`, `token_source`):
# matched by whole words, so a timing or a count is never masked as if it were a secret.
_SECRET_WORDS = frozenset({"token", "authorization", "password", "passwd", "secret", "apikey"})
_MEASURE_WORDS = frozenset({"ms", "s", "count", "source", "len", "at"})
_WORD = re.compile(r"[a-z0-9]+")


@functools.cache
def _is_secret_key(key: str) -> bool:
    words = _WORD.findall(re.sub(r"(?<=[a-z])(?=[A-Z])", "_", key).lower())
    if not words or words[-1] in _MEASURE_WORDS:
        return False
    pairs = {a + b for a, b in itertools.pairwise(words)}
    return bool(_SECRET_WORDS.intersection(words) or "apikey" in pairs)


# ---- URLs without their secrets --------------------------------------------------------------
# For everything the bridge shows or logs (docs/mcp-servers.md,
# "Secrets in URLs").
#
# One rule, for every reader (an `admin` key included) and every log line:
#
# - **userinfo**: `user:password@` becomes `***@` (the user part too: `https://<token>@host`);
# - **query**: every value becomes `***`, names kept (`?api_key=***&tz=***`); a bare item
#   (`?<token>`) becomes `***`;
# - **fragment**: `#***`;
# - **path segments**: a segment right after a word that announces a secret (`s`, `k`, `key`,
#   `token`, `secret`, `password`, `auth`, `sig`, … see `_SECRET_BEFORE`) becomes `***`, and so
#   does any segment that looks random (`looks_random`): at least 16 characters of
#   `[A-Za-z0-9_-]` (after percent-decoding) with a piece between `-`/`_` of at least 8 that mixes
#   two of lowercase, uppercase and digits, or at least 32 such characters whatever their mix;
#   `name=value` segments with a secret-looking name keep only the name;
# - scheme, host (IPv6 brackets included) and port are kept as they are.
#
# `redact_url` never raises, whatever it is given (a malformed URL is redacted as far as it can be
# split, by string operations only); `redact_urls` applies it to every URL inside a text (a log
# message, an exception's message). Both are idempotent.
MASK = "***"

# A path segment right after one of these is a secret (`/s/<secret>/mcp`, `/token/<t>`).
_SECRET_BEFORE = frozenset(
    {
        "s",
        "k",
        "key",
        "keys",
        "apikey",
        "api-key",
        "api_key",
        "token",
        "tokens",
        "secret",
        "secrets",
        "password",
        "passwd",
        "pass",
        "auth",
        "sig",
        "signature",
        "credential",
        "credentials",
        "bearer",
    }
)
# `name=value` inside a path segment: the value is hidden when the name contains one of these.
_SECRET_NAME = re.compile(r"key|token|secret|pass|auth|sig|code|credential|session", re.I)
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9_\-]+")
_MIN_RANDOM = 16
_MIN_ANY = 32
_MIN_PIECE = 8
_PIECES = re.compile(r"[-_]")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# A URL inside free text: a scheme and `://`, up to whitespace, a quote or an angle bracket.
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s\"'<>`]*")
# A path with a query inside free text (`"GET /s/abc/mcp?api_key=x HTTP/1.1"`), not part of a URL.
_PATH_QUERY_IN_TEXT = re.compile(r"(?<![\w:/.\-])/[^\s\"'<>`?#]*[?#][^\s\"'<>`]+")


def looks_random(segment: str) -> bool:
    """Whether a path segment looks like a generated secret (see the rule above): 16 or more of
    `[A-Za-z0-9_-]` with a piece (between `-` and `_`) of 8 or more mixing two of lowercase,
    uppercase and digits (`Zq8xK2pLmN4vB7wR`, a UUID), or 32 or more whatever they are. A name
    (`mcp-server-endpoint-v2`, `2024-11-05-notes`) is kept."""
    if len(segment) < _MIN_RANDOM:
        return False
    if "%" in segment:
        segment = unquote(segment)
    if _TOKEN_CHARS.fullmatch(segment) is None:
        return False
    if len(segment) >= _MIN_ANY:
        return True
    return any(len(piece) >= _MIN_PIECE and _mixed(piece) for piece in _PIECES.split(segment))


def _mixed(piece: str) -> bool:
    lower = any(c.islower() for c in piece)
    upper = any(c.isupper() for c in piece)
    digit = any(c.isdigit() for c in piece)
    return lower + upper + digit >= 2


def _redact_path(path: str) -> str:
    out: list[str] = []
    after_secret_word = False
    for segment in path.split("/"):
        masked = (after_secret_word and bool(segment)) or looks_random(segment)
        if masked:
            out.append(MASK)
        elif "=" in segment and _SECRET_NAME.search(segment.split("=", 1)[0]):
            out.append(segment.split("=", 1)[0] + "=" + MASK)
        else:
            out.append(segment)
        # `/s/secret/mcp`: the secret itself, masked, announces nothing.
        after_secret_word = not masked and segment.lower() in _SECRET_BEFORE
    return "/".join(out)


def _redact_query(query: str) -> str:
    items = []
    for item in re.split(r"([&;])", query):
        if item in ("&", ";") or not item:
            items.append(item)
        elif "=" in item:
            name = item.split("=", 1)[0]
            items.append(f"{MASK if looks_random(name) else name}={MASK}")
        else:
            items.append(MASK)
    return "".join(items)


def _redact_reference(rest: str) -> str:
    """A path, its query and its fragment (what follows the authority)."""
    path, hash_, fragment = rest.partition("#")
    path, question, query = path.partition("?")
    redacted = _redact_path(path)
    if question:
        redacted += "?" + _redact_query(query)
    if hash_:
        redacted += "#" + (MASK if fragment else "")
    return redacted


def redact_url(url: str) -> str:
    """`url` with its secrets replaced by `***` (the module's rule); never raises."""
    if not isinstance(url, str):
        return MASK
    scheme = _SCHEME.match(url)
    if scheme is None:
        # No `scheme://`: a path (`/s/abc/mcp?key=x`), or something unparsable. Hide userinfo
        # (`user:pw@host`) if one is there, and redact the rest as a path.
        head, at, tail = url.partition("@")
        if at and "/" not in head and "?" not in head:
            return MASK + "@" + _redact_reference(tail)
        return _redact_reference(url)
    prefix = scheme.group(0)
    rest = url[len(prefix) :]
    end = len(rest)
    for stop in "/?#":
        found = rest.find(stop)
        if found != -1:
            end = min(end, found)
    authority, reference = rest[:end], rest[end:]
    if "@" in authority:
        authority = MASK + "@" + authority.rpartition("@")[2]
    return prefix + authority + _redact_reference(reference)


def redact_urls(text: str) -> str:
    """`text` with every URL in it (`scheme://…`, or a path with a query) redacted by
    `redact_url`; text without `://`, `?` or `#` is returned as it is (cheap for log lines)."""
    if not isinstance(text, str):
        return text
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda found: redact_url(found.group(0)), text)
    if "?" in text or "#" in text:
        text = _PATH_QUERY_IN_TEXT.sub(lambda found: _redact_reference(found.group(0)), text)
    return text


def redact_secrets(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A structlog processor: any field whose name says secret (token, password, key...) becomes
    `***`."""
    for key in event:
        if _is_secret_key(key):
            event[key] = "***"
    return event


_QUERY_TOKEN = re.compile(r"([?&](?:token|ticket)=)[^&\s\"']+", re.IGNORECASE)
_MAX_DEPTH = 4  # nested fields (a dict of endpoints) redacted this deep; deeper ones as text


def mask_query_token(text: str) -> str:
    """`...?token=<secret>` as `...?token=***` (the MCP endpoint takes its key in the query)."""
    lowered = text.lower()  # and `?ticket=` (the talk page's one-use device ticket)
    found = "token=" in lowered or "ticket=" in lowered
    return _QUERY_TOKEN.sub(r"\1***", text) if found else text


def redact_text(text: str) -> str:
    """A log line's text with its URLs redacted (`redact_urls`) and any
    `token=`/`ticket=` query value masked."""
    return mask_query_token(redact_urls(text))


def _redacted_value(value: Any, depth: int = 0) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if depth >= _MAX_DEPTH:
        return value if isinstance(value, int | float | bool | None) else redact_text(str(value))
    if isinstance(value, dict):
        return {key: _redacted_value(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted_value(item, depth + 1) for item in value]
    return value


def redact_url_values(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A structlog processor: every URL in a field's value (strings, and those inside lists and
    dicts) loses its secrets (`redact_urls`); the `exception` text too, once rendered."""
    for key, value in event.items():
        if isinstance(value, str):
            if "://" in value or "?" in value or "#" in value:
                event[key] = redact_text(value)
        elif isinstance(value, dict | list | tuple):
            event[key] = _redacted_value(value)
    return event


class UrlRedactingFilter(logging.Filter):
    """Redacts the URLs (and `token=` query values) in a library's log record, message and
    arguments: `httpx` logs every request's URL at INFO (`HTTP Request: POST http://…?api_key=…`),
    the MCP SDK every endpoint it connects to, uvicorn every WebSocket's path with its query.

    A record with arguments is formatted first (an `httpx.URL` argument is no string), then
    replaced by the redacted text without arguments. A filter on the logger, not a handler, so
    every handler (pytest's included) sees only the redacted line; an exception attached to the
    record is redacted when rendered (`configure_logging`'s formatter)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact the record's message in place; always keeps the record."""
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            # Formatters use a record's exc_text when it is set: the traceback, redacted.
            record.exc_text = redact_text(_PLAIN.formatException(record.exc_info))
        if not isinstance(record.msg, str):
            return True  # a structlog event dict: its processors redacted it already
        if record.args:
            try:
                text = record.getMessage()
            except Exception:
                text = f"{record.msg} {record.args!r}"
            record.msg, record.args = redact_text(text), ()
        else:
            record.msg = redact_text(record.msg)
        return True


_PLAIN = logging.Formatter()
QueryTokenFilter = UrlRedactingFilter  # its first name, when it masked `token=` only

# The loggers of the libraries that log URLs the bridge was configured with: HTTP clients (both
# major versions), the MCP SDK's client, transports and shared code (`client` is the name its
# ClientSession logs under), uvicorn's server log.
LIBRARY_URL_LOGGERS = (
    "httpx",
    "httpx2",
    "httpcore",
    "httpcore2",
    "mcp",
    "mcp.client",
    "mcp.client.client",
    "mcp.client.session",
    "mcp.client.streamable_http",
    "mcp.client.sse",
    "mcp.client.stdio",
    "mcp.client.websocket",
    "mcp.client.auth",
    "mcp.client.auth.oauth2",
    "mcp.client.caching",
    "mcp.shared",
    "mcp.shared.session",
    "mcp.shared.dispatcher",
    "mcp.shared.jsonrpc_dispatcher",
    "mcp.shared.direct_dispatcher",
    "client",
    "uvicorn.error",
)
_LIBRARY_PREFIXES = ("httpx", "httpcore", "mcp.", "uvicorn")


def _add_redacting_filter(logger: logging.Logger) -> None:
    if not any(isinstance(existing, UrlRedactingFilter) for existing in logger.filters):
        logger.addFilter(UrlRedactingFilter())


def redact_library_urls() -> None:
    """Put `UrlRedactingFilter` (once) on the loggers of `LIBRARY_URL_LOGGERS` and on every
    logger already created under them (`httpcore.http11`, …). A logger's filter sees only the
    records made on that very logger, hence the list. Idempotent, cheap: call it where a
    library that logs URLs starts being used."""
    for name in LIBRARY_URL_LOGGERS:
        _add_redacting_filter(logging.getLogger(name))
    for name, existing in list(logging.root.manager.loggerDict.items()):
        if isinstance(existing, logging.Logger) and name.startswith(_LIBRARY_PREFIXES):
            _add_redacting_filter(existing)


def mask_uvicorn_query_tokens() -> None:
    """Put `UrlRedactingFilter` on uvicorn's logger once (a filter on the logger, not a handler,
    so every handler, pytest's included, sees only the masked line)."""
    _add_redacting_filter(logging.getLogger("uvicorn.error"))


def _redact_exception(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    text = event.get("exception")
    if isinstance(text, str):
        event["exception"] = redact_text(text)
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
                _redact_exception,  # a traceback quotes URLs (`HTTPStatusError: … for url '…'`)
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
