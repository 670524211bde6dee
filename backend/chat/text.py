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
# Not after "e.g.", "i.e.", "vs.", "Dr.": a sentence cut there is spoken as two, with a pause.
NOT_AN_END = r"(?<!\b[Ee]\.[Gg]\.)(?<!\b[Ii]\.[Ee]\.)(?<!\b[Vv]s\.)(?<!\bDr\.)"
_SENTENCE_END = re.compile(rf"(?<=[.!?…]){NOT_AN_END}\s+|\n+")
# Vietnamese letters that English text never has (NFC, lower case).
_VI_LETTERS = frozenset("ăâđêôơưàáảãạằắẳẵặầấẩẫậèéẻẽẹềếểễệìíỉĩịòóỏõọồốổỗộờớởỡợùúủũụừứửữựỳýỷỹỵ")


def fold(text: str) -> str:
    """Lower case without accents: NFD, combining marks removed, đ→d."""
    decomposed = unicodedata.normalize("NFD", text.lower())
    stripped = "".join(char for char in decomposed if not unicodedata.combining(char))
    return stripped.replace("đ", "d")


def nfc_lower(text: str) -> str:
    """The text NFC-normalized and lowercased (accents kept)."""
    return unicodedata.normalize("NFC", text).lower()


def words(text: str) -> list[str]:
    """Lower-case word tokens of NFC text (accents kept)."""
    return _WORD.findall(nfc_lower(text))


def folded_words(text: str) -> list[str]:
    """The words of the text with accents folded away."""
    return _WORD.findall(fold(text))


def has_vietnamese_letters(text: str) -> bool:
    """Whether the text has a Vietnamese letter (ă, â, đ, ê, ô, ơ, ư or a toned vowel)."""
    return any(char in _VI_LETTERS for char in nfc_lower(text))


def sentences(text: str) -> list[str]:
    """Split prose into sentences (good enough for extractive answers and summaries)."""
    parts = (part.strip() for part in _SENTENCE_END.split(text))
    return [part for part in parts if part]


def wordset(text: str) -> frozenset[str]:
    """A set of the space-separated words in `text` (for compact word lists)."""
    return frozenset(text.split())


# ---- text at the edge -------------------------------------------------------------------------

# A str from json.loads can hold lone surrogates ("\ud800"): not Unicode text, and nothing that
# encodes to UTF-8 (SQLite, the model's HTTP client, a device's WebSocket) can take them.
_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"
ELLIPSIS = "…"


def first_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text`, or None when it is valid Unicode."""
    found = _SURROGATE.search(text)
    return found.start() if found is not None else None


def replace_surrogates(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD (for text a device sent)."""
    return _SURROGATE.sub(REPLACEMENT, text)


# ---- the conversation summary's bound -----------------------------------------------------------


def estimated_tokens(text: str) -> int:
    """An upper estimate of a tokenizer's count: UTF-8 bytes / 3, rounded up. English runs at
    about 4 bytes a token, CJK at 3 bytes a character and at most one token each, Vietnamese in
    between, so this over-counts rather than under-counts for the model's context."""
    return -(-len(text.encode("utf-8", "replace")) // 3)


def bounded_summary(summary: str, max_chars: int, max_tokens: int) -> str:
    """The newest part of an accumulated summary that fits both bounds: whole paragraphs
    (pieces are joined by a blank line) dropped from the front, and a single piece longer
    than the bound cut to its end."""

    def fits(text: str) -> bool:
        return len(text) <= max_chars and estimated_tokens(text) <= max_tokens

    if fits(summary):
        return summary
    pieces = summary.split("\n\n")
    kept: list[str] = []
    for piece in reversed(pieces):
        candidate = "\n\n".join([piece, *kept])
        if not fits(candidate):
            break
        kept.insert(0, piece)
    if kept:
        return "\n\n".join(kept)
    return _tail(pieces[-1], max_chars, max_tokens)


def _tail(text: str, max_chars: int, max_tokens: int) -> str:
    """The end of `text` behind an ellipsis, within both bounds (the ellipsis counted)."""
    budget = max_tokens * 3 - len(ELLIPSIS.encode())
    size = 0
    start = len(text)
    while start > 0 and len(text) - start < max_chars - 1:
        size += len(text[start - 1].encode("utf-8", "replace"))
        if size > budget:
            break
        start -= 1
    return ELLIPSIS + text[start:].lstrip() if start < len(text) else ""
