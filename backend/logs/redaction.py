"""What never reaches a log line: values under secret-looking field names, and the secrets in
URLs (userinfo, query values, secret-looking path segments), in fields, messages, tracebacks and
the records of the HTTP and MCP client libraries' own loggers."""

import functools
import itertools
import logging
import re
from collections.abc import MutableMapping
from typing import Any
from urllib.parse import unquote

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


def redact_exception(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A structlog processor: the URLs in a rendered traceback redacted."""
    text = event.get("exception")
    if isinstance(text, str):
        event["exception"] = redact_text(text)
    return event
