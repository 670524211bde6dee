"""Language detection for a turn: Vietnamese or English, decided once per turn.

Rules, no model: any Vietnamese letter (ă, â, đ, ê, ô, ơ, ư or a tone mark) means Vietnamese;
without accents, common Vietnamese function words ("toi", "khong", "bao nhieu"...) outvote
common English ones. Ties and empty text are English.
"""

from backend.chat.text import Language, folded_words, has_vietnamese_letters, wordset

# Folded Vietnamese words that are not (common) English words.
_VI_WORDS = wordset(
    "toi ban co khong la gi nao nhieu bao nen duoc cua va voi cho nhu thi may hay rat minh em "
    "anh chi lam sao tai vi khi nay do mot hai ba ngay lan bi dau rang nuoc chua hoi muon giup "
    "xin cam on oi nhe vay roi dang se da hang moi tre con"
)
_EN_WORDS = wordset(
    "i you the is are an what how why when should can could does my your to of and in on for "
    "with please tell me it this that which who teeth tooth set turn volume much many often day "
    "brush do than work better ones be a get have has there not if or so at by from was were "
    "will would after before need still too just about like really good bad okay know want "
    "any more they them"
)


def detect_language(text: str) -> Language:
    """`vi` or `en`: Vietnamese letters decide, else which language's common words are more."""
    if has_vietnamese_letters(text):
        return "vi"
    tokens = folded_words(text)
    vi = sum(1 for token in tokens if token in _VI_WORDS)
    en = sum(1 for token in tokens if token in _EN_WORDS)
    return "vi" if vi > en else "en"
