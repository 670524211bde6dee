"""What the embedded recognizer's grammar accepts: phrases derived from a device's tools, the
offline router's command words (backend/chat/lexicon.py) and common dental questions built on
the dental knowledge base (backend/chat/data). `<number>` in a phrase stands for 0..100 spoken
as words; `spoken_numbers_to_digits` turns them back into digits, which the offline router reads.
"""

import json
import re
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import resources
from typing import Any, Protocol

from backend.voice.asr_worker import NUMBER_SLOT, NUMBER_WORDS

_WORD = re.compile(r"[a-z]+")
# Words of tool names that say what a tool does rather than what it acts on.
_VERBS = frozenset(
    [
        "self",
        "set",
        "get",
        "read",
        "show",
        "check",
        "write",
        "toggle",
        "change",
        "update",
        "do",
        "run",
        "call",
    ]
)
_QUESTION_VERBS = frozenset(["get", "read", "show", "check"])


class ToolLike(Protocol):
    """A device tool as `backend.mcp_session.Tool` holds it (its schema is `input_schema`)."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...


def _schema(tool: ToolLike) -> Mapping[str, Any]:
    schema = getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None)
    return schema if isinstance(schema, Mapping) else {}


def _english(phrases: Iterable[str]) -> list[str]:
    """English phrases only (the embedded model is English): ASCII, and no word that is only
    Vietnamese typed without accents ("den led", "am luong" are in the lexicon too)."""
    vietnamese, english = _vocabularies()
    return [
        p
        for p in phrases
        if p.isascii()
        and _WORD.fullmatch(p.replace(" ", "a"))
        and not any(w in vietnamese and w not in english for w in p.split())
    ]


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
    lists = [*lexicon.CONCEPTS.values(), lexicon.DENTAL_PHRASES, lexicon.ON_WORDS]
    lists += [lexicon.OFF_WORDS, lexicon.ACTION_WORDS]
    for phrase in (p for group in lists for p in group):
        if has_vietnamese_letters(phrase):
            vietnamese.update(_WORD.findall(fold(phrase)))
    return frozenset(vietnamese), frozenset(english)


def _concepts(text: str) -> set[str]:
    from backend.chat.offline import concepts_in

    return concepts_in(text)


def _concept_words(concept: str) -> list[str]:
    from backend.chat.lexicon import CONCEPTS

    return _english(CONCEPTS.get(concept, ()))


# ---- tools ---------------------------------------------------------------------------------------


def _nouns(tool: ToolLike) -> list[str]:
    """What the tool acts on, from its name: "self.audio_speaker.set_volume" -> speaker, volume."""
    words = _WORD.findall(tool.name.lower().replace("_", " "))
    return [w for w in words if w not in _VERBS]


def _number_phrases(subjects: list[str], related: list[str]) -> list[str]:
    phrases = []
    for subject in subjects:
        for template in (
            "set the {s} to <number>",
            "set {s} to <number>",
            "change the {s} to <number>",
            "{s} <number>",
            "{s} <number> percent",
            "turn the {s} up",
            "turn the {s} down",
            "turn up the {s}",
            "turn down the {s}",
            "set the {s} to maximum",
            "set the {s} to minimum",
            "{s} at maximum",
        ):
            phrases.append(template.format(s=subject))
    verbs, comparatives, nouns = _split_related(related)
    # "mute the speaker", "mute the sound" ("speaker" ends like a comparative: both kinds)
    targets = [subjects[-1], *nouns, *comparatives]
    phrases += [f"{verb} the {target}" for verb in verbs for target in targets]
    phrases += [f"make it {word}" for word in comparatives] + comparatives
    return phrases


def _split_related(words: list[str]) -> tuple[list[str], list[str], list[str]]:
    """The lexicon's words of a concept as verbs (mute, dim), comparatives (louder) and nouns."""
    from backend.chat.lexicon import ACTION_WORDS

    single = [w for w in dict.fromkeys(words) if " " not in w]
    verbs = [w for w in single if w in ACTION_WORDS or w == "dim"]
    comparatives = [w for w in single if w.endswith("er") and w not in verbs]
    nouns = [w for w in single if w not in verbs and w not in comparatives]
    return verbs, comparatives, nouns


