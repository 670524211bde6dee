"""Small text helpers shared by the chat pipeline: accent folding, tokens, sentences.

Vietnamese is matched accent-insensitively where it is safe: `fold("Đánh răng")` is
`"danh rang"` (NFD, combining marks dropped, đ→d). Single folded syllables are ambiguous
(`rang` is răng "tooth" but also rằng "that"), so matchers that fold keep multi-syllable phrases.
"""

import re
import unicodedata
from typing import Literal

Language = Literal["vi", "en"]

_WORD = re.compile(r"[0-9a-zà-ỹđ]+", re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<=[.!?…])\s+|\n+")
# Vietnamese letters that English text never has (NFC, lower case).
_VI_LETTERS = frozenset("ăâđêôơưàáảãạằắẳẵặầấẩẫậèéẻẽẹềếểễệìíỉĩịòóỏõọồốổỗộờớởỡợùúủũụừứửữựỳýỷỹỵ")


def fold(text: str) -> str:
    """Lower case without accents: NFD, combining marks removed, đ→d."""
    decomposed = unicodedata.normalize("NFD", text.lower())
    stripped = "".join(char for char in decomposed if not unicodedata.combining(char))
    return stripped.replace("đ", "d")


def nfc_lower(text: str) -> str:
    return unicodedata.normalize("NFC", text).lower()


def words(text: str) -> list[str]:
    """Lower-case word tokens of NFC text (accents kept)."""
    return _WORD.findall(nfc_lower(text))


def folded_words(text: str) -> list[str]:
    return _WORD.findall(fold(text))


def has_vietnamese_letters(text: str) -> bool:
    return any(char in _VI_LETTERS for char in nfc_lower(text))


def sentences(text: str) -> list[str]:
    """Split prose into sentences (good enough for extractive answers and summaries)."""
    parts = (part.strip() for part in _SENTENCE_END.split(text))
    return [part for part in parts if part]


def clip(text: str, limit: int) -> str:
    """At most `limit` characters, cut at a word boundary, with an ellipsis when cut."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:") + "…"


def wordset(text: str) -> frozenset[str]:
    """A set of the space-separated words in `text` (for compact word lists)."""
    return frozenset(text.split())
