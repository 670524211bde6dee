"""ChatService turns end to end: the fake LLM on loopback (both wire formats), real memory on
SQLite, and for device control a real simulated device connected to a real bridge."""

import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog

from backend import metrics
from backend.chat import (
    CHAT_MIGRATIONS,
    ChatEvent,
    ChatService,
    DeviceToolBox,
    Done,
    SearchResult,
    Sources,
    SqliteMemoryStore,
    Token,
    ToolCompleted,
    ToolFailed,
    ToolSource,
    ToolStarted,
    TurnRequest,
    collect,
    parse_event,
)
from backend.chat.llm import LlmProvider, OllamaProvider, OpenAiProvider, Usage
from backend.chat.prompts import INVALID_TOOL_CALL_ANSWER
from backend.devices import Device
from backend.server import Bridge
from backend.storage import Database
from simulator import SimulatedDevice
from testkit.in_process import FirmwareDevice
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import DEVICE_TOKEN
from tests.fakes.search import FakeWebSearch

MODELS = Usage(chat="chat-model", guardrail="guard-model")
VOLUME = "self.audio_speaker.set_volume"
VOLUME_LLM = "self_audio_speaker_set_volume"
WEB = [
    SearchResult(
        "Brushing your teeth", "Brush twice a day for 2 minutes.", "https://web.example/b"
    ),
    SearchResult("Flossing", "Floss once a day.", "https://web.example/f"),
]


@pytest.fixture
def fake() -> Iterator[FakeLlm]:
    server = FakeLlm().start()
    yield server
    server.stop()


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(tmp_path / "bridge.sqlite3", CHAT_MIGRATIONS)
    await database.open()
    yield database
    await database.close()


@pytest.fixture
def memory(db: Database) -> SqliteMemoryStore:
    return SqliteMemoryStore(db)


@pytest.fixture(params=["openai", "ollama"])
async def llm(request: pytest.FixtureRequest, fake: FakeLlm) -> AsyncIterator[LlmProvider]:
    cls = OpenAiProvider if request.param == "openai" else OllamaProvider
    provider = cls(fake.url, MODELS, api_key="sk-very-secret", timeout_s=5)
    yield provider
    await provider.aclose()


@pytest.fixture
async def openai(fake: FakeLlm) -> AsyncIterator[LlmProvider]:
    provider = OpenAiProvider(fake.url, MODELS, timeout_s=5)
    yield provider
    await provider.aclose()


@pytest.fixture
async def simulated(bridge: Bridge) -> AsyncIterator[tuple[SimulatedDevice, Device]]:
    sim = SimulatedDevice(bridge.ws_url, DEVICE_TOKEN, index=1)
    sim.start()
    await bridge.registry.wait_for_state(sim.device_id)
    yield sim, bridge.registry.require(sim.device_id)
    await sim.stop()


def as_tool_source(device: Device) -> ToolSource:
    """Checked by mypy: the core's Device satisfies the ToolSource protocol as it is."""
    return device


def down_provider() -> LlmProvider:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return OpenAiProvider(f"http://127.0.0.1:{port}", MODELS, timeout_s=2)


def done(events: list[ChatEvent]) -> Done:
    last = events[-1]
    assert isinstance(last, Done), events
    return last


def spoken(events: list[ChatEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, Token))


async def count_rows(db: Database, table: str) -> int:
    row = await db.fetchone(f"SELECT COUNT(*) FROM {table}")
    assert row is not None
    return int(row[0])


# ---- guardrail --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "language"),
    [("Một ngày nên đánh răng bao nhiêu lần?", "vi"), ("How often should I floss?", "en")],
)
async def test_dental_questions_pass_without_asking_the_model(
    text: str, language: str, fake: FakeLlm, openai: LlmProvider, memory: SqliteMemoryStore
) -> None:
    service = ChatService(memory, openai, FakeWebSearch(WEB))
    events = await collect(service.run_turn(TurnRequest(text=text)))
    meta = done(events).metadata
    assert meta.guardrail.verdict == "passed" and meta.guardrail.by == "rules"
    assert meta.language == language and meta.stored
    assert not fake.of_kind("guardrail")


