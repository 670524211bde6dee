"""Offline mode: rule-based device intents, language detection, the fixed evaluation set, and
the offline assistant through whole turns (steps up and down, requests no tool serves, replies
in one language, the sources cited for bleeding gums)."""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backend.chat import (
    CHAT_MIGRATIONS,
    ChatEvent,
    ChatService,
    SqliteMemoryStore,
    Token,
    ToolStarted,
    TurnRequest,
    collect,
)
from backend.chat.evaluation import evaluate_offline
from backend.chat.knowledge import KnowledgeBase, kb_terms
from backend.chat.language import detect_language
from backend.chat.llm import FunctionSpec
from backend.chat.offline import (
    DEFAULT_LEVEL,
    LEVEL_STEP,
    IntentDetector,
    current_level,
    extractive_answer,
    fill_arguments,
    split_clauses,
    stepped,
    with_description_choices,
)
from backend.chat.tools import DeviceToolBox
from backend.storage import Database
from testkit.in_process import FirmwareDevice

TARGET_SHARE = 0.90  # the target for routing and refusal


@pytest.fixture(scope="module")
def functions() -> list[FunctionSpec]:
    box = DeviceToolBox(FirmwareDevice())
    return [with_description_choices(spec) for spec in box.functions()]


@pytest.mark.parametrize(
    ("text", "language"),
    [
        ("Một ngày nên đánh răng bao nhiêu lần?", "vi"),
        ("mot ngay nen danh rang bao nhieu lan", "vi"),
        ("toi bi chay mau chan rang", "vi"),
        ("How often should I brush?", "en"),
        ("set volume 30", "en"),
        ("", "en"),
    ],
)
def test_language_detection(text: str, language: str) -> None:
    assert detect_language(text) == language


def test_clauses() -> None:
    assert split_clauses("set the volume to 30 and tell me how long I should brush") == [
        "set the volume to 30",
        "tell me how long I should brush",
    ]
    assert split_clauses("Bật đèn, rồi đặt âm lượng 20") == ["Bật đèn", "đặt âm lượng 20"]


@pytest.mark.parametrize(
    ("text", "tool", "arguments"),
    [
        ("Đặt âm lượng 30", "self_audio_speaker_set_volume", {"volume": 30}),
        ("dat am luong 70", "self_audio_speaker_set_volume", {"volume": 70}),
        ("volume at maximum", "self_audio_speaker_set_volume", {"volume": 100}),
        ("độ sáng màn hình 50%", "self_screen_set_brightness", {"brightness": 50}),
        ("bật đèn", "self_led_set", {"on": True}),
        ("turn the lights off", "self_led_set", {"on": False}),
        ("đèn led sáng 40", "self_led_set", {"on": True, "brightness": 40}),
        ("chuyển sang chế độ tối", "self_screen_set_theme", {"theme": "dark"}),
        ("switch to light mode", "self_screen_set_theme", {"theme": "light"}),
    ],
)
def test_device_intents(
    text: str, tool: str, arguments: dict[str, Any], functions: list[FunctionSpec]
) -> None:
    intent = IntentDetector().detect(text, functions)
    assert intent is not None and intent.confidence >= 0.7
    assert (intent.llm_name, intent.arguments) == (tool, arguments)


@pytest.mark.parametrize(
    "text",
    ["set the volume", "volume 150", "what is the speed of light", "âm lượng"],
)
def test_vague_or_invalid_requests_stay_below_the_threshold(
    text: str, functions: list[FunctionSpec]
) -> None:
    detector = IntentDetector()
    intent = detector.detect(text, functions)
    assert intent is None or intent.confidence < detector.threshold
    assert detector.plan(text, functions).intents == []


def test_values_are_fitted_to_the_schema() -> None:
    schema = {
        "type": "object",
        "properties": {"level": {"type": "integer", "minimum": 10, "maximum": 20}},
        "required": ["level"],
    }
    assert fill_arguments("level 15", schema)[:3] == ({"level": 15}, [], None)
    arguments, missing, problem, _given = fill_arguments("level 25", schema)
    assert arguments == {} and missing == ["level"] and problem == "25 is above the maximum 20"
    assert fill_arguments("level max", schema)[0] == {"level": 20}


