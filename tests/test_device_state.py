"""Questions about the device's state in offline mode: routed to the device's reading tool
(never one that changes it) and answered in one sentence from the fields its JSON reports,
in the question's language; steps said with their size ("raise the volume by 10")."""

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backend.chat import (
    CHAT_MIGRATIONS,
    ChatEvent,
    ChatService,
    Done,
    SqliteMemoryStore,
    Token,
    ToolStarted,
    TurnRequest,
    collect,
)
from backend.chat.device_state import asked_topics, state_reply
from backend.chat.llm import FunctionSpec
from backend.chat.offline import IntentDetector
from backend.chat.tools import DeviceToolBox
from backend.mcp_session import CallResult
from backend.storage import Database
from testkit.asr_helpers import device_functions
from testkit.in_process import FirmwareDevice

STATUS = "self.get_device_status"
# The stock xiaozhi-esp32 status of a battery board (WifiBoard::GetDeviceStatusJson's shape).
STOCK_STATUS = {
    "audio_speaker": {"volume": 40},
    "screen": {"brightness": 75, "theme": "dark"},
    "battery": {"level": 55, "charging": True},
    "network": {"type": "wifi", "ssid": "Xiaozhi", "rssi": -60, "signal": "strong"},
    "chip": {"temperature": 41.5},
}


class StockStatusDevice(FirmwareDevice):
    """The simulated firmware, whose status tool answers with a stock board's JSON."""

    def __init__(self, status: dict[str, Any]) -> None:
        super().__init__()
        self.status = status

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, **kwargs: Any
    ) -> CallResult:
        if name != STATUS:
            return await super().call_tool(name, arguments, **kwargs)
        self.calls.append((name, dict(arguments or {})))
        text = json.dumps(self.status)
        return CallResult.from_wire({"content": [{"type": "text", "text": text}]})


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


async def ask(service: ChatService, device: FirmwareDevice, text: str) -> list[ChatEvent]:
    return await collect(service.run_turn(TurnRequest(text=text), DeviceToolBox(device)))


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("what is the volume now", "The volume is 40."),
        ("how loud is the speaker", "The volume is 40."),
        ("Volume?", "The volume is 40."),
        ("what is the screen brightness", "The screen brightness is 80."),
        ("what theme is the screen", "The theme is light."),
        ("is the light on", "The device does not report its light state."),
        ("is wifi connected", "The device is on Wi-Fi sim-net with a strong signal."),
        ("what is the device status", "The volume is 40 and the screen brightness is 80."),
        (
            "what is the volume and the brightness?",
            "The volume is 40 and the screen brightness is 80.",
        ),
        ("what firmware are you running", "The device does not report its firmware version."),
        ("show me the system information", "The volume is 40 and the screen brightness is 80."),
        ("Âm lượng bao nhiêu?", "Âm lượng là 40."),
        ("âm lượng hiện tại là bao nhiêu", "Âm lượng là 40."),
        ("đèn có bật không", "Thiết bị không cho biết trạng thái đèn."),
        ("Kiểm tra trạng thái thiết bị", "Âm lượng là 40 và độ sáng màn hình là 80."),
    ],
)
async def test_a_state_question_reads_the_status_and_says_one_sentence(
    offline: ChatService, text: str, answer: str
) -> None:
    device = FirmwareDevice()
    device.hal.set_volume(40)
    device.hal.changes.clear()
    events = await ask(offline, device, text)
    assert started(events) == [(STATUS, {})]  # one reading call, nothing that changes the device
    assert spoken(events) == answer
    assert device.hal.changes == [] and device.hal.led_on is False
    done = events[-1]
    assert isinstance(done, Done) and done.metadata.guardrail.reason == "device request"


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("how much battery is left", "The battery is charging at 55 percent."),
        (
            "what is the device status",
            "The volume is 40 and the battery is charging at 55 percent.",
        ),
        ("how hot is the chip? what's the temperature", "The chip is at 41.5 degrees."),
        ("is it dark mode", "The theme is dark."),
        ("is the device online", "The device is on Wi-Fi Xiaozhi with a strong signal."),
        ("pin còn bao nhiêu", "Pin đang sạc, đạt 55 phần trăm."),
        ("giao diện là gì", "Giao diện là tối."),
        ("nhiệt độ chip bao nhiêu", "Chip đang ở 41,5 độ."),
    ],
)
async def test_the_fields_of_a_stock_status_are_said_in_words(
    offline: ChatService, text: str, answer: str
) -> None:
    events = await ask(offline, StockStatusDevice(STOCK_STATUS), text)
    assert started(events) == [(STATUS, {})]
    assert spoken(events) == answer


async def test_a_general_status_question_says_the_volume_and_the_battery(
    offline: ChatService,
) -> None:
    status = {**STOCK_STATUS, "battery": {"level": 55, "charging": False}}
    events = await ask(offline, StockStatusDevice(status), "What's the device status?")
    assert spoken(events) == "The volume is 40 and the battery is at 55 percent."


