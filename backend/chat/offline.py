"""Offline mode: what the assistant does when no model answers.

1. Device requests are routed to tools by rules (`IntentDetector`): concepts found in the
   request (volume, brightness, theme, LED, status; Vietnamese and English words) are matched
   against concepts found in each tool's name and description; arguments are filled from the
   request (numbers, on/off, enumerated words like dark/light) and fitted against the tool's
   `inputSchema` (types, minimum, maximum, required). A tool is called only at a confidence of at
   least `threshold`, so a vague request never moves a device.
2. Questions get an extractive answer: the sentences of the search / knowledge-base results that
   share the most terms with the question.

A combined request ("set the volume to 30 and tell me how long I should brush") is split into
clauses; device clauses become tool calls and the rest is answered as a question.

A level asked up or down without a value ("turn it up", "giảm âm lượng") moves by
`LEVEL_STEP` from the level the device's status tool reports, within the tool's range; when it
reports none, the user is asked for a value (from a guessed level, down could mean louder). A
step said with its size ("raise the volume by 10", "tăng âm lượng thêm 10") moves by that size.
A question about the device's state ("what is the volume now", "is the light on") calls the
device's reading tool, never one that changes it, and is answered in one sentence from what it
reports (`device_state`).
A device request no tool of the device serves ("reboot the device" where reboot is kept for the
user) is answered as such, never refused as off-topic.
"""

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from backend.chat.device_state import asked_topics, has_topic, state_reply
from backend.chat.knowledge import kb_terms
from backend.chat.lexicon import (
    ACTION_WORDS,
    AMBIGUOUS_DENTAL,
    CLAUSE_SPLIT,
    CONCEPTS,
    DENTAL_PHRASES,
    DOWN_WORDS,
    MAX_WORDS,
    MIN_WORDS,
    MUTE_WORDS,
    OFF_WORDS,
    ON_WORDS,
    PRIMARY_CONCEPTS,
    UP_WORDS,
    VALUE_NAMES_VI,
    VALUE_SYNONYMS,
    PhraseMatcher,
    longest_matches,
)
from backend.chat.llm.base import FunctionSpec
from backend.chat.search import SearchResult
from backend.chat.text import Language, sentences, wordset
from backend.common import clip

DEFAULT_THRESHOLD = 0.7
LEVEL_STEP = 10  # "turn it up": +10, "turn it down": -10
DEFAULT_LEVEL = 50  # the placeholder a detected step scores with, before the device's level
_NUMBER = re.compile(r"(?<![\w.])(-?\d{1,4})(?:\s*(?:%|phần trăm|percent|phan tram))?(?![\w])")
_QUOTED = re.compile(r"[\"'“”‘’`]([A-Za-z][\w-]{0,30})[\"'“”‘’`]")
_NAME_SPLIT = re.compile(r"[^a-z0-9]+")
# "by 10", "thêm 10" (more), "bớt 10" (less): the size of a step, not the level to set.
_STEP_SIZE = re.compile(
    r"(?<!\w)(?:by|thêm|bớt)\s+(\d{1,3})(?:\s*(?:%|percent|phần trăm))?(?!\w)", re.IGNORECASE
)
# Words of a tool's name that only read ("self_get_device_status"), or change something.
_READ_WORDS = frozenset({"get", "read", "list", "show", "check", "query", "describe", "fetch"})
_READ_NOUNS = frozenset({"status", "state", "info", "information"})
_CHANGE_WORDS = frozenset(
    {"set", "turn", "switch", "change", "toggle", "reboot", "restart", "upgrade", "reset"}
    | {"erase", "update", "write", "delete", "play", "stop", "start", "open", "close", "clear"}
)

_concepts = {concept: PhraseMatcher(phrases) for concept, phrases in CONCEPTS.items()}
_dental = PhraseMatcher(DENTAL_PHRASES)
_actions = PhraseMatcher(ACTION_WORDS)
_on = PhraseMatcher(ON_WORDS)
_off = PhraseMatcher(OFF_WORDS)
_max = PhraseMatcher(MAX_WORDS)
_min = PhraseMatcher(MIN_WORDS)
_mute = PhraseMatcher(MUTE_WORDS)
_up = PhraseMatcher(UP_WORDS)
_down = PhraseMatcher(DOWN_WORDS)
_values = {value: PhraseMatcher(words) for value, words in VALUE_SYNONYMS.items()}


