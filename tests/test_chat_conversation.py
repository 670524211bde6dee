"""The conversation is the unit: follow-ups inherit the request before them, greetings and
thanks get a short answer, names and politeness do not hide the question, complaints are the
command they mean, a device request with no device chosen asks which one. Through the chat
service offline and with a strict fake model, the OpenAI API with the client's own history and
with `chat_id`, and a device's text turns."""

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from backend.chat import (
    CHAT_MIGRATIONS,
    ChatService,
    SqliteMemoryStore,
    Token,
    ToolStarted,
    TurnRequest,
    collect,
)
from backend.chat.conversation import focus, read_turn, social_kind
from backend.chat.evaluation import evaluate_conversations, load_conversation_set
from backend.chat.events import ChatEvent, Done
from backend.chat.knowledge import KnowledgeBase
from backend.chat.llm import make_provider
from backend.chat.offline import is_dental
from backend.chat.tools import DeviceToolBox
from backend.config import Settings
from backend.server import Bridge
from backend.storage import Database
from testkit.in_process import FirmwareDevice
from testkit.llm_server import FakeLlm, Reply
from tests.helpers import create_key, eventually, wait_state

DATA = Path(__file__).parent / "data"
MODEL = "dental-duckduckgo"
TARGET_FOLLOW_UPS = 0.90  # the figures
TARGET_REFUSED = 0.95
TARGET_COMMANDS = 0.95
_kb = KnowledgeBase.bundled()


def spoken(events: list[ChatEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, Token))


def done(events: list[ChatEvent]) -> Done:
    last = events[-1]
    assert isinstance(last, Done)
    return last


@pytest.fixture
async def memory(tmp_path: Path) -> Any:
    db = Database(tmp_path / "chat.sqlite3", CHAT_MIGRATIONS)
    await db.open()
    yield SqliteMemoryStore(db)
    await db.close()


# ---- reading one message ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "language", "focused"),
    [
        ("Hi, I'm Anna. How often should I floss?", "en", "How often should I floss?"),
        ("How often should my kid Tommy floss?", "en", "How often should my kid floss?"),
        ("My name is John Smith. What causes cavities?", "en", "What causes cavities?"),
        ("Um, could you please tell me how long to brush, thanks!", "en", "how long to brush"),
        ("Hello there! what is gingivitis?", "en", "what is gingivitis?"),
        ("Turn the LED on please", "en", "Turn the LED on"),  # an acronym is no name
        ("What is Invisalign?", "en", "What is Invisalign?"),  # a dental word is no name
        ("Xin chào, cho tôi hỏi đánh răng bao lâu ạ", "vi", "đánh răng bao lâu"),
        ("Đặt âm lượng 30 nhé", "vi", "Đặt âm lượng 30"),  # "â" is not a capital
        ("it's way too loud", "en", "turn the volume down"),
        ("I can barely hear you", "en", "turn the volume up"),
        ("the screen is too bright", "en", "turn the screen brightness down"),
        ("không nghe rõ gì cả", "vi", "tăng âm lượng lên"),
        ("hello", "en", ""),
    ],
)
def test_focus_keeps_the_request_and_drops_the_wrapping(
    message: str, language: Any, focused: str
) -> None:
    assert focus(message, language, lambda word: _kb.knows(word) or is_dental(word)) == focused


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("hello", "greeting"),
        ("Good morning!", "greeting"),
        ("Xin chào", "greeting"),
        ("thanks a lot", "thanks"),
        ("Cảm ơn bạn", "thanks"),
        ("bye", "goodbye"),
        ("what can you do?", "identity"),
        ("how often should I floss", None),
        ("hello world program in python", None),
    ],
)
def test_social_turns_are_told_apart(text: str, kind: str | None) -> None:
    assert social_kind(text) == kind


def _read(message: str, earlier: list[str]) -> Any:
    return read_turn(message, earlier, "en", on_topic=is_dental, known=lambda word: _kb.knows(word))


def test_a_follow_up_inherits_the_question_before_it() -> None:
    reading = _read("And for children?", ["How often should I floss?"])
    assert reading.follows == "How often should I floss?"
    assert "floss" in reading.text and "children" in reading.text
    assert reading.own == "And for children?"