def test_extractive_answer_quotes_the_closest_sentences() -> None:
    kb = KnowledgeBase.bundled()
    results = kb.search("how long should I brush", 2, language="en")
    answer = extractive_answer("how long should I brush", results, "en")
    assert "2 minutes" in answer


async def test_offline_evaluation_set_meets_the_targets() -> None:
    report = await evaluate_offline(FirmwareDevice)
    assert len(report.outcomes) >= 40
    languages = {outcome.item["lang"] for outcome in report.outcomes}
    assert languages == {"vi", "en"}
    for good, total in (report.routed, report.refused):
        assert total >= 10 and good / total >= TARGET_SHARE, report.failures()
    good, total = report.answered
    assert good / total >= TARGET_SHARE, report.failures()


# ---- the offline assistant through whole turns ----------------------------------------------


@pytest.fixture
async def offline(tmp_path: Path) -> AsyncIterator[ChatService]:
    database = Database(tmp_path / "chat.sqlite3", CHAT_MIGRATIONS)
    await database.open()
    yield ChatService(SqliteMemoryStore(database), None, None)
    await database.close()


def spoken(events: list[ChatEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, Token))


def started(events: list[ChatEvent]) -> list[tuple[str, dict[str, Any]]]:
    return [(e.tool, e.arguments) for e in events if isinstance(e, ToolStarted)]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("turn it down", "I'm not sure which value you want"),
        ("tăng âm lượng lên", "Tôi chưa rõ bạn muốn đặt giá trị nào"),
    ],
)
async def test_a_step_without_a_reported_level_asks_for_a_value(
    offline: ChatService, text: str, said: str
) -> None:
    """A device at 10 with no status tool was set to 40 by "turn it down" (a step from 50)."""
    device = FirmwareDevice()
    device.tools = [tool for tool in device.tools if tool.name != "self.get_device_status"]
    device.hal.set_volume(10)
    events = await collect(offline.run_turn(TurnRequest(text=text), DeviceToolBox(device)))
    assert started(events) == []
    assert device.hal.get_volume() == 10
    assert spoken(events).startswith(said)


@pytest.mark.parametrize(
    ("text", "level", "wanted", "said"),
    [
        ("tăng âm lượng lên", 70, 80, "Đã chỉnh âm lượng thành 80."),
        ("turn it up", 70, 80, "Volume set to 80."),
        ("turn the volume up", 95, 100, "Volume set to 100."),  # within the tool's maximum
        ("giảm âm lượng", 70, 60, "Đã chỉnh âm lượng thành 60."),
        ("turn it down", 4, 0, "Volume set to 0."),  # within its minimum
    ],
)
async def test_turning_a_level_up_or_down_moves_it_by_a_step_from_where_it_is(
    offline: ChatService, text: str, level: int, wanted: int, said: str
) -> None:
    device = FirmwareDevice()
    device.hal.set_volume(level)
    events = await collect(offline.run_turn(TurnRequest(text=text), DeviceToolBox(device)))
    assert started(events) == [
        ("self.get_device_status", {}),  # where the level is now
        ("self.audio_speaker.set_volume", {"volume": wanted}),
    ]
    assert device.hal.get_volume() == wanted
    assert spoken(events) == said
    assert events[-1].metadata.guardrail.verdict == "passed"  # type: ignore[attr-defined]


def test_a_step_needs_the_level_the_device_reports(
    functions: list[FunctionSpec],
) -> None:
    volume_only = [spec for spec in functions if "volume" in spec.llm_name]
    detector = IntentDetector()
    assert detector.status_function(volume_only) is None
    intent = detector.detect("turn the volume down", volume_only)
    assert intent is not None and intent.confidence >= detector.threshold
    assert intent.arguments == {"volume": DEFAULT_LEVEL - LEVEL_STEP}
    assert stepped(intent, None) is None  # from a guess, "down" could end up louder
    assert stepped(intent, 30).arguments == {"volume": 30 - LEVEL_STEP}
    # A value said outright is the value; up and down together are no step.
    said = detector.detect("turn the volume up to 35", volume_only)
    assert said is not None and said.arguments == {"volume": 35} and said.step is None
    both = detector.detect("volume up or down?", volume_only)
    assert both is None or both.confidence < detector.threshold


