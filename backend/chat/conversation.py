"""A turn read in its conversation: what the rules, the guardrail and retrieval read.

People do not talk in self-contained questions. Before any rule looks at a message it is read
as part of the talk so far (`read_turn`):

1. **What is asked, without the social wrapping** (`focus`): greetings ("Hi,"), introductions
   ("I'm Anna."), names ("my kid Tommy"), politeness ("could you tell me", "please", "ạ") and
   thanks are taken off; they hid the question from retrieval, whose score is the share of the
   question's words an entry holds. Complaints become the command they mean ("it's too loud"
   → "turn the volume down", "không nghe rõ" → "tăng âm lượng lên").
2. **Social turns** ("hello", "thanks", "what can you do") with nothing else asked are their
   own kind (`Reading.social`): answered briefly with what the assistant can do, never refused.
3. **Follow-ups** ("And for children?", "what about at night?", "a bit more", "do it again",
   "còn trẻ em thì sao?") inherit the request they continue: the earlier of the last
   `FOLLOW_WINDOW` user turns that was on topic. A device follow-up becomes a whole command
   ("a bit more" after "turn the volume down" → "turn the volume down"), a question follow-up
   is read together with the question it continues. A follow-up must be short or open with a
   follow-up cue, and every content word of a question follow-up must be known to the
   knowledge base (`known`): "what about the weather?" after a flossing question is not about
   flossing and is still refused.
"""

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from backend.chat.device_state import asked_topics
from backend.chat.lexicon import CONCEPTS, DOWN_WORDS, PRIMARY_CONCEPTS, PhraseMatcher
from backend.chat.text import Language, folded_words, nfc_lower, wordset

Social = Literal["greeting", "thanks", "goodbye", "identity"]
FOLLOW_WINDOW = 3  # user turns looked back at for the request a follow-up continues
_SHORT_FOLLOW_UP = 6  # words: a follow-up without a cue is at most this long
_LONG_FOLLOW_UP = 12  # words: one with a cue or a word pointing back ("it", "her")

_GREETING = (
    r"(?:hi|hello|hey|hiya|howdy|greetings|good\s+(?:morning|afternoon|evening|day)|"
    r"xin\s+chào|chào\s+(?:bạn|em|anh|chị)|chào|alo|a\s+lô|xin\s+chao|chao\s+ban)"
)
_THANKS = (
    r"(?:thanks?(?:\s+you)?(?:\s+(?:so|very)\s+much|\s+a\s+lot)?|thx|ty|cảm\s+ơn|cám\s+ơn|"
    r"cam\s+on)"
)
_GOODBYE = (
    r"(?:bye|bye\s+bye|goodbye|good\s+bye|good\s*night|night|see\s+you(?:\s+later)?|later|"
    r"cheers|tạm\s+biệt|tam\s+biet|chúc\s+ngủ\s+ngon)"
)
_IDENTITY = (
    r"(?:who\s+are\s+you|what\s+are\s+you(?:\s+for)?|what\s+can\s+you\s+do|"
    r"what\s+do\s+you\s+do|help|"
    r"how\s+can\s+you\s+help(?:\s+me)?|bạn\s+là\s+ai|bạn\s+làm\s+được\s+gì|"
    r"bạn\s+giúp\s+(?:được\s+)?gì)"
)
# Letters by case up to the Vietnamese block (U+1EF9): "[À-Ỵ]" would hold lowercase "â" too.
_UPPER = "".join(chr(code) for code in range(0x41, 0x1F00) if chr(code).isupper())
_LOWER = "".join(chr(code) for code in range(0x61, 0x1F00) if chr(code).islower())
_NAME = rf"[{_UPPER}][{_LOWER}'-]*"
_CAPITALISED = re.compile(rf"[{_UPPER}][{_LOWER}]+")
# An introduction: "I'm Anna", "my name is Anna Smith", "this is Bob", "tôi là Lan".
_INTRODUCTION = re.compile(
    rf"\b(?i:i'?m|i\s+am|my\s+name\s+is|my\s+name's|this\s+is|it'?s|tôi\s+là|mình\s+là|"
    rf"em\s+là|tên\s+tôi\s+là|tên\s+mình\s+là)\s+{_NAME}(?:\s+{_NAME})?\s*[.!,]?",
)
# A greeting or thanks opening a sentence, with a name only when a comma or stop follows it
# ("Hi Anna, ..."; in "Hi How often..." the capital is not a name).
_SOCIAL_WORDS = re.compile(
    rf"^(?i:{_GREETING}|{_THANKS}|{_GOODBYE})(?:\s+(?i:there|everyone|again|friend|buddy|"
    rf"bạn|nhé|nha|ạ))*(?:\s+{_NAME}(?=[,.!]))?(?:[\s,.!]+|$)",
)
_POLITE_OPENING = re.compile(
    r"^(?:(?:and\s+)?(?:please|pls|kindly|ok(?:ay)?|so|well|um+|uh+|er+|hmm+)[\s,]+)*"
    r"(?:(?:could|can|would|will)\s+you\s+(?:please\s+)?(?:tell\s+me|let\s+me\s+know|explain)?"
    r"|(?:please\s+)?tell\s+me|i'?d\s+like\s+to\s+know|i\s+want\s+to\s+know|"
    r"i\s+was\s+wondering|i\s+wonder|do\s+you\s+know|i\s+have\s+a\s+question[\s:,]*|"
    r"quick\s+question[\s:,]*|cho\s+(?:tôi|mình|em)\s+hỏi|làm\s+ơn|bạn\s+ơi|"
    r"bạn\s+cho\s+(?:tôi|mình|em)\s+biết)?[\s,:]*",
    re.IGNORECASE,
)
_POLITE_ENDING = re.compile(
    rf"[\s,]*(?:please|pls|thanks?(?:\s+you)?|{_THANKS}|ạ|nhé|nha|nhá|giúp\s+(?:tôi|mình|em))"
    r"?[\s.!?]*$",
    re.IGNORECASE,
)

