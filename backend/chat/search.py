"""Search for a turn: the web (`WebSearch`: `DdgsSearch` on ddgs, `GoogleSearch` on the Custom
Search JSON API, `SearxngSearch` on a SearxNG instance, `FallbackSearch` trying them in the
configured order) and the bundled dental knowledge base (`KnowledgeBase`, BM25 over
`data/dental_kb.json`).

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
import itertools
import json
import logging
import math
import ssl
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import httpx
import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backend.chat.health import Reachability, quiet_libraries
from backend.chat.text import Language, folded_words, wordset
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
# Below this relevance (`KnowledgeBase.relevance`) a knowledge-base entry shares only a common
# word or two with the question ("Do dentists like listening to music?" → check-ups: 0.2) and is
# neither sent to the model nor shown (setting `kb_min_score`; docs/chat.md, "Knowledge base").
# Real questions score 2.5 ("gums") and up: see tests/test_search_providers.py.
DEFAULT_KB_MIN_SCORE = 2.0


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


# ---- the bundled knowledge base ---------------------------------------------------------------


class KbEntry(BaseModel):
    """One entry of the bundled dental knowledge base."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    topic: str
    lang: Language
    title: str
    content: str
    source: str = Field(min_length=1)
    url: str = Field(pattern=r"^https://")
    keywords: str = ""


class _KbFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int
    note: str = ""
    entries: list[KbEntry]


# Folded words too common to rank with (both languages).
_STOPWORDS = wordset(
    "the a an is are to of and or in on for with how what why when should can do does i my me "
    "you your it this that be at by as from much many often tell please know want need la cua va "
    "which who where "
    "hoac trong tren cho "
    "voi the nao gi tai sao khi nen co the toi ban khong bao nhieu duoc mot nhung cac "
    "bi"  # bị, the passive marker ("răng bị rơi", "bị chảy máu"), not a topic
)
# Words that say little alone but something beside a telling word ("bad breath"): no term of
# their own, and no pair with a stop word. "How long does a filling last" is about fillings,
# not the brushing entry's "how long"; "what foods are bad for my teeth" not about bad breath.
_WEAK = wordset("bad good get rid take last")
# A question word makes no pair: "how long" is every duration question, not the brushing entry.
_QUESTION_WORDS = wordset("how what why when which who where")
_K1 = 1.2
_B = 0.75


def kb_terms(text: str) -> list[str]:
    """Index terms: folded words without stop words, plus folded bigrams (Vietnamese words
    are often two syllables: "đánh răng" → "danh_rang")."""
    tokens = [_stem(token) for token in folded_words(text)]
    terms = [token for token in tokens if token not in _STOPWORDS and token not in _WEAK]
    terms += [
        f"{a}_{b}"
        for a, b in itertools.pairwise(tokens)
        if (_telling(a) or _telling(b)) and a not in _QUESTION_WORDS
    ]
    return terms


def _telling(token: str) -> bool:
    return token not in _STOPWORDS and token not in _WEAK


def _stem(token: str) -> str:
    """A light English suffix strip ("bleeding" → "bleed", "gums" → "gum"); Vietnamese syllables
    never end in these suffixes."""
    for suffix in ("ing", "ed", "es", "s"):
        if token.endswith(suffix) and len(token) - len(suffix) >= 3:
            stem = token[: -len(suffix)]
            if suffix == "s" and stem.endswith(("s", "u", "i")):
                return token  # "floss", "plus", "gingivitis"
            if suffix == "ed" and stem.endswith("e"):
                return token  # "bleed", "need": "bleeding" and "bleeds" stem to "bleed" too
            if suffix == "es" and not stem.endswith(("sh", "ch", "x", "ss")):
                return token[:-1]
            return stem
    return token


# Stop words are compared with stemmed tokens: "does" is "doe" by then.
_STOPWORDS = _STOPWORDS | {_stem(word) for word in _STOPWORDS}