@pytest.mark.parametrize(
    ("status", "level"),
    [
        ('{"audio_speaker": {"volume": 40}}', 40),
        ('{"a": [{"volume": 12.6}]}', 13),
        ('{"audio_speaker": {"volume": true}}', None),  # not a level
        ('{"audio_speaker": {"volume": "loud"}}', None),
        ("not json", None),
        ("", None),
        ("[1, 2]", None),
    ],
)
def test_the_current_level_is_read_from_the_status_answer(status: str, level: int | None) -> None:
    assert current_level(status, "volume") == level


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("reboot the device", "This device does not let me do that from a chat"),
        ("Restart the speaker please", "This device does not let me do that from a chat"),
        ("khởi động lại thiết bị", "Thiết bị này không cho phép tôi làm việc đó"),
    ],
)
async def test_a_device_request_no_tool_serves_is_answered_not_refused_as_off_topic(
    offline: ChatService, text: str, answer: str
) -> None:
    device = FirmwareDevice()  # its reboot tool is the user's (audience: user), not the chat's
    events = await collect(offline.run_turn(TurnRequest(text=text), DeviceToolBox(device)))
    meta = events[-1].metadata  # type: ignore[attr-defined]
    assert meta.guardrail.verdict == "passed" and meta.guardrail.reason == "device request"
    assert spoken(events).startswith(answer)
    assert device.calls == [] and device.hal.reboots == 0
    # Without a device the turn asks which device, naming the ones the caller may use.
    request = TurnRequest(text=text, device_choices=["kitchen", "desk"])
    alone = await collect(offline.run_turn(request))
    assert alone[-1].metadata.guardrail.reason == "device request, no device"  # type: ignore[attr-defined]
    assert "kitchen, desk" in spoken(alone) and device.calls == []


@pytest.mark.parametrize(
    ("text", "said", "foreign"),
    [
        ("chuyển sang giao diện tối", "Đã đổi sang giao diện tối.", "dark"),
        ("đổi giao diện sáng", "Đã đổi sang giao diện sáng.", "light"),
        ("switch to dark mode", "Theme changed to dark.", "tối"),
    ],
)
async def test_a_theme_change_is_said_in_the_language_of_the_request(
    offline: ChatService, text: str, said: str, foreign: str
) -> None:
    events = await collect(
        offline.run_turn(TurnRequest(text=text), DeviceToolBox(FirmwareDevice()))
    )
    assert spoken(events) == said and foreign not in spoken(events)


GUM_WORDS = ("gum", "bleed", "nướu", "lợi", "chảy máu")


@pytest.mark.parametrize(
    ("query", "language"),
    [
        ("Tại sao chân răng bị chảy máu?", "vi"),
        ("Chảy máu chân răng phải làm sao?", "vi"),
        ("Nướu bị chảy máu", "vi"),
        ("Why do my gums bleed?", "en"),
        ("Why are my gums bleeding?", "en"),
        ("My gums bleed when I brush, what should I do?", "en"),
    ],
)
async def test_every_source_cited_for_bleeding_gums_is_about_gums_or_bleeding(
    offline: ChatService, query: str, language: str
) -> None:
    kb = KnowledgeBase.bundled()
    events = await collect(offline.run_turn(TurnRequest(text=query)))
    sources = events[-1].metadata.sources  # type: ignore[attr-defined]
    assert sources and sources[0].link == "https://www.nhs.uk/conditions/gum-disease/"
    for source in sources:
        [entry] = [e for e in kb.entries if f"{e.title} ({e.source})" == source.title]
        assert entry.lang == language
        text = f"{entry.title} {entry.content}".lower()
        assert any(word in text for word in GUM_WORDS), entry.id
        assert entry.topic != "knocked-out"


def test_bleed_and_bleeding_are_one_term() -> None:
    assert kb_terms("bleed")[0] == kb_terms("bleeding")[0] == kb_terms("bleeds")[0] == "bleed"


async def test_make_the_screen_dimmer_lowers_the_brightness_a_step(offline: ChatService) -> None:
    device = FirmwareDevice()
    before = device.hal.get_brightness()
    events = await collect(
        offline.run_turn(TurnRequest(text="make the screen dimmer"), DeviceToolBox(device))
    )
    assert ("self.screen.set_brightness", {"brightness": before - 10}) in started(events)
    assert device.hal.get_brightness() == before - 10