# Complaints and what they ask for, each language's words in its own form. A screen complaint
# is tried first: "the screen is too dark" is not about the sound.
_COMPLAINT_WORDS: tuple[tuple[str, dict[Language, str]], ...] = (
    (
        r"(?:screen|display).*\btoo\s+(?:bright|glaring)|\btoo\s+bright\b|\bblinding\b|"
        r"hurts?\s+my\s+eyes|chói\s+mắt|"
        r"(?:chói|sáng)\s+quá|quá\s+(?:chói|sáng)",
        {"en": "turn the screen brightness down", "vi": "giảm độ sáng màn hình"},
    ),
    (
        r"(?:screen|display).*\btoo\s+(?:dark|dim)|\btoo\s+(?:dark|dim)\b|"
        r"can'?t\s+see\s+the\s+screen|(?:màn\s+hình).*tối\s+quá|tối\s+quá",
        {"en": "turn the screen brightness up", "vi": "tăng độ sáng màn hình"},
    ),
    (
        r"\btoo\s+loud\b|\bso\s+loud\b|\bway\s+too\s+loud\b|hurts?\s+my\s+ears|"
        r"(?:to|ồn|lớn)\s+quá|quá\s+(?:to|ồn|lớn)",
        {"en": "turn the volume down", "vi": "giảm âm lượng"},
    ),
    (
        r"\btoo\s+(?:quiet|soft|low)\b|\b(?:can'?t|cannot|can\s+not|couldn'?t)\s+hear\b|"
        r"\bhard\s+to\s+hear\b|\bbarely\s+hear\b|\bspeak\s+up\b|\bspeak\s+louder\b|"
        r"(?:nhỏ|bé)\s+quá|quá\s+(?:nhỏ|bé)|không\s+nghe\s+(?:rõ|thấy|được)|khó\s+nghe|"
        r"nghe\s+không\s+(?:rõ|thấy|được)|nói\s+(?:to|lớn)\s+lên",
        {"en": "turn the volume up", "vi": "tăng âm lượng lên"},
    ),
)
_COMPLAINTS = tuple(
    (re.compile(pattern, re.IGNORECASE), said) for pattern, said in _COMPLAINT_WORDS
)