@pytest.mark.parametrize(
    ("text", "language", "refusal"),
    [
        ("Thời tiết Hà Nội hôm nay thế nào?", "vi", "Xin lỗi, tôi là trợ lý tư vấn nha khoa"),
        ("Who won the football match last night?", "en", "Sorry, I'm a dental assistant"),
    ],
)
async def test_off_topic_is_refused_in_the_users_language_and_not_stored(
    text: str,
    language: str,
    refusal: str,
    fake: FakeLlm,
    openai: LlmProvider,
    memory: SqliteMemoryStore,
    db: Database,
) -> None:
    fake.script("guardrail", Reply("NO"))
    search = FakeWebSearch(WEB)
    service = ChatService(memory, openai, search)
    events = await collect(service.run_turn(TurnRequest(text=text, conversation_id="c1")))
    meta = done(events).metadata
    assert spoken(events).startswith(refusal)
    assert meta.guardrail.verdict == "refused" and meta.guardrail.by == "llm"
    assert meta.language == language and not meta.stored and meta.conversation_id == "c1"
    assert await count_rows(db, "chat_conversations") == 0
    assert await count_rows(db, "chat_messages") == 0
    assert search.queries == [] and not fake.of_kind("chat")
    assert text in fake.of_kind("guardrail")[0].messages[0]["content"]


@pytest.mark.parametrize(
    "text",
    ["Best paint brush for walls?", "What is plaque in the arteries?", "Chewing gum brands"],
)
async def test_words_with_a_meaning_outside_dentistry_are_left_to_the_guardrail_model(
    text: str, fake: FakeLlm, openai: LlmProvider, memory: SqliteMemoryStore
) -> None:
    fake.script("guardrail", Reply("NO"))
    refused = await collect(ChatService(memory, openai).run_turn(TurnRequest(text=text)))
    guardrail = done(refused).metadata.guardrail
    assert (guardrail.verdict, guardrail.by) == ("refused", "llm")
    assert text in fake.of_kind("guardrail")[0].messages[0]["content"]
    # With no model to ask, the same words pass: an answer beats a wrong refusal.
    offline = await collect(ChatService(memory, None).run_turn(TurnRequest(text=text)))
    guardrail = done(offline).metadata.guardrail
    assert (guardrail.verdict, guardrail.by) == ("passed", "rules")


async def test_a_clear_dental_question_needs_no_guardrail_model(
    fake: FakeLlm, openai: LlmProvider, memory: SqliteMemoryStore
) -> None:
    fake.script("chat", Reply("Two minutes."))
    text = "How long should I brush my teeth?"
    events = await collect(ChatService(memory, openai).run_turn(TurnRequest(text=text)))
    assert done(events).metadata.guardrail.by == "rules" and not fake.of_kind("guardrail")


async def test_device_request_passes_only_with_a_toolbox(
    fake: FakeLlm, openai: LlmProvider, memory: SqliteMemoryStore
) -> None:
    fake.script("guardrail", Reply("NO"))
    service = ChatService(memory, openai, FakeWebSearch(WEB))
    # Without a device the turn asks which one, by the rules, whatever the model would say.
    asked = TurnRequest(text="Set the volume to 30", device_choices=["kitchen"])
    without = await collect(service.run_turn(asked))
    assert done(without).metadata.guardrail.reason == "device request, no device"
    assert "kitchen" in spoken(without) and not fake.of_kind("guardrail")
    device = FirmwareDevice()
    fake.script("chat", Reply("Done."))
    request = TurnRequest(text="Set the volume to 30")
    with_box = await collect(service.run_turn(request, DeviceToolBox(device)))
    meta = done(with_box).metadata
    assert meta.guardrail.verdict == "passed" and meta.guardrail.reason == "device request"
    assert meta.search == "skipped" and meta.sources == []


# ---- a full turn with a real device -----------------------------------------------------------