def concepts_in(text: str) -> set[str]:
    """Device concepts a text mentions; the longest phrase wins across concepts."""
    return longest_matches(_concepts, text)


def dental_words(text: str) -> Literal["clear", "ambiguous"] | None:
    """Whether the text has dental words, and whether any of them is unambiguous."""
    hits = _dental.find(text)
    if not hits:
        return None
    return "ambiguous" if all(hit.phrase in AMBIGUOUS_DENTAL for hit in hits) else "clear"


def is_dental(text: str) -> bool:
    """Whether the text names a dental topic."""
    return dental_words(text) is not None


def asks_a_device(text: str) -> bool:
    """Whether a text asks something of a device, judged without any device's tools (a turn
    with no device chosen: "set the volume to 10", "what is the volume?")."""
    wanted = concepts_in(text) & PRIMARY_CONCEPTS
    if wanted and (_actions.find(text) or _up.find(text) or _down.find(text)):
        return True
    return any(asked_topics(clause, questioned=questioned) for clause, questioned in _clauses(text))


# Words of a tool's name and description that say nothing of what it is for.
_GENERIC_TOOL_WORDS = wordset(
    "get set the a an of for to and or with from by in on is are this that it its use "
    "used using return returns tool tools current value values self call calls given "
    "name names list data info information request requests new make run"
)


def serving_function(text: str, functions: Sequence[FunctionSpec]) -> FunctionSpec | None:
    """An external function whose name or description shares a telling word with the text
    ("what time is it in Tokyo" and `get_current_time`): the guardrail lets such a request
    through to the model, which may call it, instead of refusing it as off-topic."""
    asked = {_stem_word(word) for word in _NAME_SPLIT.split(text.lower()) if len(word) > 2}
    asked -= _GENERIC_TOOL_WORDS
    for spec in functions:
        first = spec.description.split(".", 1)[0]
        said = _NAME_SPLIT.split(f"{spec.llm_name} {first}".lower())
        words = {_stem_word(word) for word in said if len(word) > 2} - _GENERIC_TOOL_WORDS
        if asked & words:
            return spec
    return None


def _stem_word(word: str) -> str:
    return word[:-1] if word.endswith("s") and len(word) > 3 else word


def split_clauses(text: str) -> list[str]:
    """The request cut into clauses (at `;`, commas, and/then/và/rồi...), each routed on its own."""
    parts = (part.strip(" .,") for part in CLAUSE_SPLIT.split(text))
    return [part for part in parts if part]


@dataclass(frozen=True, slots=True)
class Step:
    """A level to move by `delta` from where it is, within `minimum`..`maximum`."""

    argument: str
    delta: int
    minimum: int | None = None
    maximum: int | None = None


@dataclass(frozen=True, slots=True)
class Intent:
    """A device request found in the text: the function, its arguments, how sure we are."""

    llm_name: str
    arguments: dict[str, Any]
    confidence: float
    clause: str
    concept: str
    missing: tuple[str, ...] = ()  # required arguments the text did not give
    problem: str | None = None  # e.g. a value outside the tool's range
    step: Step | None = None  # "turn it up": `arguments` holds the step from DEFAULT_LEVEL
    asked: tuple[str, ...] = ()  # a question about the device's state: its topics (volume...)


@dataclass(frozen=True, slots=True)
class Plan:
    """What offline mode does with a request: tool calls, and the question left to answer."""

    intents: list[Intent] = field(default_factory=list)
    rejected: list[Intent] = field(default_factory=list)  # device-like but below the threshold
    question: str = ""
    unserved: list[str] = field(default_factory=list)  # device requests no function serves
    unanswered: list[str] = field(default_factory=list)  # state questions no reading tool answers