# Follow-up cues: an opening that continues the talk, and device continuations.
_FOLLOW_OPENING = re.compile(
    r"^(?:and|also|but|so|what\s+about|how\s+about|and\s+what\s+about|what\s+if|same\s+for|"
    r"is\s+that|is\s+it|does\s+that|does\s+it|còn|thế\s+còn|vậy\s+còn|vậy|thế|và)\b",
    re.IGNORECASE,
)
_FOLLOW_ENDING = re.compile(r"(?:thì\s+sao|thì\s+thế\s+nào|thì\s+sao\s+ạ)\s*[?.!]*$")
_AGAIN = re.compile(
    r"^(?:(?:please|ok(?:ay)?|now)\s+)?(?:do\s+(?:it|that)\s+again|again|once\s+more|"
    r"one\s+more\s+time|repeat\s+(?:it|that)|same\s+again|làm\s+lại|lần\s+nữa|"
    r"làm\s+lần\s+nữa|thêm\s+lần\s+nữa)(?:\s+(?:please|nhé|đi|ạ))?[\s.!?]*$",
    re.IGNORECASE,
)
_MORE = re.compile(
    r"^(?:(?:a\s+)?(?:(?:little|tiny|bit|little\s+bit|touch)\s+)*(?:bit\s+)?"
    r"(?:more|higher|louder|brighter|further|up)|even\s+(?:more|higher|louder|brighter)|"
    r"more|thêm\s+(?:chút|tí|một\s+chút)?\s*(?:nữa)?|to\s+(?:hơn\s+)?(?:nữa|chút)|"
    r"cao\s+hơn(?:\s+nữa)?|nữa)(?:\s+(?:please|nhé|đi|ạ|than\s+that))?[\s.!?]*$",
    re.IGNORECASE,
)
_LESS = re.compile(
    r"^(?:(?:a\s+)?(?:(?:little|tiny|bit|little\s+bit|touch)\s+)*(?:bit\s+)?"
    r"(?:less|lower|quieter|softer|dimmer|down)|even\s+(?:less|lower|quieter|dimmer)|"
    r"bớt\s+(?:chút|tí|một\s+chút)?\s*(?:nữa)?|nhỏ\s+hơn(?:\s+nữa)?|thấp\s+hơn(?:\s+nữa)?)"
    r"(?:\s+(?:please|nhé|đi|ạ|than\s+that))?[\s.!?]*$",
    re.IGNORECASE,
)
_EXPLICIT_STEP = re.compile(
    r"^(tăng|giảm|bớt|nhỏ|to|lớn)\s+(?:thêm\s+)?(?:chút|tí|một\s+chút)?\s*(?:nữa)?[\s.!?]*$",
    re.IGNORECASE,
)
_STEP_COMMAND = {
    ("volume", "up"): {"en": "turn the volume up", "vi": "tăng âm lượng lên"},
    ("volume", "down"): {"en": "turn the volume down", "vi": "giảm âm lượng xuống"},
    ("brightness", "up"): {"en": "turn the screen brightness up", "vi": "tăng độ sáng lên"},
    ("brightness", "down"): {"en": "turn the screen brightness down", "vi": "giảm độ sáng xuống"},
}
_SWITCH_OR_STEP = re.compile(
    # "on"/"off" only at the end ("turn it off again"): "trending on netflix" is no switch
    r"\b(?:on|off)(?=(?:\s+(?:again|please|now|for\s+me))*[\s.!?]*$)|"
    r"\b(?:up|down|higher|lower|louder|quieter|brighter|dimmer|bật|tắt|tăng|giảm|"
    r"lên|xuống|back\s+to|dark|light|sáng|tối)\b",
    re.IGNORECASE,
)
_CONCEPT_WORD: dict[str, dict[Language, str]] = {
    "volume": {"en": "volume", "vi": "âm lượng"},
    "brightness": {"en": "brightness", "vi": "độ sáng"},
    "theme": {"en": "theme", "vi": "giao diện"},
    "led": {"en": "LED", "vi": "đèn"},
    "status": {"en": "status", "vi": "trạng thái"},
    "reboot": {"en": "reboot", "vi": "khởi động lại"},
}
_WORD = re.compile(r"\w+")
_THEME_VALUE = re.compile(r"\b(light|dark|sáng|tối)\b", re.IGNORECASE)
_THEME_COMMAND = {
    "light": {"en": "switch to the light theme", "vi": "chuyển sang giao diện sáng"},
    "dark": {"en": "switch to the dark theme", "vi": "chuyển sang giao diện tối"},
}
_FILLER = re.compile(
    r"^(?:(?:ok(?:ay)?|haha+|lol|well|so|then|alright|fine|whatever|cool|great|nice|ừ|ừm|"
    r"dạ|vâng|ok\s+then)[\s,.!]+)+"
)
_down = PhraseMatcher(DOWN_WORDS)
_levels = {concept: PhraseMatcher(CONCEPTS[concept]) for concept in ("volume", "brightness")}
_devices = {concept: PhraseMatcher(CONCEPTS[concept]) for concept in PRIMARY_CONCEPTS}
# Words a follow-up may hold that say nothing of its topic.
_GENERIC = wordset(
    "and also but so what about how if same for is it that this those them they do does "
    "the a an to of in at on with my our your his her their i me we you should can "
    "could would will much many often long old when why where which who question then "
    "too ok okay please thanks really also still again more less little bit one ones "
    "normal serious bad good safe dangerous fine worse better painful hurt cost "
    "expensive take takes work works help helps stop prevent cause causes treat cure "
    "fix avoid there any way get need it's is are was do did does what's how's con thi "
    "sao the nao va vay con cua toi minh ban co khong nhu nao nhe a"
)


