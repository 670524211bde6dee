"""The bundled dental knowledge base: BM25 over `data/dental_kb.json`, accent-insensitive,
with a relevance floor so that a question sharing one common word with an entry is no hit.

Its results are `SearchResult`s of origin "kb", like the web's (`backend.chat.search`).
"""

import itertools
import json
import math
from collections import Counter
from collections.abc import Sequence
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field

from backend.chat.search import SearchResult
from backend.chat.text import Language, folded_words, wordset

# Below this relevance (`KnowledgeBase.relevance`) a knowledge-base entry shares only a common
# word or two with the question ("Do dentists like listening to music?" → check-ups: 0.2) and is
# neither sent to the model nor shown (setting `kb_min_score`; docs/chat.md, "Knowledge base").
# Real questions score 2.5 ("gums") and up: see tests/test_search_providers.py.
DEFAULT_KB_MIN_SCORE = 2.0


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