async def test_the_firmware_is_read_from_the_system_info_tool_when_the_chat_may_use_it(
    offline: ChatService,
) -> None:
    device = FirmwareDevice()  # stock: get_system_info is the user's; here the chat's too
    device.tools = [tool.model_copy(update={"annotations": None}) for tool in device.tools]
    for question in ("what firmware are you running", "show me the system information"):
        events = await ask(offline, device, question)
        assert started(events) == [("self.get_system_info", {})]
        assert spoken(events) == "The firmware version is 1."
    assert device.hal.reboots == 0  # self.reboot is beside it, and never a reading tool


async def test_a_question_without_a_reading_tool_never_moves_the_device(
    offline: ChatService,
) -> None:
    """Before, "is the light on" switched the LED on; without a status tool nothing is called."""
    device = FirmwareDevice()
    device.tools = [tool for tool in device.tools if tool.name != STATUS]
    events = await ask(offline, device, "is the light on")
    assert started(events) == [] and device.hal.led_on is False
    assert spoken(events) == "This device does not tell me its state."


def test_a_setter_is_never_taken_for_the_reading_tool() -> None:
    setter = FunctionSpec(
        "self_status_led_set", "Set the status LED.", {"type": "object", "properties": {}}
    )
    detector = IntentDetector()
    question = detector.state_question("what is the status", [setter])
    assert question is not None and question.llm_name == ""  # asked, but nothing may answer
    assert detector.status_function([setter]) is None


@pytest.mark.parametrize(
    ("text", "tool", "arguments"),
    [
        ("turn on the light", "self.led.set", {"on": True}),
        ("bật đèn", "self.led.set", {"on": True}),
        ("switch to light mode", "self.screen.set_theme", {"theme": "light"}),
        ("set the volume to 30 and tell me the brightness", None, None),
    ],
)
async def test_commands_stay_commands(
    offline: ChatService, text: str, tool: str | None, arguments: dict[str, Any] | None
) -> None:
    device = FirmwareDevice()
    calls = started(await ask(offline, device, text))
    if tool is None:  # a command, then a question: the change first, then the reading
        assert calls == [("self.audio_speaker.set_volume", {"volume": 30}), (STATUS, {})]
    else:
        assert calls == [(tool, arguments)]


@pytest.mark.parametrize(
    "text",
    ["what is the speed of light", "what is the speed of sound", "how much do you charge"],
)
async def test_questions_that_are_not_about_the_device_are_not_routed(text: str) -> None:
    detector = IntentDetector()
    assert detector.plan(text, device_functions()).intents == []
    assert not detector.is_device_request(text, device_functions())


@pytest.mark.parametrize(
    ("text", "level", "wanted"),
    [
        ("raise the volume by 10", 40, 50),
        ("turn the volume up by 25 percent", 40, 65),
        ("lower the volume by 15", 40, 25),
        ("tăng âm lượng thêm 20", 40, 60),
        ("giảm âm lượng bớt 30", 20, 0),  # within the tool's minimum
        ("set the volume to 10", 40, 10),  # a level, not a step
    ],
)
async def test_a_step_said_with_its_size_moves_by_that_size(
    offline: ChatService, text: str, level: int, wanted: int
) -> None:
    device = FirmwareDevice()
    device.hal.set_volume(level)
    await ask(offline, device, text)
    assert device.hal.get_volume() == wanted


@pytest.mark.parametrize(
    ("asked", "status", "language", "answer"),
    [
        (("led",), {"led": {"on": True}}, "en", "The light is on."),
        (("led",), {"led": {"state": "off"}}, "vi", "Đèn đang tắt."),
        (
            ("volume", "firmware"),
            {"volume": 12},
            "en",
            "The volume is 12. The device does not report its firmware version.",
        ),
        (
            ("screen",),
            {"screen": {"brightness": 3}},
            "en",
            "The screen brightness is 3. The device does not report its theme.",
        ),
        (
            ("network",),
            {"network": {"type": "cellular", "carrier": "Viettel"}},
            "en",
            "The device is on the mobile network Viettel.",
        ),
        (("status",), {}, "en", "The device does not report its state."),
        (("volume",), "not json", "en", "The device does not report its state."),
        (
            ("volume",),
            {"audio_speaker": {"volume": True}},
            "en",
            "The device does not report its volume.",
        ),
    ],
)
def test_state_replies(
    asked: tuple[str, ...], status: dict[str, Any] | str, language: Any, answer: str
) -> None:
    text = status if isinstance(status, str) else json.dumps(status)
    assert state_reply(asked, text, language) == answer


def test_asked_topics() -> None:
    assert asked_topics("is the light on") == ("led",)
    assert asked_topics("turn the light on") == ()
    assert asked_topics("the volume", questioned=True) == ("volume",)
    assert asked_topics("the volume") == ()
    assert asked_topics("what is the battery status") == ("battery",)
    assert asked_topics("how is the screen") == ("screen",)