# Words that point back at what was said: "How long does it take?", "what can I give her?".
_POINTING = wordset("it its that this they them their she her he him his nó đó đấy vậy")
# Topics a dental assistant is asked about by mistake: a follow-up naming one of them is not
# about the earlier question ("and what about the weather?"), however it opens.
_ELSEWHERE = PhraseMatcher(
    [
        *wordset(
            "weather rain snow sunny forecast football soccer match game games score team "
            "league basketball tennis election elections president politics government vote "
            "stock stocks market bitcoin crypto bank movie movies film films song songs music "
            "singer actor actress celebrity news recipe cooking restaurant travel flight hotel "
            "holiday coding python javascript program programming computer traffic joke jokes "
            "cook dinner netflix youtube tiktok leg legs knee arm foot"
        ),
        *("thời tiết", "trời mưa", "có mưa", "bóng đá", "trận đấu", "trận bóng", "chứng khoán"),
        *("giá vàng", "bộ phim", "xem phim", "bài hát", "tin tức", "nấu ăn", "món ăn"),
        *("du lịch", "chính trị", "bầu cử", "lập trình", "poem", "nấu", "phở"),
    ]
)


@dataclass(frozen=True, slots=True)
class Reading:
    """A message as the rules read it. `text`: the request on its own (the message itself
    when it needs nothing from the talk before); `social`: a greeting, thanks, goodbye or
    "what can you do" with nothing else asked; `follows`: the earlier request it continues."""

    text: str
    social: Social | None = None
    follows: str | None = None
    own: str = ""  # a follow-up's own words ("for children"): what retrieval stresses
    # False: a follow-up only by a word pointing back ("can I take painkillers and wait it
    # out?"), which a guardrail model, when there is one, judges with the earlier turns.
    sure: bool = True