@dataclass(frozen=True, slots=True)
class _Profile:
    spec: FunctionSpec
    weights: dict[str, float]


class IntentDetector:
    """Routes a request to a tool by the concepts both share (see the module docstring)."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD) -> None:
        self.threshold = threshold
        self._profiles: dict[tuple[str, str], _Profile] = {}

    def profile(self, spec: FunctionSpec) -> _Profile:
        """The concepts of a tool's name and description (cached per name and description)."""
        key = (spec.llm_name, spec.description)
        cached = self._profiles.get(key)
        if cached is not None:
            return cached
        weights: dict[str, float] = {}
        name_text = " ".join(_NAME_SPLIT.split(spec.llm_name.lower()))
        for concept in concepts_in(spec.description):
            weights[concept] = 0.5
        for concept in concepts_in(name_text):
            weights[concept] = 1.0
        if "brightness" in weights and "led" in weights and weights["led"] == 1.0:
            weights["brightness"] = min(weights["brightness"], 0.5)
        profile = _Profile(spec, weights)
        self._profiles[key] = profile
        return profile

    def detect(self, text: str, functions: Sequence[FunctionSpec]) -> Intent | None:
        """The best device intent of one clause (whatever its confidence), or None."""
        if not functions:
            return None
        wanted = concepts_in(text)
        if not wanted & PRIMARY_CONCEPTS:
            return None
        scored: list[tuple[float, int, _Profile, str]] = []
        for position, spec in enumerate(functions):
            profile = self.profile(spec)
            score = 0.0
            main = ""
            for concept in wanted:
                weight = profile.weights.get(concept, 0.0)
                if concept not in PRIMARY_CONCEPTS:
                    weight *= 0.3
                score += weight
                if concept in PRIMARY_CONCEPTS and weight >= 0.5 and not main:
                    main = concept
            if score > 0 and main:
                scored.append((score, position, profile, main))
        if not scored:
            return None
        scored.sort(key=lambda item: (-item[0], item[1]))
        score, _position, profile, concept = scored[0]
        ambiguous = len(scored) > 1 and scored[1][0] == score
        size = _STEP_SIZE.search(text)  # "by 10": not the level to set, so not a value
        values = text if size is None else text[: size.start()] + text[size.end() :]
        arguments, missing, problem, given = fill_arguments(values, profile.spec.parameters)
        amount = LEVEL_STEP if size is None else int(size.group(1))
        step = _step_for(text, profile.spec.parameters, missing, amount) if not problem else None
        if step is not None:
            arguments = {**arguments, step.argument: _moved(step, None)}
            missing = [name for name in missing if name != step.argument]
            given = True
        confidence = 0.5 if profile.weights.get(concept, 0) >= 1.0 else 0.35
        if _actions.find(text) or given:
            confidence += 0.25
        if not missing and problem is None and (given or not _properties(profile.spec)):
            confidence += 0.25
        if ambiguous:
            confidence -= 0.3
        if missing or problem is not None:
            confidence = min(confidence, 0.5)
        return Intent(
            profile.spec.llm_name,
            arguments,
            round(confidence, 2),
            text,
            concept,
            tuple(missing),
            problem,
            step,
        )

    def unserved(self, text: str, functions: Sequence[FunctionSpec]) -> bool:
        """Whether the text asks the device for something (an action on a device concept) that
        no function here does ("reboot" when the reboot tool is kept for the user)."""
        wanted = concepts_in(text) & PRIMARY_CONCEPTS
        if not wanted or not _actions.find(text):
            return False
        served = set().union(*(self.profile(spec).weights for spec in functions))
        return bool(wanted - served)

    def status_function(self, functions: Sequence[FunctionSpec]) -> FunctionSpec | None:
        """The function that reads the device's state without arguments, if there is one (a
        name that only reads: a question must never reach a tool that changes something)."""
        for spec in functions:
            if self.profile(spec).weights.get("status", 0.0) >= 1.0 and _reads_only(spec):
                return spec
        return None

    def called(
        self, llm_name: str, arguments: dict[str, Any], functions: Sequence[FunctionSpec]
    ) -> Intent:
        """A call chosen elsewhere (confirmed by the user, made by the model) as an intent, so
        `device_reply` can say it in words: its concept is the strongest of the tool's name."""
        spec = next((spec for spec in functions if spec.llm_name == llm_name), None)
        weights = self.profile(spec).weights if spec is not None else {}
        named = [c for c, weight in weights.items() if weight >= 1.0 and c in PRIMARY_CONCEPTS]
        return Intent(llm_name, dict(arguments), 1.0, "", named[0] if named else "")

    def reading_function(
        self, functions: Sequence[FunctionSpec], topics: Sequence[str]
    ) -> FunctionSpec | None:
        """The function that answers a state question: the status tool, or a system
        information tool (`get_system_info`) for the firmware or when there is no status tool."""
        status = self.status_function(functions)
        info = next((spec for spec in functions if _is_info(spec)), None)
        if {"firmware", "system"} & set(topics) and info is not None:
            return info
        return status or info

    def state_question(
        self, clause: str, functions: Sequence[FunctionSpec], *, questioned: bool = False
    ) -> Intent | None:
        """The reading call for a question about the device's state ("what is the volume"),
        or None when the clause is no such question. The call's `llm_name` is "" when no
        function reads the device's state."""
        if not functions or is_dental(clause):
            return None  # no device to ask, or "how white are my teeth"
        topics = asked_topics(clause, questioned=questioned)
        if not topics:
            return None
        reader = self.reading_function(functions, topics)
        name = reader.llm_name if reader is not None else ""
        return Intent(name, {}, 1.0, clause, "status", asked=topics)

    def plan(self, text: str, functions: Sequence[FunctionSpec]) -> Plan:
        """Split a request into device calls (at or above the threshold) and a question."""
        intents: list[Intent] = []
        rejected: list[Intent] = []
        rest: list[str] = []
        unserved: list[str] = []
        unanswered: list[str] = []
        asking = False  # the clause before asked about the state ("... and the battery?")
        for clause, questioned in _clauses(text):
            questioned = questioned or (asking and has_topic(clause))
            question = self.state_question(clause, functions, questioned=questioned)
            asking = question is not None
            if question is not None and not question.llm_name:
                unanswered.append(clause)  # no tool reads the state: never guess with a setter
                continue
            if question is not None:
                intents.append(question)
                continue
            intent = self.detect(clause, functions)
            if intent is not None and intent.confidence >= self.threshold:
                intents.append(intent)
            elif not is_dental(clause) and self.unserved(clause, functions):
                unserved.append(clause)  # "restart the speaker": no tool restarts anything
            elif intent is not None and not is_dental(clause):
                rejected.append(intent)
            else:
                rest.append(clause)
        return Plan(_merged(intents), rejected, ", ".join(rest), unserved, unanswered)

    def is_device_request(self, text: str, functions: Sequence[FunctionSpec]) -> bool:
        """Whether some clause asks for something these functions do (for the guardrail)."""
        for clause, questioned in _clauses(text):
            if self.state_question(clause, functions, questioned=questioned):
                return True
            intent = self.detect(clause, functions)
            if intent is not None and (
                intent.confidence >= self.threshold or _actions.find(clause)
            ):
                return True
            if functions and self.unserved(clause, functions):
                return True
        return False


