"""Search the web for a turn (`WebSearch`: `DdgsSearch` on ddgs, `GoogleSearch` on the Custom
Search JSON API, `SearxngSearch` on a SearxNG instance, `FallbackSearch` trying them in the
configured order). The bundled dental knowledge base is `backend.chat.knowledge`.

All give `SearchResult(title, content, link, origin)`; `origin` names who found it
("duckduckgo", "google", "searxng", "kb") and travels to the turn's `Sources`. `format_results`
renders results as `Title / Content / Link` blocks separated by `---`, the prompt format of the
seed design. Web search is optional: any failure is reported to the caller as `SearchFailed` and
the turn goes on with the knowledge base. `FallbackSearch` logs a provider that fails once, when
it starts failing (and when it answers again), not on every turn (`backend.chat.health`); the
turn's metadata says it every time (`search_error`).
"""

import asyncio
import functools
import importlib
import json
import logging
import math
import ssl
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import httpx
import structlog
from pydantic import BaseModel, ValidationError

from backend.chat.health import Reachability, quiet_libraries
from backend.common import clip
from backend.errors import BridgeError

if TYPE_CHECKING:
    from backend.config import Settings

log = structlog.get_logger("backend.chat.search")

# "web" is a result of a search that does not say which engine (a test's fake, a custom one).
Origin = Literal["web", "duckduckgo", "google", "searxng", "kb"]
ProviderName = Literal["duckduckgo", "google", "searxng"]
PROVIDERS: tuple[ProviderName, ...] = ("duckduckgo", "google", "searxng")
GOOGLE_CSE_URL = "https://www.googleapis.com/customsearch/v1"
# What one answer of a search API may hold: a Custom Search page is ~10-60 KB, a SearxNG page
# ~20-200 KB; anything larger is not a results page and is not read further.
MAX_ANSWER_BYTES = 2 * 1024 * 1024
# What one result may bring into the prompt: a snippet is a few hundred characters.
MAX_TITLE_CHARS = 300
MAX_CONTENT_CHARS = 1000


@dataclass(frozen=True, slots=True)
class SearchResult:
    """One search result: title, text, link, and where it came from."""

    title: str
    content: str
    link: str
    origin: Origin = "web"
    source: str = ""  # the publisher, for knowledge-base entries (e.g. "NHS")


