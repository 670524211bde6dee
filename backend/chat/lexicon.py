"""Word lists for the rule-based parts of the pipeline (guardrail, offline intent detection).

Vietnamese entries are written with accents. `PhraseMatcher` matches them accented against
accented text; against text typed without accents it matches only their folded forms of two or
more syllables (a folded single syllable is ambiguous: "rang" is răng "tooth" and rằng "that").
Longer phrases win: "giao diện sáng" is the theme, not "sáng" (light).
"""

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from backend.chat.text import fold, has_vietnamese_letters, nfc_lower

# ---- the dental domain ------------------------------------------------------------------------

_DENTAL_WORDS = (
    "tooth teeth toothache dental dentist dentistry gum gums gingivitis periodontitis "
    "periodontal floss flossing toothpaste toothbrush cavity cavities caries enamel plaque tartar "
    "braces brace orthodontic orthodontics orthodontist aligners implant implants molar molars "
    "mouthwash halitosis whitening fluoride oral abscess teething dentures denture bruxism jaw "
    "mouth tongue incisor incisors retainer brush brushing brushed filling fillings crown crowns "
    "veneer veneers hygienist checkup check-up mouthguard sealant sealants canker cleaning "
    "extraction invisalign"
)
DENTAL_PHRASES = [
    *_DENTAL_WORDS.split(),
    "bad breath",
    "wisdom tooth",
    "wisdom teeth",
    "root canal",
    "teeth grinding",
    "mouth ulcer",
    "dry mouth",
    "false teeth",
    # Vietnamese
    "răng",
    "nướu",
    "viêm lợi",
    "chảy máu lợi",
    "sưng lợi",
    "tụt lợi",
    "lợi bị",
    "nha khoa",
    "nha sĩ",
    "nha chu",
    "chỉ nha khoa",
    "kem đánh răng",
    "chải răng",
    "bàn chải",
    "hôi miệng",
    "khô miệng",
    "nhiệt miệng",
    "loét miệng",
    "răng miệng",
    "niềng",
    "chỉnh nha",
    "mắc cài",
    "implant",
    "trám",
    "cao răng",
    "vôi răng",
    "tủy răng",
    "chữa tủy",
    "áp xe",
    "ê buốt",
    "xương hàm",
    "trám răng",
    "hàn răng",
    "nhổ răng",
    "bọc răng",
    "lấy cao răng",
    "lợi",
    "nhổ",
    "hàm răng",
    "lưỡi",
    "fluor",
    "nước súc miệng",
    "súc miệng",
    # Vietnamese typed without accents (folded, two syllables or more)
    "danh rang",
    "sau rang",
    "dau rang",
    "nhuc rang",
    "rang khon",
    "chan rang",
    "rang sua",
    "rang gia",
    "nho rang",
    "trong rang",
    "trang rang",
    "e rang",
    "e buot",
    "hoi mieng",
    "viem nuou",
    "viem loi",
    "chay mau loi",
    "nieng rang",
    "nha khoa",
    "nha si",
    "cao rang",
    "voi rang",
    "kham rang",
    "rang mieng",
    "tay trang",
    "nghien rang",
    "nho rang",
    "tram rang",
    "han rang",
]


# Dental words with common meanings outside dentistry ("paint brush", "cavity wall", "plaque in
# the arteries", "chewing gum", "breast implants"). A request whose only dental words are these
# is for the guardrail model to judge; with no model to ask (offline) it passes.
AMBIGUOUS_DENTAL = frozenset(
    {
        *("gum", "gums", "cavity", "cavities", "plaque", "enamel", "tartar", "braces", "brace"),
        *("implant", "implants", "whitening", "oral", "abscess", "jaw", "mouth", "tongue"),
        *("retainer", "brush", "brushing", "brushed", "molar", "molars", "lưỡi", "trám"),
        *("fluor", "áp xe", "bàn chải", "ap xe", "ban chai", "filling", "fillings", "crown"),
        *("lợi", "nhổ"),
        *("crowns", "cleaning", "extraction", "veneer", "veneers", "sealant", "sealants"),
    }
)