def _clauses(text: str) -> list[tuple[str, bool]]:
    """The request's clauses, each with whether a "?" followed it ("volume?")."""
    found: list[tuple[str, bool]] = []
    position = 0
    for clause in split_clauses(text) or [text]:
        at = text.find(clause, position)
        position = at + len(clause) if at >= 0 else position
        found.append((clause, at >= 0 and text[position:].lstrip().startswith("?")))
    return found


def _merged(intents: list[Intent]) -> list[Intent]:
    """Questions in a row to one reading tool as one call ("the volume and the battery"); of
    two changes by one tool the later ("the screen's kind of dim, can you make it brighter?",
    "make it 30, no, 40")."""
    changes = [intent for intent in intents if not intent.asked]
    last_of = {intent.llm_name: intent for intent in changes}
    intents = [i for i in intents if i.asked or last_of[i.llm_name] is i]
    merged: list[Intent] = []
    for intent in intents:
        last = merged[-1] if merged else None
        if last is not None and last.asked and intent.asked and last.llm_name == intent.llm_name:
            asked = tuple(dict.fromkeys((*last.asked, *intent.asked)))
            merged[-1] = dataclasses.replace(last, asked=asked)
        else:
            merged.append(intent)
    return merged


def _name_words(spec: FunctionSpec) -> list[str]:
    return [word for word in _NAME_SPLIT.split(spec.llm_name.lower()) if word]


