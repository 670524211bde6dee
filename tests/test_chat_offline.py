"""Offline mode: rule-based device intents, language detection, and the fixed evaluation set."""

from typing import Any

import pytest

from backend.chat.evaluation import evaluate_offline
from backend.chat.language import detect_language
from backend.chat.llm import FunctionSpec
from backend.chat.offline import (
    IntentDetector,
    extractive_answer,
    fill_arguments,
    split_clauses,
    with_description_choices,
)
from backend.chat.search import KnowledgeBase
from backend.chat.tools import DeviceToolBox
from simulator.in_process import FirmwareDevice

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
    ["turn the volume up", "volume 150", "what is the speed of light", "âm lượng"],
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
