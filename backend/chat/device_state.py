"""Questions about a device's own state ("what is the volume now", "is the light on", "pin còn
bao nhiêu"), answered in one short sentence from what its status tool reports.

A clause asks about the state when it names a setting or part of the device
(`lexicon.STATE_TOPICS`: volume, brightness, theme, LED, battery, network, firmware, chip
temperature, the screen, the status as a whole), is a question (a question word, a clause
opened by "is/are/does...", a "?" after it, a Vietnamese yes/no ending such as "không") and
asks for no change (set, turn, tăng...; bật/tắt only outside a yes/no question). The offline
router then calls the device's reading tool (never one that changes it) and `state_reply` says
what its JSON answer reports on the topics asked, in the request's language, never the JSON.

The JSON shapes read are the stock xiaozhi-esp32 ones: `get_device_status` gives
`audio_speaker.volume`, `screen.brightness`, `screen.theme`, `battery.level` and `.charging`,
`network.type` / `ssid` / `carrier` / `signal`, `chip.temperature`; `get_system_info` gives
`application.version`. Other names a device might use are tried after them (`_PATHS`).
"""

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from backend.chat.lexicon import (
    CHANGE_WORDS,
    QUESTION_WORDS,
    STATE_TOPICS,
    SWITCH_WORDS_VI,
    VALUE_NAMES_VI,
    YES_NO_ENDINGS,
    PhraseMatcher,
    longest_matches,
)
from backend.chat.text import Language, nfc_lower

TOPIC_ORDER = (
    *("volume", "brightness", "theme", "led", "battery", "network", "firmware", "temperature"),
    *("screen", "system", "status"),
)
# "what is the device status": the volume, then the battery (or, without one, the screen).
GENERAL = ("volume", "battery", "brightness")
GENERAL_FACTS = 2

_topics = {topic: PhraseMatcher(phrases) for topic, phrases in STATE_TOPICS.items()}
_questions = PhraseMatcher(QUESTION_WORDS)
_changes = PhraseMatcher(CHANGE_WORDS)
_switches = PhraseMatcher(SWITCH_WORDS_VI)
_yes_no = PhraseMatcher(YES_NO_ENDINGS)
_OPENS_QUESTION = re.compile(
    r"^(?:(?:hey|ok|okay|so|and|please|now)\s+)*(?:is|are|was|were|does|do|did|has|have)\b"
)
_ON_OFF = re.compile(r"\b(?:on|off)\b")