def _reads_only(spec: FunctionSpec) -> bool:
    """A function without required arguments whose name only reads ("self_get_device_status")."""
    words = _name_words(spec)
    if spec.parameters.get("required") or not words or _CHANGE_WORDS & set(words):
        return False
    return bool(_READ_WORDS & set(words)) or words[-1] in _READ_NOUNS


def _is_info(spec: FunctionSpec) -> bool:
    """A system information tool ("self_get_system_info")."""
    words = set(_name_words(spec))
    return _reads_only(spec) and bool(words & {"info", "information", "version", "firmware"})


def _properties(spec: FunctionSpec) -> dict[str, Any]:
    properties = spec.parameters.get("properties")
    return properties if isinstance(properties, dict) else {}


def fill_arguments(
    text: str, schema: dict[str, Any]
) -> tuple[dict[str, Any], list[str], str | None, bool]:
    """Arguments for `schema` from `text`: (arguments, missing required, problem, any given)."""
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = schema.get("required")
    required_names = set(required) if isinstance(required, list) else set()
    numbers = [int(match.group(1)) for match in _NUMBER.finditer(text)]
    arguments: dict[str, Any] = {}
    problem: str | None = None
    given = False
    for name, prop in properties.items():
        if not isinstance(prop, dict):
            continue
        kind = prop.get("type")
        value: Any = None
        if kind in ("integer", "number"):
            value, problem_here = _number_for(text, numbers, prop)
            problem = problem or problem_here
        elif kind == "boolean":
            value = _switch(text)
        elif kind == "string":
            value = _choice(text, prop, schema)
        if value is not None:
            arguments[name] = value
            given = True
    for name, prop in properties.items():
        # "đèn sáng 40" / "LED at 40%": a level for a switchable thing means switch it on.
        if (
            name not in arguments
            and isinstance(prop, dict)
            and prop.get("type") == "boolean"
            and name.lower() in ("on", "enabled", "enable", "power")
            and any(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in arguments.values()
            )
        ):
            arguments[name] = True
    missing = [
        name
        for name in sorted(required_names)
        if name not in arguments
        and not (isinstance(properties.get(name), dict) and "default" in properties[name])
    ]
    return arguments, missing, problem, given


def _step_for(
    text: str, schema: dict[str, Any], missing: Sequence[str], amount: int = LEVEL_STEP
) -> Step | None:
    """A step of `amount` for the first missing numeric argument when the text says up or down
    only."""
    up, down = bool(_up.find(text)), bool(_down.find(text))
    if up == down:
        return None
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    for name in missing:
        prop = properties.get(name)
        if isinstance(prop, dict) and prop.get("type") in ("integer", "number"):
            low, high = prop.get("minimum"), prop.get("maximum")
            return Step(
                name,
                amount if up else -amount,
                low if isinstance(low, int) and not isinstance(low, bool) else None,
                high if isinstance(high, int) and not isinstance(high, bool) else None,
            )
    return None


def _moved(step: Step, current: int | None) -> int:
    level = (DEFAULT_LEVEL if current is None else current) + step.delta
    if step.minimum is not None:
        level = max(step.minimum, level)
    if step.maximum is not None:
        level = min(step.maximum, level)
    return level


def stepped(intent: Intent, current: int | None) -> Intent | None:
    """The intent with its step taken from `current`, the level the device reports. None when
    a step has no level to start from: from a guess, "turn it down" could make it louder."""
    if intent.step is None:
        return intent
    if current is None:
        return None
    arguments = {**intent.arguments, intent.step.argument: _moved(intent.step, current)}
    return dataclasses.replace(intent, arguments=arguments)