@pytest.mark.parametrize(
    ("message", "earlier"),
    [
        ("what about the weather tomorrow?", ["How often should I floss?"]),  # unknown words
        ("And for children?", []),  # nothing to follow
        ("And for children?", ["who won the game?"]),  # the turn before was off topic
        ("and then we went to the cinema and watched a long film", ["How often floss?"]),
        ("And for children?", ["floss?", "hi", "weather?", "news?"]),  # out of the window
    ],
)
def test_what_is_no_follow_up_stays_alone(message: str, earlier: list[str]) -> None:
    reading = _read(message, earlier)
    assert reading.follows is None and reading.text.rstrip("?") == message.rstrip("?")


# ---- whole conversations, offline and with a strict model -------------------------------------


async def test_the_development_set_meets_the_targets_offline() -> None:
    report = await evaluate_conversations(
        load_conversation_set(DATA / "chat_multiturn_dev.json"), FirmwareDevice
    )
    for share, target in (
        (report.follow_ups, TARGET_FOLLOW_UPS),
        (report.refused, TARGET_REFUSED),
        (report.commands, TARGET_COMMANDS),
        (report.share("state", "social"), 1.0),
    ):
        good, total = share
        assert total >= 4 and good / total >= target, report.failures()


async def test_a_strict_model_sees_the_conversation_and_follow_ups_pass_by_the_rules(
    fake_llm: FakeLlm, memory: SqliteMemoryStore
) -> None:
    """A model that answers NO to every guardrail question (one that judges the last line
    alone): follow-ups, greetings and commands pass by the rules without asking it; what it
    is asked, it is asked with the user's earlier turns."""
    fake_llm.defaults["guardrail"] = Reply("NO")
    settings = Settings(llm_provider="openai", llm_base_url=fake_llm.url)
    service = ChatService(memory, make_provider(settings))
    device = FirmwareDevice()

    async def turn(text: str) -> list[ChatEvent]:
        request = TurnRequest(text=text, conversation_id="strict")
        return await collect(service.run_turn(request, DeviceToolBox(device)))

    first = await turn("How often should I floss?")
    assert done(first).metadata.guardrail.by == "rules"
    follow = await turn("And for children?")
    meta = done(follow).metadata
    assert meta.guardrail.verdict == "passed" and meta.guardrail.reason == "follow-up"
    sent = fake_llm.of_kind("chat")[-1].messages
    assert any("How often should I floss?" in m["content"] for m in sent if m["role"] == "user")
    greeting = await turn("thanks!")
    assert done(greeting).metadata.guardrail.reason == "social"
    command = await turn("it's too loud")
    assert done(command).metadata.guardrail.reason == "device request"
    assert fake_llm.of_kind("guardrail") == []  # none of these asked the model

    refused = await turn("what about the election results?")
    assert done(refused).metadata.guardrail.verdict == "refused"
    [asked] = fake_llm.of_kind("guardrail")
    prompt = asked.messages[0]["content"]
    # The earlier turns the stored window holds (three pairs), oldest first, before the request.
    assert "And for children?" in prompt and "it's too loud" in prompt
    assert prompt.index("And for children?") < prompt.index("it's too loud")
    assert prompt.index("it's too loud") < prompt.index("election")
    await service.aclose()


async def test_the_guardrail_model_sees_a_bounded_number_of_turns(
    fake_llm: FakeLlm, memory: SqliteMemoryStore
) -> None:
    fake_llm.defaults["guardrail"] = Reply("NO")
    service = ChatService(
        memory, make_provider(Settings(llm_provider="openai", llm_base_url=fake_llm.url))
    )
    long_turn = "tooth " * 2000
    messages: list[dict[str, Any]] = []
    for index in range(12):
        messages += [
            {"role": "user", "content": f"{long_turn} number {index}"},
            {"role": "assistant", "content": "ok"},
        ]
    messages.append({"role": "user", "content": "and the stock market?"})
    request = TurnRequest.model_validate({"messages": messages, "context": "messages"})
    events = await collect(service.run_turn(request))
    assert done(events).metadata.guardrail.verdict == "refused"
    prompt = fake_llm.of_kind("guardrail")[0].messages[0]["content"]
    assert len(prompt) < 2500 and "number 11" not in prompt  # each turn cut, four at most
    await service.aclose()