# Where each value is in the status JSON, most likely first (paths from the top).
_PATHS: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "volume": (("audio_speaker", "volume"), ("speaker", "volume"), ("volume",)),
    "brightness": (
        *(("screen", "brightness"), ("display", "brightness"), ("backlight", "brightness")),
        ("brightness",),
    ),
    "theme": (("screen", "theme"), ("display", "theme"), ("theme",)),
    "led": (("led", "on"), ("led", "state"), ("light", "on"), ("lamp", "on"), ("led",)),
    "battery": (
        *(("battery", "level"), ("battery", "percentage"), ("battery", "percent")),
        ("battery_level",),
    ),
    "charging": (("battery", "charging"),),
    "firmware": (
        *(("application", "version"), ("firmware", "version"), ("firmware_version",)),
        *(("fw_version",), ("firmware",)),
    ),
    "temperature": (("chip", "temperature"), ("temperature",)),
}
_NUMERIC = frozenset({"volume", "brightness", "battery", "temperature"})
_FACTS: Mapping[str, Mapping[Language, str]] = {
    "volume": {"en": "the volume is {value}", "vi": "âm lượng là {value}"},
    "brightness": {"en": "the screen brightness is {value}", "vi": "độ sáng màn hình là {value}"},
    "theme": {"en": "the theme is {value}", "vi": "giao diện là {value}"},
    "led": {"en": "the light is {value}", "vi": "đèn đang {value}"},
    "battery": {"en": "the battery is at {value} percent", "vi": "pin còn {value} phần trăm"},
    "firmware": {"en": "the firmware version is {value}", "vi": "phiên bản phần mềm là {value}"},
    "temperature": {"en": "the chip is at {value} degrees", "vi": "chip đang ở {value} độ"},
}
_CHARGING: Mapping[Language, str] = {
    "en": "the battery is charging at {value} percent",
    "vi": "pin đang sạc, đạt {value} phần trăm",
}
_SWITCHED: Mapping[Language, tuple[str, str]] = {"en": ("off", "on"), "vi": ("tắt", "bật")}
_SIGNAL_VI = {"strong": "mạnh", "medium": "trung bình", "weak": "yếu", "very weak": "rất yếu"}
_NAMES: Mapping[str, Mapping[Language, str]] = {
    "volume": {"en": "volume", "vi": "âm lượng"},
    "brightness": {"en": "screen brightness", "vi": "độ sáng màn hình"},
    "theme": {"en": "theme", "vi": "giao diện"},
    "led": {"en": "light state", "vi": "trạng thái đèn"},
    "battery": {"en": "battery level", "vi": "mức pin"},
    "network": {"en": "network", "vi": "mạng"},
    "firmware": {"en": "firmware version", "vi": "phiên bản phần mềm"},
    "temperature": {"en": "temperature", "vi": "nhiệt độ"},
    "status": {"en": "state", "vi": "trạng thái"},
}
_MISSING: Mapping[Language, str] = {
    "en": "The device does not report its {what}.",
    "vi": "Thiết bị không cho biết {what}.",
}
_AND: Mapping[Language, str] = {"en": "and", "vi": "và"}
_OR: Mapping[Language, str] = {"en": "or", "vi": "hay"}
_NO_READING_TOOL: Mapping[Language, str] = {
    "en": "This device does not tell me its state.",
    "vi": "Thiết bị này không cho tôi biết trạng thái của nó.",
}


# ---- the question ---------------------------------------------------------------------------


def asked_topics(clause: str, *, questioned: bool = False) -> tuple[str, ...]:
    """The state topics a clause asks about, in `TOPIC_ORDER`; () when it is not a question
    about the device's state. `questioned`: a "?" followed the clause."""
    topics = _topics_in(clause)
    if not topics or _changes.find(clause):
        return ()
    yes_no = _ends_yes_no(clause)
    if _switches.find(clause) and not yes_no:
        return ()  # "bật đèn": a change; "đèn có bật không": a question
    if not (questioned or yes_no or _questions.find(clause) or _opens_question(clause)):
        return ()
    return tuple(topic for topic in TOPIC_ORDER if topic in topics)


def has_topic(clause: str) -> bool:
    """Whether a clause names a state topic and no change ("and the battery?" after a state
    question)."""
    return bool(_topics_in(clause)) and not _changes.find(clause) and not _switches.find(clause)


def _topics_in(clause: str) -> set[str]:
    topics = longest_matches(_topics, clause)
    if "light" in topics:  # "is the light on", not "the speed of light"
        topics.discard("light")
        if _ON_OFF.search(nfc_lower(clause)):
            topics.add("led")
    if "screen" in topics and topics & {"brightness", "theme"}:
        topics.discard("screen")  # "the screen brightness" asks for the brightness only
    specific = topics - {"status", "system"}
    return specific or topics  # "the battery status" asks for the battery


def _opens_question(clause: str) -> bool:
    return bool(_OPENS_QUESTION.match(nfc_lower(clause).strip()))


def _ends_yes_no(clause: str) -> bool:
    hits = _yes_no.find(clause)
    subject = nfc_lower(clause).rstrip(" ?.!")
    return bool(hits) and hits[-1].end >= len(subject)


# ---- the answer -----------------------------------------------------------------------------


def state_reply(asked: Sequence[str], result_text: str, language: Language) -> str:
    """One sentence on the topics asked, from a status tool's JSON answer; what it does not
    report is said as such. Never the JSON itself."""
    status = _json_object(result_text)
    if status is None:
        return _MISSING[language].format(what=_NAMES["status"][language])
    facts: list[str] = []
    missing: list[str] = []
    for topic in _expanded(asked, status, language):
        fact = _fact(topic, status, language)
        if fact:
            facts.append(fact)
        else:
            missing.append(_NAMES[topic][language])
    said = [_sentence(facts, _AND[language])] if facts else []
    if missing:
        said.append(_MISSING[language].format(what=_joined(missing, _OR[language])))
    return " ".join(said)