def current_level(status_text: str, name: str) -> int | None:
    """The value of `name` in a status tool's JSON answer (`{"audio_speaker": {"volume":
    40}}` → 40 for "volume"), None when the answer does not say."""
    try:
        status = json.loads(status_text)
    except ValueError:
        return None
    found: list[Any] = [status]
    while found:
        item = found.pop()
        if isinstance(item, dict):
            value = item.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                return round(value)
            found.extend(item.values())
        elif isinstance(item, list):
            found.extend(item)
    return None


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number_for(
    text: str, numbers: list[int], prop: dict[str, Any]
) -> tuple[int | None, str | None]:
    low = prop.get("minimum")
    high = prop.get("maximum")
    if numbers:
        value = numbers[0]
    elif _mute.find(text) and isinstance(low, int):
        value = low
    elif _max.find(text) and isinstance(high, int):
        value = high
    elif _min.find(text) and isinstance(low, int):
        value = low
    else:
        return None, None
    if isinstance(low, int | float) and value < low:
        return None, f"{value} is below the minimum {low}"
    if isinstance(high, int | float) and value > high:
        return None, f"{value} is above the maximum {high}"
    return value, None


def _switch(text: str) -> bool | None:
    on = _on.find(text)
    off = _off.find(text)
    if off and not on:
        return False
    if on and not off:
        return True
    if on and off:  # the later word wins ("tắt rồi bật" is rare; keep the last one said)
        return on[-1].start > off[-1].start
    return None


def _choice(text: str, prop: dict[str, Any], schema: dict[str, Any]) -> str | None:
    options = prop.get("enum")
    if not isinstance(options, list):
        options = _QUOTED.findall(str(prop.get("description", "")))
        if not options:
            options = _QUOTED.findall(str(schema.get("description", "")))
    candidates = [str(option) for option in options] or list(VALUE_SYNONYMS)
    lowered = text.lower()
    for option in candidates:
        if re.search(rf"(?<!\w){re.escape(option.lower())}(?!\w)", lowered):
            return option
    for option in candidates:
        matcher = _values.get(option.lower())
        if matcher is not None and matcher.find(text):
            return option
    return None


def with_description_choices(spec: FunctionSpec) -> FunctionSpec:
    """The spec, with quoted choices of its description copied into string properties that
    have no enum (`Set the screen theme: "light" or "dark"` → theme enum [light, dark])."""
    choices = _QUOTED.findall(spec.description)
    if not choices:
        return spec
    properties = _properties(spec)
    changed = {
        name: {**prop, "description": prop.get("description", "") + " " + spec.description}
        for name, prop in properties.items()
        if isinstance(prop, dict) and prop.get("type") == "string" and "enum" not in prop
    }
    if not changed:
        return spec
    parameters = {**spec.parameters, "properties": {**properties, **changed}}
    return FunctionSpec(spec.llm_name, spec.description, parameters)


# ---- extractive answers -----------------------------------------------------------------------

OFFLINE_NOTE = {
    "vi": "(Chế độ ngoại tuyến: câu trả lời được trích từ tài liệu tham khảo.)",
    "en": "(Offline mode: this answer is quoted from the reference material.)",
}
NOTHING_FOUND = {
    "vi": "Hiện tôi không kết nối được mô hình ngôn ngữ và không tìm thấy thông tin phù hợp. "
    "Bạn hãy hỏi lại sau hoặc hỏi ý kiến nha sĩ.",
    "en": "I can't reach the language model right now and found nothing relevant. Please try "
    "again later or ask your dentist.",
}