# ---- device controls --------------------------------------------------------------------------

# concept -> phrases (both languages). "screen" is a weak concept shared by several tools.
CONCEPTS: Mapping[str, tuple[str, ...]] = {
    "volume": (
        "âm lượng",
        "volume",
        "loa",
        "speaker",
        "tiếng",
        "sound",
        "louder",
        "quieter",
        "to hơn",
        "nhỏ hơn",
        "vặn to",
        "vặn nhỏ",
        "audio",
        "mute",
        "unmute",
        "tắt tiếng",
        "am luong",
        # "it" is the sound more often than anything else a voice device has.
        "turn it up",
        "turn it down",
    ),
    "brightness": (
        "độ sáng",
        "brightness",
        "backlight",
        "sáng hơn",
        "tối hơn",
        "dim",
        "dimmer",
        "brighter",
        "darker",
        "do sang",
    ),
    "theme": (
        "giao diện",
        "theme",
        "chế độ tối",
        "chế độ sáng",
        "dark mode",
        "light mode",
        "nền tối",
        "nền sáng",
        "dark theme",
        "light theme",
        "che do toi",
        "che do sang",
        "giao dien",
        "night mode",
    ),
    "led": ("đèn", "led", "light", "lights", "lamp", "bóng đèn", "den led", "bat den", "tat den"),
    "status": (
        "trạng thái",
        "status",
        "tình trạng thiết bị",
        "device state",
        "trang thai",
    ),
    "screen": ("màn hình", "screen", "display", "man hinh"),
    "reboot": ("reboot", "restart", "khởi động lại", "khoi dong lai", "power cycle"),
}
PRIMARY_CONCEPTS = frozenset({"volume", "brightness", "theme", "led", "status", "reboot"})

ON_WORDS = (
    "bật",
    "mở",
    "on",
    "turn on",
    "switch on",
    "enable",
    "bat",
    "mo",
    "bật lên",
    "bật đèn",
)
OFF_WORDS = ("tắt", "off", "turn off", "switch off", "disable", "tat", "tắt đi", "tắt đèn")
ACTION_WORDS = (
    "set",
    "đặt",
    "chỉnh",
    "điều chỉnh",
    "bật",
    "tắt",
    "tăng",
    "giảm",
    "vặn",
    "change",
    "turn",
    "switch",
    "make",
    "mở",
    "đổi",
    "chuyển",
    "put",
    "increase",
    "decrease",
    "raise",
    "lower",
    "adjust",
    "mute",
    "unmute",
    "enable",
    "disable",
    "dat",
    "chinh",
    "bat",
    "tat",
    "tang",
    "giam",
    "doi",
    "chuyen",
    "mức",
    "level",
    "check",
    "kiểm tra",
    "cho biết",
    "reboot",
    "restart",
    "khởi động lại",
    "khoi dong lai",
)
# A level raised or lowered by a step, when no value is said ("turn it up", "tăng âm lượng
# lên"): offline mode moves it by `offline.LEVEL_STEP` from where the device says it is.
UP_WORDS = (
    "up",
    "lên",
    "tăng",
    "tang",
    "louder",
    "to hơn",
    "vặn to",
    "increase",
    "raise",
    "higher",
    "brighter",
    "sáng hơn",
    "more",
)
DOWN_WORDS = (
    "down",
    "xuống",
    "giảm",
    "giam",
    "quieter",
    "nhỏ hơn",
    "vặn nhỏ",
    "decrease",
    "lower",
    "dimmer",
    "dim",
    "darker",
    "tối hơn",
    "less",
)
MAX_WORDS = ("tối đa", "max", "maximum", "full", "hết cỡ", "to nhất", "cao nhất", "toi da")
MIN_WORDS = ("tối thiểu", "min", "minimum", "thấp nhất", "nhỏ nhất", "toi thieu")
MUTE_WORDS = ("mute", "tắt tiếng", "im lặng", "tat tieng")
# Values of enumerated string arguments: canonical value -> words that mean it.
VALUE_SYNONYMS: Mapping[str, tuple[str, ...]] = {
    # Accented only: folded "sang" is also "sang" (towards), "toi" is also "tôi" (I).
    "dark": ("dark", "tối", "đen", "night", "ban đêm"),
    "light": ("light", "sáng", "trắng", "day", "ban ngày"),
}
# How a canonical value is said back in Vietnamese ("Đã đổi sang giao diện tối").
VALUE_NAMES_VI: Mapping[str, str] = {"dark": "tối", "light": "sáng"}