class SearchFailed(BridgeError):
    """The web search failed (network, rate limit, timeout, no results page).

    `kind` tells failures apart in the log ("unreachable", "timeout", "HTTP 403"; None: the text
    does); `detail`: the library's own words, for the log only."""

    def __init__(self, message: str, *, kind: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.detail = detail


class WebSearch(Protocol):
    """A web search provider."""

    async def search(self, query: str, n: int) -> list[SearchResult]:
        """Up to `n` results; raises SearchFailed on any failure."""
        ...


def provider_name(search: WebSearch) -> str:
    """How logs and errors name a provider: its `name`, else its class name (a test's fake)."""
    name = getattr(search, "name", None)
    return name if isinstance(name, str) else type(search).__name__


def format_results(results: Sequence[SearchResult]) -> str:
    """`Title: …\\nContent: …\\nLink: …` blocks joined by `\\n---\\n` (data-flow design, step 7)."""
    return "\n---\n".join(
        f"Title: {item.title}\nContent: {item.content}\nLink: {item.link}" for item in results
    )


# ---- the web ----------------------------------------------------------------------------------


class DdgsSearch:
    """Web search with the `ddgs` metasearch library (DuckDuckGo by default).

    ddgs is synchronous, so it runs in a thread with its own request timeout plus an overall
    deadline here. `ddgs.exceptions.DDGSException` is the base of every error it raises.
    """

    name: ClassVar[ProviderName] = "duckduckgo"

    def __init__(
        self,
        *,
        timeout_s: float = 3.0,
        backend: str = "duckduckgo",
        region: str = "wt-wt",
        safesearch: str = "moderate",
    ) -> None:
        self.timeout_s = timeout_s
        self.backend = backend
        self.region = region
        self.safesearch = safesearch

    async def search(self, query: str, n: int) -> list[SearchResult]:
        """Search DuckDuckGo (the `ddgs` library, on a thread); raises SearchFailed."""
        try:
            async with asyncio.timeout(self.timeout_s + 1.0):
                rows = await asyncio.to_thread(self._search_sync, query, n)
        except TimeoutError:
            raise SearchFailed(
                f"web search timed out after {self.timeout_s:g} s", kind="timeout"
            ) from None
        return [_web_result(row) for row in rows[:n] if isinstance(row, dict) and row.get("href")]

    def _search_sync(self, query: str, n: int) -> list[dict[str, Any]]:
        # Imported here: ddgs pulls in lxml and primp, which a bridge without search never needs.
        from ddgs import DDGS
        from ddgs.exceptions import DDGSException

        _quiet_ddgs()
        try:
            rows = DDGS(timeout=max(1, math.ceil(self.timeout_s))).text(
                query,
                region=self.region,
                safesearch=self.safesearch,
                max_results=n,
                backend=self.backend,
            )
        except DDGSException as exc:
            raise _ddgs_failure(exc) from None
        return list(rows)


@functools.cache
def _quiet_ddgs() -> None:
    """ddgs logs each failed engine at INFO (`Error in engine duckduckgo: DNSError(...)`) from
    loggers that exist once its modules are loaded (`DDGS` loads them on first use): debug
    detail (the failure is reported once)."""
    importlib.import_module("ddgs.ddgs")
    quiet_libraries()


def _ddgs_failure(exc: Exception) -> SearchFailed:
    """A ddgs error as a short reason: the library words a failed DNS lookup as a page of Rust
    error chain (`DNSError('error sending request for url (...) > error resolving DNS > ...')`),
    which stays in `detail`."""
    text = _one_line(exc)
    words = f"{type(exc).__name__} {text}".lower()
    if "dns" in words:
        kind, reason = "unreachable", "unreachable (DNS lookup failed)"
    elif "connect" in words:
        kind, reason = "unreachable", "unreachable (connection failed)"
    elif "ratelimit" in words or "429" in words:
        kind, reason = "rate limited", "rate limited"
    elif "timeout" in words or "timed out" in words:
        kind, reason = "timeout", "timed out"
    else:
        return SearchFailed(f"web search failed: {text}", detail=text)
    return SearchFailed(reason, kind=kind, detail=text)


def _web_result(row: dict[str, Any]) -> SearchResult:
    return SearchResult(
        title=str(row.get("title") or row.get("href")),
        content=str(row.get("body") or ""),
        link=str(row["href"]),
        origin="duckduckgo",
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:199] + "…"


# ---- search APIs over HTTP --------------------------------------------------------------------


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every search request: building one (loading the CA bundle) costs
    ~18 ms, far more than the rest of a client's setup."""
    return httpx.create_ssl_context()  # httpx's own default: the certifi bundle


class _SecretFilter(logging.Filter):
    """Masks API keys in httpx's own log line (`HTTP Request: GET <url with ?key=…>`): the Custom
    Search API takes its key in the query string, and httpx logs every URL at INFO."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets and isinstance(record.args, tuple):
            record.args = tuple(_masked(arg, self.secrets) for arg in record.args)
        return True


def _masked(value: object, secrets: Iterable[str]) -> object:
    if not isinstance(value, str | httpx.URL):
        return value
    text = str(value)
    hidden = _redact(text, secrets)
    return hidden if hidden != text else value


def _redact(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


_HTTPX_LOG_FILTER = _SecretFilter()
logging.getLogger("httpx").addFilter(_HTTPX_LOG_FILTER)


_HEADERS = {"Accept": "application/json", "Accept-Encoding": "identity"}


class _HttpSearch:
    """What the HTTP providers share: one GET with an overall deadline, the answer read up to
    `max_bytes`, every failure a one-line `SearchFailed` naming the provider and never a secret.

    Each search opens its own client (with a shared TLS context): a provider is then usable from
    any event loop and holds nothing to close; a search costs one connection setup.
    """

    name: ClassVar[ProviderName]

    def __init__(
        self,
        *,
        timeout_s: float = 3.0,
        max_bytes: int = MAX_ANSWER_BYTES,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._transport = transport
        self._secrets: tuple[str, ...] = ()

    def _failed(self, reason: str, kind: str | None = None) -> SearchFailed:
        return SearchFailed(f"{self.name}: {_redact(reason, self._secrets)}", kind=kind)

    async def _get_json(self, url: str, params: dict[str, str | int]) -> Any:
        timeout = httpx.Timeout(self.timeout_s, connect=min(5.0, self.timeout_s))
        try:
            async with (
                asyncio.timeout(self.timeout_s),  # the whole exchange, not per read
                httpx.AsyncClient(
                    timeout=timeout, verify=_tls(), transport=self._transport
                ) as http,
                http.stream("GET", url, params=params, headers=_HEADERS) as r,
            ):
                body = await self._read(r)
                status = r.status_code
        except TimeoutError:
            raise self._failed(f"no answer within {self.timeout_s:g} s", "timeout") from None
        except httpx.HTTPError as exc:  # connection refused, DNS, TLS, a broken answer
            kind = type(exc).__name__
            raise self._failed(f"{kind}: {_one_line(exc)}", kind) from None
        if status != 200:
            detail = self._status_detail(status, body)
            raise self._failed(f"HTTP {status}{detail}", f"HTTP {status}")
        try:
            return json.loads(body)
        except (ValueError, RecursionError):  # not UTF-8, not JSON, nested past the stack
            raise self._failed(f"HTTP {status} but the answer is not JSON") from None

    async def _read(self, response: httpx.Response) -> bytes:
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise self._failed(f"answer of {declared} bytes (limit {self.max_bytes})")
        body = bytearray()
        # Raw bytes: the request asks for no compression, and a compressed answer is not
        # inflated (a gzip bomb of 50 KB would be 50 MB in one decoded chunk); it fails as JSON.
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > self.max_bytes:
                raise self._failed(f"answer over {self.max_bytes} bytes")
        return bytes(body)

    def _status_detail(self, status: int, body: bytes) -> str:
        return " (rate limited)" if status == 429 else ""


def _http_link(value: object) -> str | None:
    """An absolute http(s) link, or None: a results page may carry `javascript:`/`data:` links
    or relative paths, which must never reach the sources a user clicks."""
    if not isinstance(value, str) or not value.startswith(("https://", "http://")):
        return None
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL:
        return None
    return value if url.host else None


def _results(
    rows: object, n: int, origin: Origin, *, link: str, title: str, content: str
) -> list[SearchResult]:
    """Up to `n` results from the rows of an answer, skipping rows without a usable link and
    links already seen (a metasearch lists one page once per engine that found it)."""
    if not isinstance(rows, list):
        return []
    found: list[SearchResult] = []
    seen: set[str] = set()
    for row in rows:
        href = _http_link(row.get(link)) if isinstance(row, dict) else None
        if href is None or href in seen:
            continue
        seen.add(href)
        found.append(
            SearchResult(
                title=clip(row.get(title), MAX_TITLE_CHARS, at_word=False)
                or clip(href, MAX_TITLE_CHARS, at_word=False),
                content=clip(row.get(content), MAX_CONTENT_CHARS, at_word=False),
                link=href,
                origin=origin,
            )
        )
        if len(found) == n:
            break
    return found


class _GoogleError(BaseModel):
    message: str = ""
    status: str = ""


class _GoogleErrorAnswer(BaseModel):
    error: _GoogleError


class GoogleSearch(_HttpSearch):
    """Google Programmable Search: the Custom Search JSON API,
    `GET {url}?key=…&cx=…&q=…&num=…` (at most 10 results a request; 100 free queries a day).

    The API takes its key only in the query string, so the key is masked in every message and
    in httpx's request log.
    """

    name: ClassVar[ProviderName] = "google"

    def __init__(
        self,
        api_key: str,
        engine_id: str,
        *,
        url: str = GOOGLE_CSE_URL,
        timeout_s: float = 3.0,
        max_bytes: int = MAX_ANSWER_BYTES,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not api_key or not engine_id:
            raise ValueError("Google search needs an API key and a search engine id (cx)")
        super().__init__(timeout_s=timeout_s, max_bytes=max_bytes, transport=transport)
        self.url = url
        self.engine_id = engine_id
        self._key = api_key
        self._secrets = (api_key,)
        _HTTPX_LOG_FILTER.secrets.add(api_key)

    async def search(self, query: str, n: int) -> list[SearchResult]:
        """Search Google's Custom Search JSON API (at most 10 results); raises SearchFailed."""
        num = max(1, min(n, 10))  # the API answers 400 to num > 10
        params: dict[str, str | int] = {"key": self._key, "cx": self.engine_id, "q": query}
        params["num"] = num
        answer = await self._get_json(self.url, params)
        if not isinstance(answer, dict):
            raise self._failed("the answer is not a Custom Search result object")
        # No `items` at all is Google's way of saying "no results".
        return _results(
            answer.get("items", []), num, "google", link="link", title="title", content="snippet"
        )

    def _status_detail(self, status: int, body: bytes) -> str:
        """Google's own reason ("API key not valid", "Quota exceeded …"), clipped, key masked."""
        try:
            error = _GoogleErrorAnswer.model_validate_json(body).error
        except ValidationError:
            return super()._status_detail(status, body)
        reason = " ".join(part for part in (error.status, error.message) if part)
        return (
            f" ({clip(reason, 160, at_word=False)})"
            if reason
            else super()._status_detail(status, body)
        )


class SearxngSearch(_HttpSearch):
    """A SearxNG instance: `GET {url}/search?q=…&format=json`. The instance must allow the JSON
    format (`search.formats: [html, json]` in its settings.yml); otherwise it answers 403."""

    name: ClassVar[ProviderName] = "searxng"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 3.0,
        max_bytes: int = MAX_ANSWER_BYTES,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the SearxNG URL must start with http:// or https://: {url!r}")
        super().__init__(timeout_s=timeout_s, max_bytes=max_bytes, transport=transport)
        self.url = url.rstrip("/") + "/search"
        # An instance behind basic auth (`https://user:password@searx.lan`): httpx sends the
        # credentials, and the password is masked like an API key.
        password = httpx.URL(url).password
        if password:
            self._secrets = (password,)
            _HTTPX_LOG_FILTER.secrets.add(password)

    async def search(self, query: str, n: int) -> list[SearchResult]:
        """Search a SearxNG instance's JSON API; raises SearchFailed."""
        answer = await self._get_json(self.url, {"q": query, "format": "json"})
        if not isinstance(answer, dict):
            raise self._failed("the answer is not a SearxNG result object")
        return _results(
            answer.get("results", []), n, "searxng", link="url", title="title", content="content"
        )

    def _status_detail(self, status: int, body: bytes) -> str:
        if status == 403:
            return " (is the json format enabled in the instance's settings.yml?)"
        return super()._status_detail(status, body)


# ---- providers in order -----------------------------------------------------------------------


class FallbackSearch:
    """Tries providers in order: the first one to answer with results is the answer, each
    result's `origin` names it, and the log says which one answered. A provider that fails or
    finds nothing hands over to the next; when all fail, `SearchFailed` lists every reason."""

    def __init__(self, providers: Sequence[WebSearch]) -> None:
        if not providers:
            raise ValueError("FallbackSearch needs at least one provider")
        self.providers = list(providers)
        self._health = [
            Reachability(log, "search provider", "error", provider=provider_name(provider))
            for provider in self.providers
        ]

    @property
    def names(self) -> list[str]:
        """The providers' names, in the order they are tried."""
        return [provider_name(provider) for provider in self.providers]

    async def search(self, query: str, n: int) -> list[SearchResult]:
        """The first results any provider finds, in order; raises SearchFailed when all fail."""
        failures: list[str] = []
        answered = False
        for provider, health in zip(self.providers, self._health, strict=True):
            name = provider_name(provider)
            began = time.perf_counter()
            try:
                results = await provider.search(query, n)
            except SearchFailed as exc:
                failures.append(str(exc) if str(exc).startswith(f"{name}:") else f"{name}: {exc}")
                detail = {"detail": exc.detail} if exc.detail else {}
                health.failed(exc.kind or failures[-1], failures[-1], **detail)
                continue
            health.answered()
            answered = True
            ms = round((time.perf_counter() - began) * 1000, 3)
            log.info("search answered", provider=name, results=len(results), duration_ms=ms)
            if results:
                return results[:n]
        if answered or not failures:
            return []
        if len(failures) == 1:
            raise SearchFailed(failures[0])
        raise SearchFailed("every search provider failed: " + "; ".join(failures))


def web_search_from_settings(settings: "Settings") -> FallbackSearch | None:
    """The configured providers in their order (`search_providers`), or None when web search
    is off (`search_enabled = false`)."""
    if not settings.search_enabled:
        return None
    timeout = settings.search_timeout_s
    providers: list[WebSearch] = []
    for name in settings.search_providers:
        if name == "duckduckgo":
            providers.append(DdgsSearch(timeout_s=timeout))
        elif name == "google":
            key = settings.search_google_api_key
            providers.append(
                GoogleSearch(
                    key.get_secret_value() if key is not None else "",
                    settings.search_google_engine_id or "",
                    url=settings.search_google_url,
                    timeout_s=timeout,
                )
            )
        else:
            providers.append(SearxngSearch(settings.search_searxng_url or "", timeout_s=timeout))
    return FallbackSearch(providers)