def no_reading_tool_reply(language: Language) -> str:
    """What offline mode says to a state question when the device has no tool that reads it."""
    return _NO_READING_TOOL[language]


def _expanded(asked: Sequence[str], status: dict[str, Any], language: Language) -> list[str]:
    topics: list[str] = []
    for topic in asked:
        if topic == "screen":
            topics += ["brightness", "theme"]
        elif topic == "system" and _value(status, "firmware") is not None:
            topics.append("firmware")
        elif topic in ("status", "system"):
            reported = [name for name in GENERAL if _fact(name, status, language)]
            topics += reported[:GENERAL_FACTS] or ["status"]
        else:
            topics.append(topic)
    return list(dict.fromkeys(topics))


def _fact(topic: str, status: dict[str, Any], language: Language) -> str | None:
    """One fact as a clause ("the volume is 40"), None when the status does not report it."""
    if topic == "network":
        return _network(status, language)
    if topic not in _FACTS:
        return None
    value = _value(status, topic)
    said = _said_value(topic, value, language)
    if said is None:
        return None
    charging = topic == "battery" and _value(status, "charging") is True
    return (_CHARGING if charging else _FACTS[topic])[language].format(value=said)


def _said_value(topic: str, value: Any, language: Language) -> str | None:
    if value is None or isinstance(value, dict | list):
        return None
    if topic in _NUMERIC:
        return _number(value, language)
    if topic == "led":
        on = _switched(value)
        return None if on is None else _SWITCHED[language][on]
    text = str(value).strip()
    if topic == "theme" and language == "vi":
        text = VALUE_NAMES_VI.get(text.lower(), text)
    return text or None


def _network(status: dict[str, Any], language: Language) -> str | None:
    network = status.get("network")
    if not isinstance(network, dict):
        return None
    kind = str(network.get("type", "")).lower()
    ssid, carrier, signal = network.get("ssid"), network.get("carrier"), network.get("signal")
    if kind in ("wifi", "wi-fi") or (not kind and ssid):
        where = {"en": "on Wi-Fi", "vi": "dùng Wi-Fi"}[language] + (f" {ssid}" if ssid else "")
    elif kind in ("cellular", "4g", "ml307", "modem"):
        where = {"en": "on the mobile network", "vi": "dùng mạng di động"}[language]
        where += f" {carrier}" if carrier else ""
    elif kind:
        where = {"en": f"on {kind}", "vi": f"dùng {kind}"}[language]
    else:
        return None
    fact = {"en": "the device is ", "vi": "thiết bị đang "}[language] + where
    if isinstance(signal, str) and signal:
        if language == "vi":
            fact += f", sóng {_SIGNAL_VI.get(signal.lower(), signal)}"
        else:
            fact += f" with a {signal.lower()} signal"
    return fact


def _value(status: dict[str, Any], topic: str) -> Any:
    for path in _PATHS[topic]:
        item: Any = status
        for key in path:
            item = item.get(key) if isinstance(item, dict) else None
        if item is not None and not isinstance(item, dict | list):
            return item
    return None


def _number(value: Any, language: Language) -> str | None:
    if isinstance(value, str):
        try:
            value = float(value.strip().rstrip("%"))
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if float(value).is_integer():
        return str(int(value))
    text = f"{value:.1f}"
    return text.replace(".", ",") if language == "vi" else text  # "41,5 độ"


def _switched(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value > 0
    if isinstance(value, str) and value.strip().lower() in ("on", "true", "1", "off", "false", "0"):
        return value.strip().lower() in ("on", "true", "1")
    return None


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _sentence(facts: list[str], conjunction: str) -> str:
    text = _joined(facts, conjunction)
    return text[:1].upper() + text[1:] + "."


def _joined(items: list[str], conjunction: str) -> str:
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} {conjunction} {items[-1]}"
