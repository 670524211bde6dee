"""The words a device's users say, as a prompt for the recognizer, and numbers as digits.

Whisper reads a prompt as the text that came before the utterance: words in it are heard more
readily, and its style is followed (digits, not number words). The prompt is built from the
device's tools (what each acts on, its values and choices), the offline router's command words
for the same things (backend/chat/lexicon.py) and the dental knowledge base's terms
(backend/chat/data). `spoken_numbers_to_digits` turns number words that slip through into
digits, which the router reads.
"""

import json
import re
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import resources
from typing import Any, Protocol

_WORD = re.compile(r"[a-z]+")
# Words of tool names that say what a tool does rather than what it acts on.
_VERBS = frozenset(
    [
        *("self", "set", "get", "read", "show", "check", "write", "toggle", "change", "update"),
        *("do", "run", "call", "audio"),
    ]
)
MAX_PROMPT_CHARS = 720  # about 160 tokens: Whisper keeps 223, and each costs decoder time


class ToolLike(Protocol):
    """A device tool as `backend.mcp_session.Tool` holds it (its schema is `input_schema`)."""

    @property
    def name(self) -> str:
        """The tool's MCP name."""

    @property
    def description(self) -> str:
        """What the tool does."""


def _schema(tool: ToolLike) -> Mapping[str, Any]:
    schema = getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None)
    return schema if isinstance(schema, Mapping) else {}


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower().replace("_", " "))


def _nouns(tool: ToolLike) -> list[str]:
    """What the tool acts on, from its name: "self.audio_speaker.set_volume" -> speaker, volume."""
    return [word for word in _words(tool.name) if word not in _VERBS]


def choices_of(prop: Mapping[str, Any], description: str) -> list[str]:
    """A string setting's choices: its enum, or the words its description quotes."""
    options = prop.get("enum")
    if isinstance(options, list):
        return [str(option).lower() for option in options if str(option).isascii()]
    quoted = re.findall(r"[\"“']([A-Za-z]+)[\"”']", f"{prop.get('description', '')} {description}")
    return [word.lower() for word in quoted]


def tool_terms(tool: ToolLike, shared: frozenset[str] = frozenset()) -> list[str]:
    """Short phrases for one tool: "set the volume to 30", "dark theme", "LED on". A setting
    that several tools have (`shared`) is named with its owner: "set the screen brightness"."""
    nouns = _nouns(tool)
    properties = _schema(tool).get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    terms: list[str] = []
    for name, prop in properties.items():
        if not isinstance(prop, Mapping):
            continue
        subject = " ".join(_words(name))
        kind = prop.get("type")
        if kind in ("integer", "number"):
            owner = next((n for n in nouns if n != subject and n not in subject), "")
            named = f"{owner} {subject}" if subject in shared and owner else subject
            terms.append(f"set the {_spelled(named)} to 30")
        elif kind == "boolean":
            thing = _spelled(next((n for n in nouns if n != subject), subject))
            terms += [f"{thing} on", f"{thing} off"]
        elif kind == "string":
            terms += [f"{choice} {subject}" for choice in choices_of(prop, tool.description)]
    if not properties and nouns:
        terms.append(_spelled(" ".join(nouns)))
    return terms


def _spelled(words: str) -> str:
    """Acronyms as they are written: "LED", not "led"."""
    return " ".join(w.upper() if w in _ACRONYMS else w for w in words.split())


_ACRONYMS = frozenset(["led", "rgb", "usb", "ip", "wifi"])


def _settings(tools: list[ToolLike]) -> frozenset[str]:
    """Settings (numeric properties) that more than one tool has."""
    seen: dict[str, int] = {}
    for tool in tools:
        properties = _schema(tool).get("properties")
        if isinstance(properties, Mapping):
            for name in properties:
                key = " ".join(_words(name))
                seen[key] = seen.get(key, 0) + 1
    return frozenset(name for name, count in seen.items() if count > 1)


def _router_words(tools: Iterable[ToolLike]) -> list[str]:
    """The offline router's English words for changing these tools' settings: "louder",
    "dim", "dark mode"."""
    from backend.chat.lexicon import CONCEPTS, DOWN_WORDS, MUTE_WORDS, UP_WORDS
    from backend.chat.offline import concepts_in

    concepts: set[str] = set()
    for tool in tools:
        concepts |= concepts_in(f"{' '.join(_nouns(tool))} {tool.description}")
    if not concepts:
        return []
    words = [w for w in (*UP_WORDS, *DOWN_WORDS) if w.endswith("er")] + list(MUTE_WORDS)
    words += [w for concept in sorted(concepts) for w in CONCEPTS.get(concept, ()) if " " in w]
    return [w for w in dict.fromkeys(words) if _english(w)]