async def test_a_mixed_request_is_served_in_order(memory: SqliteMemoryStore) -> None:
    service = ChatService(memory, None)
    device = FirmwareDevice()
    request = TurnRequest(text="Set the volume to 25 and tell me how often to floss")
    events = await collect(service.run_turn(request, DeviceToolBox(device)))
    calls = [(e.tool, e.arguments) for e in events if isinstance(e, ToolStarted)]
    assert calls == [("self.audio_speaker.set_volume", {"volume": 25})]
    text = spoken(events)
    assert text.index("Volume set to 25") < text.index("floss")
    assert "found nothing relevant" not in text
    assert done(events).metadata.sources  # the flossing question cited its source


# ---- the front ends -----------------------------------------------------------------------------


async def test_openai_client_history_and_chat_id_carry_follow_ups(bridge: Bridge) -> None:
    key = await create_key(bridge, "chat:use")
    async with openai.AsyncOpenAI(
        base_url=f"{bridge.api_url}/v1", api_key=key, max_retries=0, timeout=30
    ) as client:
        first = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "How often should I floss?"}]
        )
        answer = first.choices[0].message.content or ""
        history: list[Any] = [
            {"role": "user", "content": "How often should I floss?"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And for children?"},
        ]
        follow = await client.chat.completions.create(model=MODEL, messages=history)
        text = follow.choices[0].message.content or ""
        assert "Sorry" not in text and "child" in text.lower()

        for question in ("How often should I floss?", "what about kids?"):
            reply = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": question}],
                extra_body={"chat_id": "floss_talk"},
            )
        text = reply.choices[0].message.content or ""
        assert "Sorry" not in text and "child" in text.lower()


async def test_a_device_request_without_a_device_asks_which_one(
    bridge: Bridge, simulated_devices: Any
) -> None:
    first = await simulated_devices(bridge, index=1)
    second = await simulated_devices(bridge, index=2)
    key = await create_key(bridge, "chat:use", "devices:call", devices=[second.device_id])
    async with openai.AsyncOpenAI(
        base_url=f"{bridge.api_url}/v1", api_key=key, max_retries=0, timeout=30
    ) as client:
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "set the volume to 10"}]
        )
    text = reply.choices[0].message.content or ""
    assert text.startswith("Which device do you mean?")
    assert second.device_id in text and first.device_id not in text  # only what the key may use
    assert first.hal.get_volume() != 10 and second.hal.get_volume() != 10


async def stored_turns(bridge: Bridge, device_id: str, turns: int) -> None:
    """Wait until the device's conversation holds `turns` stored question/answer pairs."""
    memory = bridge.frontends.memory
    for _ in range(1500):
        conversation = await memory.open(device_id=device_id)
        if conversation.message_count >= 2 * turns:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{device_id}: fewer than {turns} turns stored in 15 s")


async def test_a_device_text_turn_follows_up_on_the_one_before(
    bridge: Bridge, simulated_devices: Any
) -> None:
    sim = await simulated_devices(bridge)
    await wait_state(bridge, sim.device_id)
    assert await sim.app.send_text("Set the volume to 30")
    await eventually(lambda: sim.hal.get_volume() == 30)
    # A new text cancels a turn still running; the follow-up waits for the first to be stored.
    await stored_turns(bridge, sim.device_id, 1)
    assert await sim.app.send_text("a bit more")
    await eventually(lambda: sim.hal.get_volume() == 40, timeout_s=15)
    await stored_turns(bridge, sim.device_id, 2)
    assert await sim.app.send_text("hello")
    await eventually(
        lambda: any(
            role == "assistant" and text.startswith("Hello!") for role, text in sim.hal.shown
        ),
        timeout_s=15,
    )