def _switch_phrases(things: list[str]) -> list[str]:
    phrases = []
    for thing in things:
        for state in ("on", "off"):
            phrases += [
                f"turn {state} the {thing}",
                f"turn the {thing} {state}",
                f"switch {state} the {thing}",
                f"switch the {thing} {state}",
            ]
    return phrases


def _choice_phrases(prop: str, choices: list[str]) -> list[str]:
    phrases = []
    for choice in choices:
        phrases += [
            f"set the {prop} to {choice}",
            f"change the {prop} to {choice}",
            f"switch to {choice} mode",
            f"switch to the {choice} {prop}",
            f"use the {choice} {prop}",
            f"{choice} mode",
            f"{choice} {prop}",
        ]
    return phrases


def _query_phrases(nouns: list[str]) -> list[str]:
    subject = " ".join(nouns)
    return [
        f"what is the {subject}",
        f"check the {subject}",
        f"show the {subject}",
        f"tell me the {subject}",
        subject,
    ]


def _choices(prop: Mapping[str, Any], description: str) -> list[str]:
    options = prop.get("enum")
    if isinstance(options, list):
        return [str(option).lower() for option in options]
    quoted = re.findall(r"[\"“']([A-Za-z]+)[\"”']", f"{prop.get('description', '')} {description}")
    return [word.lower() for word in quoted]


def tool_phrases(tool: ToolLike) -> list[str]:
    """Spoken commands for one tool, from its name, description and inputSchema."""
    nouns = _nouns(tool)
    concepts = _concepts(f"{' '.join(nouns)} {tool.description}")
    properties = _schema(tool).get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    phrases: list[str] = []
    for name, prop in properties.items():
        if not isinstance(prop, Mapping):
            continue
        prop_words = " ".join(_WORD.findall(name.lower().replace("_", " ")))
        kind = prop.get("type")
        if kind in ("integer", "number"):
            owners = [n for n in nouns if n != prop_words]
            subjects = [prop_words, *(f"{owner} {prop_words}" for owner in owners)]
            related = [w for c in _concepts(prop_words) for w in _concept_words(c)]
            phrases += _number_phrases(subjects, related)
        elif kind == "boolean":
            things = [n for n in nouns if n != prop_words] or [prop_words]
            named = _concepts(" ".join(things))
            things += [w for c in named for w in _split_related(_concept_words(c))[2]]
            phrases += _switch_phrases(list(dict.fromkeys(things)))
        elif kind == "string" and (choices := _choices(prop, tool.description)):
            phrases += _choice_phrases(prop_words, choices)
    if not properties and nouns:
        asks = _asks(tool.name) or "status" in concepts
        phrases += _query_phrases(nouns) if asks else [" ".join(nouns)]
    return phrases


def _asks(name: str) -> bool:
    """Whether a tool name reads as a question ("get_device_status"), not an action ("reboot")."""
    words = [w for w in _WORD.findall(name.lower().replace("_", " ")) if w != "self"]
    return bool(words) and words[0] in _QUESTION_VERBS


def router_phrases(concepts: set[str]) -> list[str]:
    """The offline router's own command words for these concepts (lexicon: CONCEPTS, values)."""
    from backend.chat.lexicon import VALUE_SYNONYMS

    phrases: list[str] = []
    for concept in sorted(concepts):
        words = _concept_words(concept)
        if concept == "theme":
            modes = [w for w in words if " " in w]  # "dark mode", "night mode"...
            phrases += [f"switch to {mode}" for mode in modes] + modes
            values = _english(w for v in VALUE_SYNONYMS.values() for w in v if " " not in w)
            phrases += [f"switch to {v} mode" for v in values]
        elif concept == "status":
            phrases += [f"what is the {w}" for w in words if " " in w or w == "status"]
    return phrases


# ---- dental questions ----------------------------------------------------------------------------