def read_turn(
    message: str,
    earlier: Sequence[str],
    language: Language,
    *,
    on_topic: Callable[[str], bool],
    known: Callable[[str], bool],
) -> Reading:
    """`message` read in its conversation. `earlier`: the user's earlier messages, oldest
    first; `on_topic`: whether a text is a dental question or a request for the device by
    itself; `known`: whether the knowledge base knows a (folded) word."""
    text = focus(message, language, known)
    if not text:
        social = social_kind(message)
        return Reading(message, social or "greeting")
    if on_topic(text):
        return Reading(text)
    previous = _last_on_topic(earlier, language, on_topic, known)
    continued = None if previous is None else _continued(text, previous, language, known)
    if continued is not None:
        sure = _sure_follow_up(text, known)
        return Reading(continued, follows=previous, own=text, sure=sure)
    # "Thanks, that's really helpful!", "Hi, I'm Priya and I'm five months pregnant.": opened
    # with a greeting or thanks, and nothing after it is a question for the assistant.
    social = social_kind(text) or social_kind(message)
    if social is None and not _ASKS.search(text):
        social = _opening_kind(message)  # never "Hi! Write me a poem": that asks something
    if social is not None:
        return Reading(text, social)
    return Reading(text)


# A question or a request: a social opening before one does not make the message social.
_ASKS = re.compile(
    r"\?|\b(?:what|what's|how|why|who|when|where|which|can|could|would|will|tell|write|give|"
    r"show|make|explain|find|help|gì|sao|nào|không|được không|cho tôi|giúp)\b",
    re.IGNORECASE,
)


def _nothing_known(_word: str) -> bool:
    return False


def focus(message: str, language: Language, known: Callable[[str], bool] = _nothing_known) -> str:
    """The request without greetings, introductions, names, politeness, thanks and filler; a
    complaint as the command it means. Empty when nothing else was said."""
    kept: list[str] = []
    for sentence in re.split(r"(?<=[.!?])\s+", message.strip()):
        asked = sentence.rstrip().endswith("?")
        sentence = _INTRODUCTION.sub(" ", sentence)
        sentence = _SOCIAL_WORDS.sub("", sentence.strip())
        sentence = _POLITE_OPENING.sub("", sentence.strip())
        sentence = _POLITE_ENDING.sub("", sentence.strip())
        sentence = _without_names(sentence.strip(" ,"), known).rstrip(" ,.!?")
        if re.search(r"\w", sentence):
            kept.append(sentence + ("?" if asked else ""))
    text = " ".join(kept).strip()
    return _complaint(text, language) or text


def social_kind(text: str) -> Social | None:
    """What kind of social turn a text is, when it is nothing else."""
    said = nfc_lower(text).strip(" .!?,")
    said = re.sub(r"\s+", " ", said)
    said = _FILLER.sub("", said).strip(" .!?,")  # "ok then what can you do", "haha ok bye"
    said = re.sub(r"[\s,]+then$", "", said)
    for kind, pattern in (
        ("thanks", _THANKS),
        ("goodbye", _GOODBYE),
        ("identity", _IDENTITY),
        ("greeting", _GREETING),
    ):
        if re.fullmatch(rf"(?:{pattern})(?:[\s,.!?]+\w+)?", said):
            return kind  # type: ignore[return-value]
    return None


def _opening_kind(message: str) -> Social | None:
    """The kind of the greeting or thanks a message opens with, if any."""
    opening = _SOCIAL_WORDS.match(message.strip())
    return social_kind(opening.group(0)) if opening and opening.group(0).strip() else None


def _without_names(sentence: str, known: Callable[[str], bool]) -> str:
    """The sentence without capitalised words after its first that no rule or entry knows
    (names: "my kid Tommy"); acronyms ("LED") and known words ("Invisalign") stay."""
    words = sentence.split(" ")
    kept = words[:1]
    for word in words[1:]:
        bare = word.strip(",.!?;:")
        if _CAPITALISED.fullmatch(bare) and not known(bare.lower()):
            if word != bare and kept:
                kept[-1] += word[len(word.rstrip(",.!?;:")) :]  # keep the punctuation
            continue
        kept.append(word)
    return " ".join(kept)


def _complaint(text: str, language: Language) -> str | None:
    for pattern, said in _COMPLAINTS:
        if pattern.search(text):
            return said[language]
    return None