class KnowledgeBase:
    """A small BM25 index over the bundled entries; accent-insensitive (đ→d). An entry whose
    `relevance` to a question is under `min_score` is no hit (`DEFAULT_KB_MIN_SCORE`, setting
    `kb_min_score`)."""

    def __init__(
        self, entries: Sequence[KbEntry], *, min_score: float = DEFAULT_KB_MIN_SCORE
    ) -> None:
        self.entries = list(entries)
        self.min_score = min_score
        self._docs = [
            Counter(kb_terms(f"{e.title} {e.title} {e.keywords} {e.content}")) for e in entries
        ]
        self._lengths = [sum(doc.values()) for doc in self._docs]
        self._average = sum(self._lengths) / max(1, len(self._lengths))
        frequency: Counter[str] = Counter()
        for doc in self._docs:
            frequency.update(doc.keys())
        count = len(self._docs)
        self._idf = {
            term: math.log(1 + (count - seen + 0.5) / (seen + 0.5))
            for term, seen in frequency.items()
        }
        # The weight of a word no entry has: the most telling kind ("music", "weather").
        self._unseen_idf = math.log(1 + (count + 0.5) / 0.5)

    @classmethod
    def bundled(cls, *, min_score: float = DEFAULT_KB_MIN_SCORE) -> "KnowledgeBase":
        """The knowledge base shipped in `data/dental_kb.json`."""
        text = resources.files("backend.chat").joinpath("data/dental_kb.json").read_text("utf-8")
        return cls(_KbFile.model_validate(json.loads(text)).entries, min_score=min_score)

    def knows(self, word: str) -> bool:
        """Whether some entry holds the word (folded, stemmed), or it is a stop word."""
        terms = [_stem(token) for token in folded_words(word)]
        return all(term in self._idf or term in _STOPWORDS for term in terms)

    def known_part(self, query: str) -> str | None:
        """The words of the query some entry holds, when they are at least half of its words
        that are not stop words ("Could that cause cavities?" → "cause cavities"); None when
        most are unknown ("Do dentists like listening to music?") or all are known."""
        words = [word for word in folded_words(query) if _stem(word) not in _STOPWORDS]
        kept = [word for word in words if _stem(word) in self._idf]
        if not kept or len(kept) == len(words) or len(kept) * 2 < len(words):
            return None
        return " ".join(kept)

    def scores(self, query: str) -> list[float]:
        """The BM25 score of every entry for the query, in entry order."""
        terms = set(kb_terms(query))
        scores = []
        for doc, length in zip(self._docs, self._lengths, strict=True):
            score = 0.0
            norm = _K1 * (1 - _B + _B * length / self._average)
            for term in terms:
                tf = doc.get(term)
                if tf:
                    score += self._idf[term] * tf * (_K1 + 1) / (tf + norm)
            scores.append(score)
        return scores

    def relevance(self, query: str) -> list[float]:
        """Each entry's BM25 score times the share of the question's words (weighted by idf)
        the entry contains. BM25 alone cannot tell a short real question ("How often should I
        brush?": 3.0) from a long one sharing a common word ("Do dentists like listening to
        music?": 2.6); the share can (1.0 against 0.09)."""
        return self._relevance(query, self.scores(query))

    def _relevance(self, query: str, scores: list[float]) -> list[float]:
        words = {_stem(token) for token in folded_words(query)} - _STOPWORDS - _WEAK
        weights = {word: self._idf.get(word, self._unseen_idf) for word in words}
        total = sum(weights.values())
        if not total:
            return [0.0] * len(scores)
        return [
            score * sum(weight for word, weight in weights.items() if word in doc) / total
            for score, doc in zip(scores, self._docs, strict=True)
        ]

    def search(
        self,
        query: str,
        n: int = 3,
        *,
        language: Language | None = None,
        min_score: float | None = None,
        min_share: float = 0.4,
        min_cover: float = 0.5,
    ) -> list[SearchResult]:
        """The best `n` entries (by BM25) in `language` (when given) whose `relevance` is at
        least `min_score` (default: the index's) and whose score is at least `min_share` of the
        best: an entry far below the best shares only common words with the query ("teeth" for
        a brushing question) and would be quoted off topic. Nor is an entry cited that contains
        less than `min_cover` of what the best one contains of the question (its terms weighted
        by idf): "Tại sao chân răng bị chảy máu?" scores the knocked-out tooth entry high on
        "chân răng" alone, and it says nothing of bleeding."""
        if min_score is None:
            min_score = self.min_score
        scores = self.scores(query)
        relevance = self._relevance(query, scores)
        scored = [
            (score, index)
            for index, score in enumerate(scores)
            if score > 0
            and relevance[index] >= min_score
            and (language is None or self.entries[index].lang == language)
        ]
        scored.sort(key=lambda pair: (-pair[0], pair[1]))
        if not scored:
            return []
        floor = scored[0][0] * min_share
        best = self._covered(query, scored[0][1])
        return [
            _kb_result(self.entries[index])
            for score, index in scored[:n]
            if score >= floor and self._covered(query, index) >= best * min_cover
        ]

    def _covered(self, query: str, index: int) -> float:
        """How much of the question the entry contains: its terms weighted by idf, without the
        word pairs that hold a stop word ("răng bị" says nothing of a topic)."""
        doc = self._docs[index]
        return sum(
            self._idf[term]
            for term in set(kb_terms(query))
            if term in doc and not _STOPWORDS.intersection(term.split("_"))
        )


def _kb_result(entry: KbEntry) -> SearchResult:
    return SearchResult(
        title=f"{entry.title} ({entry.source})",
        content=entry.content,
        link=entry.url,
        origin="kb",
        source=entry.source,
    )