# ---- questions about the device's state (backend/chat/device_state.py) -----------------------

# topic -> phrases. "sound" and "tiếng" are left out: "the speed of sound", "bao nhiêu tiếng"
# (how many hours) are not about the speaker.
STATE_TOPICS: Mapping[str, tuple[str, ...]] = {
    "volume": ("volume", "loud", "loudness", "speaker", "âm lượng", "am luong", "loa"),
    "brightness": ("brightness", "bright", "backlight", "độ sáng", "do sang"),
    "theme": (
        *("theme", "dark mode", "light mode", "night mode", "giao diện", "giao dien"),
        *("chế độ tối", "chế độ sáng", "che do toi", "che do sang"),
    ),
    "led": ("led", "leds", "đèn", "bóng đèn", "den led"),
    # English "light" is the LED only beside on/off ("is the light on"; not "speed of light").
    "light": ("light", "lights", "lamp"),
    # Not "charge": "how much do you charge" is about money.
    "battery": ("battery", "charging", "pin", "sạc", "dung lượng pin"),
    "network": (
        *("network", "wifi", "wi-fi", "wi fi", "internet", "connected", "connection", "online"),
        *("signal", "mạng", "kết nối", "ket noi", "sóng", "sóng wifi"),
    ),
    "firmware": (
        *("firmware", "version", "software", "phiên bản", "phien ban", "phần mềm", "phan mem"),
    ),
    # The firmware from a system information tool; the status as a whole without one.
    "system": ("system info", "system information", "thông tin hệ thống", "thong tin he thong"),
    "temperature": ("temperature", "how hot", "nhiệt độ", "nhiet do"),
    "screen": ("screen", "display", "màn hình", "man hinh"),
    "status": (
        *("status", "state", "settings", "trạng thái", "tình trạng", "trang thai"),
        *("tinh trang", "cài đặt"),
    ),
}
# Words that make a clause a question (anywhere in it); "is/are/does..." only open one.
QUESTION_WORDS = (
    *("what", "what's", "whats", "how", "which", "tell me", "check", "show me", "current"),
    *("currently", "do you know", "report", "bao nhiêu", "mấy", "thế nào", "như thế nào"),
    *("ra sao", "gì", "nào", "hiện tại", "hiện giờ", "bây giờ", "kiểm tra", "cho biết", "xem"),
    *("bao nhieu", "the nao", "hien tai", "hien gio", "bay gio", "kiem tra", "cho biet"),
)
# A Vietnamese yes/no question ends with one of these ("đèn có bật không"): then bật/tắt name
# the state asked about, not a change.
YES_NO_ENDINGS = ("không", "chưa", "à", "hả", "nhỉ", "hay không", "phải không")
# A clause with one of these asks for a change, not a state, whatever else it says.
CHANGE_WORDS = (
    *("set", "turn", "switch", "make", "change", "put", "increase", "decrease", "raise"),
    *("lower", "adjust", "mute", "unmute", "enable", "disable", "dim", "đặt", "chỉnh"),
    *("điều chỉnh", "tăng", "giảm", "vặn", "đổi", "chuyển", "dat", "chinh", "tang", "giam"),
    *("doi", "chuyen", "reboot", "restart", "khởi động lại"),
)
SWITCH_WORDS_VI = ("bật", "tắt", "mở", "bat", "tat")  # changes unless in a yes/no question
CLAUSE_SPLIT = re.compile(
    r"\s*(?:[;?!]|,\s*(?:and|then|và|rồi|sau đó)\s+|,\s+|\s+(?:and then|and|then|also|"
    r"và|rồi|sau đó|đồng thời|with|plus)\s+)\s*",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class Hit:
    """One phrase found in a text, at `start:end` of the text as matched."""

    phrase: str
    start: int
    end: int


class PhraseMatcher:
    """Finds phrases as whole words, longest first, each span used once."""

    def __init__(self, phrases: Iterable[str]) -> None:
        accented = sorted({nfc_lower(p) for p in phrases}, key=lambda p: (-len(p), p))
        self._accented = [(p, _pattern(p)) for p in accented]
        folded = sorted(
            {fold(p) for p in accented if len(fold(p).split()) >= 2 or fold(p) == nfc_lower(p)},
            key=lambda p: (-len(p), p),
        )
        self._folded = [(p, _pattern(p)) for p in folded]
        # The phrases by their first word: only those whose first word the text holds are
        # scanned for (most texts hold none of a list's phrases).
        self._by_first_accented = _by_first_word(self._accented)
        self._by_first_folded = _by_first_word(self._folded)

    def find(self, text: str) -> list[Hit]:
        """The phrases in `text`, longest first where they overlap, in linear time."""
        accented, subject, tokens = _subject(text)
        table = self._accented if accented else self._folded
        by_first = self._by_first_accented if accented else self._by_first_folded
        candidates = sorted({i for token in tokens for i in by_first.get(token, ())})
        if not candidates:
            return []
        taken = bytearray(len(subject))  # 1 where a longer phrase already matched: linear time
        hits: list[Hit] = []
        for phrase, pattern in (table[i] for i in candidates):  # still longest first
            for match in pattern.finditer(subject):
                start, end = match.span()
                if taken.find(1, start, end) != -1:
                    continue
                taken[start:end] = b"\x01" * (end - start)
                hits.append(Hit(phrase, start, end))
        hits.sort(key=lambda hit: hit.start)
        return hits


def longest_matches(matchers: Mapping[str, PhraseMatcher], text: str) -> set[str]:
    """The keys whose phrases a text has; where phrases of two keys overlap, the longest wins
    ("light mode" is the theme, not the light)."""
    spans: list[tuple[int, int, int, str]] = []
    for key, matcher in matchers.items():
        for hit in matcher.find(text):
            spans.append((hit.start, hit.end, hit.end - hit.start, key))
    spans.sort(key=lambda span: (-span[2], span[0]))
    taken: list[tuple[int, int]] = []
    found: set[str] = set()
    for start, end, _length, key in spans:
        if any(start < other_end and other_start < end for other_start, other_end in taken):
            continue
        taken.append((start, end))
        found.add(key)
    return found


@functools.lru_cache(maxsize=256)
def _subject(text: str) -> tuple[bool, str, frozenset[str]]:
    """Whether the text is written with Vietnamese letters; the text as matched (lowered, or
    folded too when typed without accents); its words, and each without a plural "s" (as
    `_pattern` matches them). Cached: a turn's rules read the same text with forty matchers."""
    accented = has_vietnamese_letters(text)
    subject = nfc_lower(text) if accented else fold(text)
    tokens = _WORD.findall(subject)
    singular = [token[:-1] for token in tokens if token.endswith("s")]
    singular += [token[:-2] for token in tokens if token.endswith("es")]
    return accented, subject, frozenset((*tokens, *singular))


_WORD = re.compile(r"\w+")


def _by_first_word(table: list[tuple[str, re.Pattern[str]]]) -> dict[str, tuple[int, ...]]:
    index: dict[str, list[int]] = {}
    for position, (phrase, _pattern) in enumerate(table):
        words = _WORD.findall(phrase)
        if words:
            index.setdefault(words[0], []).append(position)
    return {word: tuple(positions) for word, positions in index.items()}


def _pattern(phrase: str) -> re.Pattern[str]:
    body = r"\s+".join(re.escape(part) for part in phrase.split())
    return re.compile(rf"(?<![\w]){body}(?:e?s)?(?![\w])")