def _last_on_topic(
    earlier: Sequence[str],
    language: Language,
    on_topic: Callable[[str], bool],
    known: Callable[[str], bool],
) -> str | None:
    """The latest of the last `FOLLOW_WINDOW` user turns that was on topic, as it was read:
    a follow-up as the request it made ("do that again" after "lower it" repeats the
    volume step "lower it" was)."""
    last: str | None = None
    recent = list(earlier)[-FOLLOW_WINDOW:]
    for age, message in enumerate(reversed(recent)):
        text = focus(message, language, known)
        if text and on_topic(text):
            last = text
            start = len(recent) - age
            break
    if last is None:
        return None
    for message in recent[start:]:  # none of these was on topic alone: maybe as follow-ups
        text = focus(message, language, known)
        continued = _continued(text, last, language, known) if text else None
        if continued is not None and on_topic(continued):
            last = continued
    return last


def _continued(
    text: str, previous: str, language: Language, known: Callable[[str], bool]
) -> str | None:
    """The follow-up `text` as a request on its own, or None when it is no follow-up of
    `previous`."""
    level = next((c for c, matcher in _levels.items() if matcher.find(previous)), None)
    if _AGAIN.match(text):
        return previous
    said = _EXPLICIT_STEP.match(text)
    if level is not None and (said or _MORE.match(text) or _LESS.match(text)):
        down = bool(_down.find(previous)) if _MORE.match(text) else True
        if said:  # "tăng thêm chút nữa", "turn it up a bit more": the direction is said
            down = said.group(1).lower() in ("giảm", "bớt", "nhỏ")
        return _STEP_COMMAND[(level, "down" if down else "up")][language]
    if _ELSEWHERE.find(text):
        return None  # "and who won the match?": another topic, named
    named = [concept for concept, matcher in _devices.items() if matcher.find(previous)]
    pointing = bool(_POINTING.intersection(_WORD.findall(nfc_lower(text))))
    commands = bool(_SWITCH_OR_STEP.search(text) or re.search(r"\d", text))
    asks = (
        bool(named) and pointing and _is_question_of(f"{text} {_CONCEPT_WORD[named[0]][language]}?")
    )
    theme = _THEME_VALUE.search(text) if "theme" in named else None
    if theme is not None:  # "put it back to light" after a theme change: not the LED
        value = "light" if theme.group(1).lower() in ("light", "sáng") else "dark"
        return _THEME_COMMAND[value][language]
    if named and (commands or asks):
        # "turn it off again" after "switch the LED on", "make it 55" after "and the
        # volume?": the command, with the thing named.
        return f"{text} ({_CONCEPT_WORD[named[0]][language]})"
    if named and not _is_question_of(previous):
        return None  # a device command is continued only by the words above
    cued = _cued(text)
    words = folded_words(text)
    if len(words) > (_LONG_FOLLOW_UP if cued or pointing else _SHORT_FOLLOW_UP):
        return None
    content = [word for word in words if word not in _GENERIC]
    if not content and not (cued or pointing):
        return None
    if _ELSEWHERE.find(text):
        return None  # "and who won the match?": another topic, named
    unknown = sum(1 for word in content if not known(word))
    if language == "vi" and not (cued or pointing):
        return None  # a Vietnamese syllable is known to the entries whatever the topic
    if unknown > (2 if pointing else 1 if cued else 0):
        return None  # "and what should I cook for dinner?": its own topic, unknown here
    return f"{previous.rstrip(' ?.!')}? {text}"


def _cued(text: str) -> bool:
    return bool(_FOLLOW_OPENING.match(text) or _FOLLOW_ENDING.search(nfc_lower(text)))


def _sure_follow_up(text: str, known: Callable[[str], bool]) -> bool:
    """A follow-up by its opening ("and for children?") or whose words the knowledge base
    holds, rather than one only pointing back at the talk ("wait it out?")."""
    content = [word for word in folded_words(text) if word not in _GENERIC]
    return _cued(text) or all(known(word) for word in content)


def _is_question_of(text: str) -> bool:
    """Whether a device request was a question about its state ("what is the volume?"), not
    a command asked politely ("can you switch the LED on?")."""
    return bool(asked_topics(text, questioned=text.rstrip().endswith("?")))