def _english(phrase: str) -> bool:
    """An English word or phrase (the lexicon and the knowledge base list Vietnamese beside
    English, with and without accents: "am luong", "nha khoa")."""
    if not phrase.isascii() or _WORD.fullmatch(phrase.replace(" ", "a")) is None:
        return False
    vietnamese, english = _vocabularies()
    return not any(w in vietnamese and w not in english for w in phrase.split())


@cache
def _kb_entries() -> tuple[dict[str, Any], ...]:
    text = resources.files("backend.chat").joinpath("data/dental_kb.json").read_text("utf-8")
    return tuple(json.loads(text)["entries"])


@cache
def _vocabularies() -> tuple[frozenset[str], frozenset[str]]:
    """(folded Vietnamese words, English words) of the knowledge base and the lexicon."""
    from backend.chat import lexicon
    from backend.chat.text import fold, has_vietnamese_letters

    vietnamese: set[str] = set()
    english: set[str] = set()
    for entry in _kb_entries():
        words = _WORD.findall(fold(f"{entry['title']} {entry['keywords']} {entry['content']}"))
        (vietnamese if entry.get("lang") == "vi" else english).update(words)
    groups = [*lexicon.CONCEPTS.values(), lexicon.DENTAL_PHRASES, lexicon.ON_WORDS]
    groups += [lexicon.OFF_WORDS, lexicon.ACTION_WORDS, lexicon.UP_WORDS, lexicon.DOWN_WORDS]
    for phrase in (p for group in groups for p in group):
        if has_vietnamese_letters(phrase):
            vietnamese.update(_WORD.findall(fold(phrase)))
    return frozenset(vietnamese), frozenset(english)


_NOT_TOPICS = frozenset(["and", "how", "to", "the", "with", "vietnam", "emergency"])


@cache
def dental_terms() -> tuple[str, ...]:
    """What the knowledge base answers about, as its short English titles say it ("bleeding
    gums", "wisdom teeth", "fillings"), then the router's dental phrases."""
    from backend.chat.lexicon import DENTAL_PHRASES

    terms: list[str] = []
    for entry in _kb_entries():
        if entry.get("lang") != "en":
            continue
        for part in re.split(r"[():,]", entry["title"].lower().replace("-", " ")):
            words = _words(part)
            if 0 < len(words) <= 2 and not _NOT_TOPICS & set(words):
                terms.append(" ".join(words))
    terms += [p for p in DENTAL_PHRASES if " " in p and _english(p)]
    return tuple(dict.fromkeys(terms))


def prompt_for(tools: Iterable[ToolLike]) -> str:
    """The recognizer's prompt for a device with these tools (the same tools, the same text):
    short sentences in the style of what is said, commands first, then the dental topics."""
    tools = list(tools)
    shared = _settings(tools)
    commands = [term for tool in tools for term in tool_terms(tool, shared)]
    commands += _router_words(tools)
    said = ", ".join(dict.fromkeys(commands))
    parts = [said[:1].upper() + said[1:] + "."] if commands else []
    parts.append("Questions about " + ", ".join(dental_terms()) + ".")
    prompt = " ".join(parts)
    if len(prompt) > MAX_PROMPT_CHARS:
        prompt = prompt[:MAX_PROMPT_CHARS].rsplit(",", 1)[0] + "."
    return prompt


# ---- numbers -------------------------------------------------------------------------------------

_ONES = [
    *("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"),
    *("eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen"),
    *("eighteen", "nineteen"),
]
_TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
NUMBER_WORDS: tuple[str, ...] = (
    *_ONES,
    *(f"{tens} {one}".strip() for tens in _TENS for one in ("", *_ONES[1:10])),
    "one hundred",
)
_NUMBER_VALUES = {words: value for value, words in enumerate(NUMBER_WORDS)}
_NUMBER_RUN = re.compile(  # "twenty five", "twenty-five": Whisper writes either
    r"\b(?:"
    + "|".join(w.replace(" ", r"[\s-]+") for w in sorted(NUMBER_WORDS, key=len, reverse=True))
    + r")\b",
    re.IGNORECASE,
)
_NUMBER_CONTEXT = frozenset(["to", "at", "volume", "brightness", "level", "percent"])


def spoken_numbers_to_digits(text: str) -> str:
    """ "set the volume to thirty five" (or "thirty-five") -> "set the volume to 35". A lone
    "one" stays a word ("one other time") unless a setting or "to"/"at" comes before it."""

    def digits(match: re.Match[str]) -> str:
        words = " ".join(re.split(r"[\s-]+", match.group(0).lower()))
        if words == "one":
            before = text[: match.start()].lower().split()
            if not before or before[-1] not in _NUMBER_CONTEXT:
                return match.group(0)
        return str(_NUMBER_VALUES[words])

    return _NUMBER_RUN.sub(digits, text)


def normalized(text: str) -> str:
    """A transcript as the router reads it: numbers as digits, "50%" as "50 percent"."""
    text = re.sub(r"(\d)\s*%", r"\1 percent", text)
    return spoken_numbers_to_digits(" ".join(text.split()).rstrip(",;: "))