async def test_full_turn_sets_volume_on_a_real_simulated_device(
    fake: FakeLlm,
    llm: LlmProvider,
    memory: SqliteMemoryStore,
    simulated: tuple[SimulatedDevice, Device],
) -> None:
    sim, device = simulated
    assert as_tool_source(device) is device
    assert sim.hal.get_volume() != 30
    fake.script(
        "chat",
        Reply(calls=[FakeCall(VOLUME_LLM, {"volume": 30})]),
        Reply("I set the volume to 30. Brush twice a day for two minutes."),
    )
    service = ChatService(memory, llm, FakeWebSearch(WEB))
    text = "Set the volume to 30 and tell me how often I should brush"
    request = TurnRequest(text=text, device_id=device.device_id)
    events = await collect(service.run_turn(request, DeviceToolBox(device)))

    assert sim.hal.get_volume() == 30
    started = [e for e in events if isinstance(e, ToolStarted)]
    completed = [e for e in events if isinstance(e, ToolCompleted)]
    assert [(e.tool, e.llm_name, e.arguments) for e in started] == [
        (VOLUME, VOLUME_LLM, {"volume": 30})
    ]
    assert [(e.tool, e.result_text, e.is_error) for e in completed] == [(VOLUME, "true", False)]
    assert spoken(events) == "I set the volume to 30. Brush twice a day for two minutes."

    first, second = fake.of_kind("chat")
    offered = {tool["function"]["name"]: tool["function"] for tool in first.tools}
    assert set(offered) == {
        "self_get_device_status",
        VOLUME_LLM,
        "self_screen_set_brightness",
        "self_screen_set_theme",
        "self_led_set",
    }  # user-only tools (system info, reboot) are not offered to the model
    assert offered[VOLUME_LLM]["parameters"] == device.tools.by_name[VOLUME].input_schema
    tool_message = second.messages[-1]
    assert tool_message["role"] == "tool" and tool_message["content"] == "true"
    assert second.messages[-2]["tool_calls"][0]["function"]["name"] == VOLUME_LLM
    assert "Brush twice a day for 2 minutes." in first.messages[-1]["content"]  # search results

    sources = [e for e in events if isinstance(e, Sources)]
    assert len(sources) == 1 and sources[0].section.startswith("Sources:\n1. Brushing your teeth")
    meta = done(events).metadata
    assert meta.stored and meta.tool_rounds == 1 and meta.search == "ok" and not meta.offline
    assert meta.answer.endswith(sources[0].section)
    assert meta.conversation_id is not None and meta.device_id == device.device_id
    assert {"language", "guardrail", "memory_load", "search", "llm", "tools"} <= set(meta.steps_ms)

    stored = await memory.get(meta.conversation_id, with_messages=True)
    assert [(m.role, m.content) for m in stored.messages] == [
        ("user", text),
        ("assistant", meta.answer),
    ]
    assert stored.summary == "Summary 1."

    # The next turn from the same device continues the same conversation; the summary grows.
    fake.script("chat", Reply("Floss once a day."))
    follow = TurnRequest(text="And flossing?", device_id=device.device_id)
    again = done(await collect(service.run_turn(follow, DeviceToolBox(device)))).metadata
    assert again.conversation_id == meta.conversation_id
    third = fake.of_kind("chat")[-1]
    assert "Summary 1." in third.messages[-1]["content"]
    assert [m["content"] for m in third.messages[1:3]] == [text, meta.answer.split("\n\n")[0]]
    assert (await memory.get(meta.conversation_id)).summary == "Summary 1.\n\nSummary 2."


async def test_device_failure_goes_to_the_model_not_to_the_user(
    fake: FakeLlm,
    openai: LlmProvider,
    memory: SqliteMemoryStore,
    simulated: tuple[SimulatedDevice, Device],
) -> None:
    sim, device = simulated
    before = sim.hal.get_volume()
    fake.script(
        "chat",
        Reply(calls=[FakeCall(VOLUME_LLM, {"volume": 150})]),
        Reply("The volume goes from 0 to 100; which level would you like?"),
    )
    service = ChatService(memory, openai, FakeWebSearch(WEB))
    request = TurnRequest(text="Set the volume to 150")
    events = await collect(service.run_turn(request, DeviceToolBox(device)))
    failed = [e for e in events if isinstance(e, ToolFailed)]
    assert len(failed) == 1 and failed[0].tool == VOLUME and "150" in failed[0].error
    assert sim.hal.get_volume() == before
    tool_message = fake.of_kind("chat")[1].messages[-1]
    assert tool_message["role"] == "tool" and tool_message["content"].startswith("error:")
    assert spoken(events) == "The volume goes from 0 to 100; which level would you like?"


async def test_missing_scope_keeps_tools_away_and_says_why(
    fake: FakeLlm, openai: LlmProvider, memory: SqliteMemoryStore
) -> None:
    device = FirmwareDevice()
    box = DeviceToolBox(device, unavailable_reason="missing scope devices:call")
    fake.script("chat", Reply("I'm not allowed to change the volume."))
    service = ChatService(memory, openai, FakeWebSearch(WEB))
    events = await collect(service.run_turn(TurnRequest(text="Set the volume to 30"), box))
    failed = [e for e in events if isinstance(e, ToolFailed)]
    assert [(e.tool, e.error) for e in failed] == [(VOLUME, "missing scope devices:call")]
    request = fake.of_kind("chat")[0]
    assert request.tools == [] and "missing scope devices:call" in request.messages[-1]["content"]
    assert device.calls == [] and device.hal.get_volume() != 30


# ---- failures -----------------------------------------------------------------------------------


