"""Search for a turn: the web (`WebSearch`, `DdgsSearch` on ddgs) and the bundled dental
knowledge base (`KnowledgeBase`, BM25 over `data/dental_kb.json`).

Both give `SearchResult(title, content, link)`; `format_results` renders them as
`Title / Content / Link` blocks separated by `---`, the prompt format of the seed design. Web
search is optional: any failure is reported to the caller as `SearchFailed` and the turn goes on
with the knowledge base.
"""

import asyncio
import itertools
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from backend.chat.text import Language, folded_words, wordset
from backend.errors import BridgeError

Origin = Literal["web", "kb"]


@dataclass(frozen=True, slots=True)
class SearchResult:
    title: str
    content: str
    link: str
    origin: Origin = "web"
    source: str = ""  # the publisher, for knowledge-base entries (e.g. "NHS")


class SearchFailed(BridgeError):
    """The web search failed (network, rate limit, timeout, no results page)."""


class WebSearch(Protocol):
    async def search(self, query: str, n: int) -> list[SearchResult]:
        """Up to `n` results; raises SearchFailed on any failure."""
        ...


def format_results(results: Sequence[SearchResult]) -> str:
    """`Title: …\\nContent: …\\nLink: …` blocks joined by `\\n---\\n` (seed 000, step 7)."""
    return "\n---\n".join(
        f"Title: {item.title}\nContent: {item.content}\nLink: {item.link}" for item in results
    )


# ---- the web ----------------------------------------------------------------------------------


class DdgsSearch:
    """Web search with the `ddgs` metasearch library (DuckDuckGo by default).

    ddgs is synchronous, so it runs in a thread with its own request timeout plus an overall
    deadline here. `ddgs.exceptions.DDGSException` is the base of every error it raises.
    """

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
        try:
            async with asyncio.timeout(self.timeout_s + 1.0):
                rows = await asyncio.to_thread(self._search_sync, query, n)
        except TimeoutError:
            raise SearchFailed(f"web search timed out after {self.timeout_s:g} s") from None
        return [_web_result(row) for row in rows[:n] if isinstance(row, dict) and row.get("href")]

    def _search_sync(self, query: str, n: int) -> list[dict[str, Any]]:
        # Imported here: ddgs pulls in lxml and primp, which a bridge without search never needs.
        from ddgs import DDGS
        from ddgs.exceptions import DDGSException

        try:
            rows = DDGS(timeout=max(1, math.ceil(self.timeout_s))).text(
                query,
                region=self.region,
                safesearch=self.safesearch,
                max_results=n,
                backend=self.backend,
            )
        except DDGSException as exc:
            raise SearchFailed(f"web search failed: {_one_line(exc)}") from None
        return list(rows)


def _web_result(row: dict[str, Any]) -> SearchResult:
    return SearchResult(
        title=str(row.get("title") or row.get("href")),
        content=str(row.get("body") or ""),
        link=str(row["href"]),
        origin="web",
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:199] + "…"


# ---- the bundled knowledge base ---------------------------------------------------------------


class KbEntry(BaseModel):
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
    "hoac trong tren cho "
    "voi the nao gi tai sao khi nen co the toi ban khong bao nhieu duoc mot nhung cac"
)
_K1 = 1.2
_B = 0.75


def kb_terms(text: str) -> list[str]:
    """Index terms: folded words without stop words, plus folded bigrams (Vietnamese words
    are often two syllables: "đánh răng" → "danh_rang")."""
    tokens = [_stem(token) for token in folded_words(text)]
    terms = [token for token in tokens if token not in _STOPWORDS]
    terms += [
        f"{a}_{b}"
        for a, b in itertools.pairwise(tokens)
        if a not in _STOPWORDS or b not in _STOPWORDS
    ]
    return terms


def _stem(token: str) -> str:
    """A light English suffix strip ("bleeding" → "bleed", "gums" → "gum"); Vietnamese syllables
    never end in these suffixes."""
    for suffix in ("ing", "ed", "es", "s"):
        if token.endswith(suffix) and len(token) - len(suffix) >= 3:
            stem = token[: -len(suffix)]
            if suffix == "s" and stem.endswith(("s", "u", "i")):
                return token  # "floss", "plus", "gingivitis"
            if suffix == "es" and not stem.endswith(("sh", "ch", "x", "ss")):
                return token[:-1]
            return stem
    return token


class KnowledgeBase:
    """A small BM25 index over the bundled entries; accent-insensitive (đ→d)."""

    def __init__(self, entries: Sequence[KbEntry]) -> None:
        self.entries = list(entries)
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

    @classmethod
    def bundled(cls) -> "KnowledgeBase":
        text = resources.files("backend.chat").joinpath("data/dental_kb.json").read_text("utf-8")
        return cls(_KbFile.model_validate(json.loads(text)).entries)

    def scores(self, query: str) -> list[float]:
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

    def search(
        self,
        query: str,
        n: int = 3,
        *,
        language: Language | None = None,
        min_score: float = 1.0,
        min_share: float = 0.4,
    ) -> list[SearchResult]:
        """The best `n` entries in `language` (when given) scoring at least `min_score` and at
        least `min_share` of the best score: an entry far below the best shares only common
        words with the query ("teeth" for a brushing question) and would be quoted off topic."""
        scored = [
            (score, index)
            for index, score in enumerate(self.scores(query))
            if score >= min_score and (language is None or self.entries[index].lang == language)
        ]
        scored.sort(key=lambda pair: (-pair[0], pair[1]))
        floor = scored[0][0] * min_share if scored else 0.0
        return [_kb_result(self.entries[index]) for score, index in scored[:n] if score >= floor]


def _kb_result(entry: KbEntry) -> SearchResult:
    return SearchResult(
        title=f"{entry.title} ({entry.source})",
        content=entry.content,
        link=entry.url,
        origin="kb",
        source=entry.source,
    )