class _TimeServer:
    """A toolbox with one external server's tool (as `CombinedToolBox` gives a key bound to
    an MCP server), no device."""

    unavailable_reason = None

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def functions(self) -> list[Any]:
        return []

    def external_functions(self) -> list[Any]:
        from backend.chat.llm import FunctionSpec

        schema = {"type": "object", "properties": {"timezone": {"type": "string"}}}
        return [
            FunctionSpec("time__get_current_time", "Get the current time in a timezone.", schema)
        ]

    def device_tool_name(self, llm_name: str) -> str:
        return llm_name

    async def call(
        self, llm_name: str, arguments: dict[str, Any], *, confirmed: bool = False
    ) -> Any:
        from backend.chat.tools import ToolOutcome

        self.calls.append((llm_name, arguments))
        return ToolOutcome('{"datetime": "2026-11-29T09:00:00+09:00"}')


async def test_a_request_an_external_tool_serves_is_not_refused(
    fake_llm: FakeLlm, memory: SqliteMemoryStore
) -> None:
    from testkit.llm_server import FakeCall

    fake_llm.defaults["guardrail"] = Reply("NO")
    fake_llm.script(
        "chat",
        Reply(calls=[FakeCall("time__get_current_time", {"timezone": "Asia/Tokyo"})]),
        Reply("It is 9 in the morning in Tokyo."),
    )
    service = ChatService(
        memory, make_provider(Settings(llm_provider="openai", llm_base_url=fake_llm.url))
    )
    box = _TimeServer()
    events = await collect(service.run_turn(TurnRequest(text="What time is it in Tokyo?"), box))
    meta = done(events).metadata
    assert meta.guardrail.verdict == "passed" and meta.guardrail.reason == "external tool"
    assert box.calls == [("time__get_current_time", {"timezone": "Asia/Tokyo"})]
    assert "9 in the morning" in spoken(events)
    # Words the tool does not share are still judged (and here refused) by the model.
    other = await collect(service.run_turn(TurnRequest(text="Who won the match?"), box))
    assert done(other).metadata.guardrail.verdict == "refused" and len(box.calls) == 1
    await service.aclose()


async def test_killed_stored_turns_leave_no_empty_conversations(
    fake_llm: FakeLlm, memory: SqliteMemoryStore
) -> None:
    """A client that goes away mid-answer (the turn's generator closed after its first token)
    leaves no conversation row behind, with a model and offline alike."""
    service = ChatService(
        memory, make_provider(Settings(llm_provider="openai", llm_base_url=fake_llm.url))
    )
    offline = ChatService(memory, None)
    for index, chat in enumerate((service, offline, service, offline)):
        request = TurnRequest(text="How long should I brush my teeth?", conversation_id=f"k{index}")
        events = chat.run_turn(request, DeviceToolBox(FirmwareDevice()))
        async for event in events:
            if isinstance(event, Token):
                break
        await events.aclose()  # type: ignore[attr-defined]
    assert (await memory.list_conversations()).total == 0
    whole = await collect(
        offline.run_turn(TurnRequest(text="How often floss?", conversation_id="k9"))
    )
    assert done(whole).metadata.stored and (await memory.list_conversations()).total == 1
    await service.aclose()


def test_a_turn_offers_the_model_a_bounded_and_relevant_set_of_functions() -> None:
    from backend.chat.llm import FunctionSpec
    from backend.chat.tool_budget import declared_bytes, within_budget

    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(900)}}
    small = {"type": "object", "properties": {"volume": {"type": "integer"}}}
    flood = [FunctionSpec(f"x__tool_{i}", f"Does thing {i}.", big) for i in range(500)]
    volume = FunctionSpec("self_audio_speaker_set_volume", "Set the speaker volume.", small)
    functions = [*flood[:250], volume, *flood[250:]]
    offered = within_budget(functions, "set the volume to 30", max_tools=32, max_bytes=65536)
    assert volume in offered  # the relevant one, though it came 251st
    assert len(offered) <= 32 and sum(map(declared_bytes, offered)) <= 65536
    assert within_budget([volume], "anything") == [volume]  # what fits is offered whole


@pytest.mark.parametrize(
    ("message", "social"),
    [
        ("Thanks, that's really helpful!", "thanks"),
        ("Hi, I'm Priya and I'm five months pregnant.", "greeting"),
        ("Hello! Write me a poem about the sea", None),  # a greeting does not pass a request
        ("Hi, what's the weather tomorrow?", None),
    ],
)
def test_a_social_opening_makes_a_message_social_only_when_it_asks_nothing(
    message: str, social: str | None
) -> None:
    assert _read(message, []).social == social