async def test_invalid_tool_call_json_is_sent_back_once(
    fake: FakeLlm, llm: LlmProvider, memory: SqliteMemoryStore
) -> None:
    device = FirmwareDevice()
    fake.script(
        "chat",
        Reply(calls=[FakeCall(VOLUME_LLM, '{"volume": 3')]),
        Reply(calls=[FakeCall(VOLUME_LLM, {"volume": 35})]),
        Reply("Volume set to 35."),
    )
    service = ChatService(memory, llm, FakeWebSearch(WEB))
    request = TurnRequest(text="Set the volume to 35")
    events = await collect(service.run_turn(request, DeviceToolBox(device)))
    assert [type(e).__name__ for e in events if not isinstance(e, Token)] == [
        "ToolFailed",
        "ToolStarted",
        "ToolCompleted",
        "Done",
    ]
    assert device.hal.get_volume() == 35
    error_message = fake.of_kind("chat")[1].messages[-1]
    assert error_message["role"] == "tool" and "JSON" in error_message["content"]
    assert spoken(events) == "Volume set to 35." and done(events).metadata.tool_rounds == 2


async def test_repeated_invalid_tool_call_json_ends_the_turn_clearly(
    fake: FakeLlm, openai: LlmProvider, memory: SqliteMemoryStore
) -> None:
    bad = Reply(calls=[FakeCall(VOLUME_LLM, "{volume: 3")])
    fake.script("chat", bad, bad, Reply("never requested"))
    service = ChatService(memory, openai, FakeWebSearch(WEB))
    request = TurnRequest(text="Đặt âm lượng 3")
    events = await collect(service.run_turn(request, DeviceToolBox(FirmwareDevice())))
    assert spoken(events) == INVALID_TOOL_CALL_ANSWER["vi"]
    assert len(fake.of_kind("chat")) == 2 and done(events).metadata.stored


async def test_tool_rounds_are_capped_at_five(
    fake: FakeLlm, openai: LlmProvider, memory: SqliteMemoryStore
) -> None:
    device = FirmwareDevice()
    loop = Reply(calls=[FakeCall("self_get_device_status", {})])
    fake.script("chat", *[loop] * 5, Reply("Here is the status."))
    service = ChatService(memory, openai, FakeWebSearch(WEB))
    request = TurnRequest(text="Check the device status")
    events = await collect(service.run_turn(request, DeviceToolBox(device)))
    chat = fake.of_kind("chat")
    assert len(chat) == 6 and all(r.tools for r in chat[:5]) and chat[5].tools == []
    assert done(events).metadata.tool_rounds == 5 and spoken(events) == "Here is the status."


async def test_search_failure_does_not_fail_the_turn(
    fake: FakeLlm, openai: LlmProvider, memory: SqliteMemoryStore
) -> None:
    fake.script("chat", Reply("Brush twice a day."))
    service = ChatService(memory, openai, FakeWebSearch(fail=True))
    events = await collect(service.run_turn(TurnRequest(text="How often should I brush?")))
    meta = done(events).metadata
    assert meta.search == "failed" and "DNSError" in (meta.search_error or "")
    assert spoken(events) == "Brush twice a day." and meta.stored
    assert meta.sources and all(s.origin == "kb" for s in meta.sources)  # the knowledge base
    assert "nhs.uk" in fake.of_kind("chat")[0].messages[-1]["content"]


async def test_llm_down_answers_dental_questions_offline(memory: SqliteMemoryStore) -> None:
    provider = down_provider()
    service = ChatService(memory, provider, FakeWebSearch(fail=True))
    events = await collect(service.run_turn(TurnRequest(text="Một ngày nên đánh răng mấy lần?")))
    await provider.aclose()
    meta = done(events).metadata
    assert meta.offline and "unreachable" in (meta.offline_reason or "")
    answer = spoken(events)
    assert answer.startswith("(Chế độ ngoại tuyến") and "2 lần mỗi ngày" in answer
    assert meta.sources[0].link.startswith("https://www.nhs.uk/")
    assert meta.stored and (await memory.get(meta.conversation_id or "")).summary


async def test_llm_down_still_controls_the_real_device(
    memory: SqliteMemoryStore, simulated: tuple[SimulatedDevice, Device]
) -> None:
    sim, device = simulated
    provider = down_provider()
    service = ChatService(memory, provider, None)
    text = "Đặt âm lượng 45 và cho tôi biết nên dùng chỉ nha khoa thế nào"
    request = TurnRequest(text=text, device_id=device.device_id)
    events = await collect(service.run_turn(request, DeviceToolBox(device)))
    await provider.aclose()
    assert sim.hal.get_volume() == 45
    assert [(e.tool, e.arguments) for e in events if isinstance(e, ToolStarted)] == [
        (VOLUME, {"volume": 45})
    ]
    answer = spoken(events)
    assert answer.startswith("Đã chỉnh âm lượng thành 45.") and "chỉ nha khoa" in answer
    assert done(events).metadata.offline