_DENTAL_FRAMES = (
    "what is {x}",
    "what is a {x}",
    "is {x} safe",
    "what causes {x}",
    "how do i treat {x}",
    "how do i prevent {x}",
    "is {x} bad for my teeth",
)
_DENTAL_ACTIVITIES = (
    "brush my teeth",
    "brush",
    "floss",
    "see the dentist",
    "replace my toothbrush",
    "use mouthwash",
)


@cache
def _kb_entries() -> tuple[dict[str, Any], ...]:
    text = resources.files("backend.chat").joinpath("data/dental_kb.json").read_text("utf-8")
    return tuple(json.loads(text)["entries"])


def _kb_subjects() -> set[str]:
    """Short English titles of the knowledge base ("Bleeding gums", "Cavities (tooth decay)"):
    the things people ask about."""
    subjects = set()
    for entry in _kb_entries():
        if entry.get("lang") != "en":
            continue
        title = entry["title"].lower().replace("-", " ")
        for part in re.split(r"[()]", title):
            words = _WORD.findall(part)
            if 0 < len(words) <= 3 and not {"and", "how", "to", "the"} & set(words):
                subjects.add(" ".join(words))
    return subjects


@cache
def _eval_questions() -> tuple[str, ...]:
    text = resources.files("backend.chat").joinpath("data/offline_eval.json").read_text("utf-8")
    items = json.loads(text)["items"]
    return tuple(
        item["text"] for item in items if item["lang"] == "en" and item["expect"] == "answer"
    )


@cache
def dental_questions() -> tuple[str, ...]:
    """Common English dental questions over the topics of the bundled knowledge base."""
    from backend.chat.lexicon import DENTAL_PHRASES

    subjects = sorted(_kb_subjects() | {p for p in _english(DENTAL_PHRASES) if " " in p})
    questions = [frame.format(x=subject) for subject in subjects for frame in _DENTAL_FRAMES]
    for activity in _DENTAL_ACTIVITIES:
        questions += [f"how often should i {activity}", f"how long should i {activity}"]
    questions += ["why do my gums bleed", "why are my teeth sensitive", "why does my tooth hurt"]
    questions += [" ".join(_WORD.findall(q.lower())) for q in _eval_questions()]
    return tuple(questions)


def command_phrases(tools: Iterable[ToolLike]) -> tuple[str, ...]:
    """The phrases a device's grammar accepts: its tools' commands, the offline router's command
    words for the same concepts, and the dental questions. Ordered and without duplicates, so
    the same tool set always gives the same tuple (grammars are cached by it)."""
    phrases: list[str] = []
    concepts: set[str] = set()
    for tool in tools:
        phrases += tool_phrases(tool)
        concepts |= _concepts(f"{' '.join(_nouns(tool))} {tool.description}")
    phrases += router_phrases(concepts)
    phrases += dental_questions()
    cleaned = (" ".join(p.lower().split()) for p in phrases)
    return tuple(dict.fromkeys(p for p in cleaned if p))


# ---- numbers -------------------------------------------------------------------------------------

_NUMBER_VALUES = {words: value for value, words in enumerate(NUMBER_WORDS)}
_NUMBER_RUN = re.compile(
    r"\b(?:" + "|".join(sorted(map(re.escape, NUMBER_WORDS), key=len, reverse=True)) + r")\b"
)
_NUMBER_CONTEXT = frozenset(["to", "at", "volume", "brightness", "level", "percent"])


def spoken_numbers_to_digits(text: str) -> str:
    """ "set the volume to thirty five" -> "set the volume to 35". A lone "one" stays a word
    ("one other time") unless a setting or "to"/"at" comes before it."""

    def digits(match: re.Match[str]) -> str:
        words = match.group(0)
        if words == "one":
            before = text[: match.start()].split()
            if not before or before[-1] not in _NUMBER_CONTEXT:
                return words
        return str(_NUMBER_VALUES[words])

    return _NUMBER_RUN.sub(digits, text)


__all__ = ["NUMBER_SLOT", "command_phrases", "dental_questions", "spoken_numbers_to_digits"]