def extractive_answer(
    question: str,
    results: Sequence[SearchResult],
    language: Language,
    max_sentences: int = 3,
    *,
    stress: str = "",
) -> str:
    """The sentences of `results` closest to `question`, in their original order; a
    sentence with the words of `stress` (a follow-up's own: "for children") counts them twice."""
    wanted = set(kb_terms(question))
    stressed = set(kb_terms(stress))
    candidates: list[tuple[float, int, int, str]] = []
    for rank, result in enumerate(results[:3]):
        for position, sentence in enumerate(sentences(result.content)):
            terms = set(kb_terms(sentence))
            overlap = len(wanted & terms) + len(stressed & terms)
            if overlap:
                # Earlier results and earlier sentences break ties.
                candidates.append((overlap - 0.5 * rank, rank, position, sentence))
    if not candidates:
        if results:
            first = sentences(results[0].content)
            return " ".join(first[:max_sentences])
        return NOTHING_FOUND[language]
    best = sorted(candidates, key=lambda item: (-item[0], item[1], item[2]))[:max_sentences]
    best.sort(key=lambda item: (item[1], item[2]))
    return " ".join(sentence for _score, _rank, _position, sentence in best)


def extractive_summary(answer: str, language: Language, limit: int = 240) -> str:
    """The first sentences of an answer, as the summary of a turn when no model can summarise."""
    parts = [s for s in sentences(answer) if not s.startswith("(")]
    text = " ".join(parts[:2]) if parts else answer
    return clip(text, limit)


# ---- device replies ---------------------------------------------------------------------------

_DONE = {
    "volume": {"vi": "Đã chỉnh âm lượng thành {value}.", "en": "Volume set to {value}."},
    "brightness": {
        "vi": "Đã chỉnh độ sáng màn hình thành {value}.",
        "en": "Screen brightness set to {value}.",
    },
    "theme": {"vi": "Đã đổi sang giao diện {value}.", "en": "Theme changed to {value}."},
    "led_on": {"vi": "Đã bật đèn.", "en": "The light is on."},
    "led_off": {"vi": "Đã tắt đèn.", "en": "The light is off."},
    "reboot": {"vi": "Thiết bị đang khởi động lại.", "en": "The device is restarting."},
}
_GENERIC_DONE = {"vi": "Đã thực hiện lệnh trên thiết bị.", "en": "Done on the device."}
_FAILED = {
    "vi": "Thiết bị không thực hiện được lệnh này.",
    "en": "The device could not carry out that request.",
}
_UNSERVED = {
    "vi": "Thiết bị này không cho phép tôi làm việc đó qua trò chuyện; hãy làm trực tiếp trên "
    "thiết bị.",
    "en": "This device does not let me do that from a chat; please do it on the device itself.",
}
_NEEDS_VALUE = {
    "vi": "Tôi chưa rõ bạn muốn đặt giá trị nào; hãy nói ví dụ \u201cđặt âm lượng 50\u201d.",
    "en": "I'm not sure which value you want; say for example \u201cset the volume to 50\u201d.",
}
_OUT_OF_RANGE = {
    "vi": "Giá trị đó nằm ngoài khoảng thiết bị cho phép ({problem}).",
    "en": "That value is outside what the device accepts ({problem}).",
}


def device_reply(intent: Intent, result_text: str, ok: bool, language: Language) -> str:
    """One sentence about a tool call, for offline answers (never the raw device error, never
    a status tool's JSON: the state it reports is said in words)."""
    if not ok:
        return _FAILED[language]
    key = intent.concept
    value: Any = next(iter(intent.arguments.values()), "")
    if key == "led":
        key = "led_off" if intent.arguments.get("on") is False else "led_on"
    if key == "status":
        return state_reply(intent.asked or ("status",), result_text, language)
    if language == "vi" and isinstance(value, str):
        value = VALUE_NAMES_VI.get(value, value)
    template = _DONE.get(key)
    if template is None:
        return _GENERIC_DONE[language]
    return template[language].format(value=value)


def unserved_reply(language: Language) -> str:
    """What offline mode says to a device request that none of the functions serves."""
    return _UNSERVED[language]


def rejected_reply(intent: Intent, language: Language) -> str:
    """What offline mode says when the value asked for is missing or outside the tool's range."""
    if intent.problem:
        return _OUT_OF_RANGE[language].format(problem=intent.problem)
    return _NEEDS_VALUE[language]