async def test_offline_never_calls_a_tool_below_the_threshold(memory: SqliteMemoryStore) -> None:
    device = FirmwareDevice()
    service = ChatService(memory, None, None)
    events = await collect(
        service.run_turn(TurnRequest(text="set the volume"), DeviceToolBox(device))
    )
    assert device.calls == [] and not any(isinstance(e, ToolStarted) for e in events)
    assert "set the volume to 50" in spoken(events)


# ---- events and logs ----------------------------------------------------------------------------


async def test_events_round_trip_through_json_and_logs_stay_clean(
    fake: FakeLlm, llm: LlmProvider, memory: SqliteMemoryStore
) -> None:
    device = FirmwareDevice()
    fake.script("chat", Reply(calls=[FakeCall(VOLUME_LLM, {"volume": 12})]), Reply("Done."))
    service = ChatService(memory, llm, FakeWebSearch(WEB))
    request = TurnRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "ignored"},
                {"role": "user", "content": [{"type": "text", "text": "Set the volume to 12"}]},
            ],
            "device_id": device.device_id,
        }
    )
    with structlog.testing.capture_logs() as logs:
        events = await collect(service.run_turn(request, DeviceToolBox(device)))
    for event in events:
        assert parse_event(event.model_dump(mode="json")) == event
        assert parse_event(event.model_dump_json()) == event
    steps = [line for line in logs if line["event"] == "chat step"]
    assert [line["step"] for line in steps] == [
        "language",
        "reading",
        "guardrail",
        "memory_load",
        "search",
        "llm",
        "memory_store",
        "summary",
    ]
    meta = done(events).metadata
    for line in steps[3:]:
        assert line["conversation_id"] == meta.conversation_id
        assert line["device_id"] == device.device_id and line["duration_ms"] >= 0
    assert "sk-very-secret" not in repr(logs)
    # Prompts and answers only at debug level.
    assert any("Set the volume to 12" in repr(line) for line in logs)
    above_debug = [line for line in logs if line["log_level"] != "debug"]
    assert "Set the volume to 12" not in repr(above_debug) and "Done." not in repr(above_debug)


def test_a_turn_needs_a_query() -> None:
    with pytest.raises(ValueError):
        TurnRequest.model_validate({"messages": [{"role": "assistant", "content": "hi"}]})
    assert (
        TurnRequest(
            messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        ).query
        == "b"
    )


# ---- metrics ------------------------------------------------------------------------------------


def chat_metrics() -> dict[str, float]:
    """The chat turn counter by path and the stage histograms' counts, as the registry has them."""
    sample = metrics.REGISTRY.get_sample_value
    values = {
        path: sample("bridge_chat_turns_total", {"path": path}) or 0.0
        for path in ("llm", "offline", "refused", "confirmation", "other")
    }
    for stage in ("guardrail", "memory", "search", "llm_first_token", "tools", "store"):
        values[stage] = sample("bridge_chat_stage_seconds_count", {"stage": stage}) or 0.0
    return values


async def test_a_turn_moves_the_turn_counter_and_the_stage_histograms(
    fake: FakeLlm, openai: LlmProvider, memory: SqliteMemoryStore
) -> None:
    device = FirmwareDevice()
    fake.script("chat", Reply(calls=[FakeCall(VOLUME_LLM, {"volume": 20})]), Reply("Done."))
    service = ChatService(memory, openai, FakeWebSearch(WEB))
    before = chat_metrics()
    await collect(service.run_turn(TurnRequest(text="Set the volume to 20"), DeviceToolBox(device)))
    after = chat_metrics()
    moved = {name: after[name] - before[name] for name in after}
    assert moved == {
        "llm": 1,
        "offline": 0,
        "refused": 0,
        "confirmation": 0,
        "other": 0,
        "guardrail": 1,
        "memory": 1,
        "search": 1,
        "llm_first_token": 1,  # the first round only
        "tools": 1,  # one observation a turn, however many calls
        "store": 1,
    }

    before = chat_metrics()
    await collect(ChatService(memory, None).run_turn(TurnRequest(text="How often should I floss?")))
    await collect(ChatService(memory, None).run_turn(TurnRequest(text="Who won the World Cup?")))
    after = chat_metrics()
    moved = {name: after[name] - before[name] for name in after}
    assert (moved["offline"], moved["refused"], moved["llm"]) == (1, 1, 0)
    assert (moved["guardrail"], moved["memory"], moved["llm_first_token"]) == (2, 1, 0)
