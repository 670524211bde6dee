"""The chat behind a model that misbehaves as real ones did (a 135M-parameter model behind
llama.cpp's server): empty streams, streams without their end, endless talk, servers that refuse
`content: null`, pooled connections dropped after a streamed reply, a model that fails after a
tool ran. The loopback fake model misbehaves the same way, on the real wire format."""

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.chat import (
    CHAT_MIGRATIONS,
    ChatEvent,
    ChatService,
    DeviceToolBox,
    Done,
    SqliteMemoryStore,
    Token,
    ToolCompleted,
    TurnRequest,
    collect,
)
from backend.chat.llm import LlmProvider, OllamaProvider, OpenAiProvider, Usage
from backend.chat.tokens import count_tokens
from backend.server import Bridge
from backend.storage import Database
from testkit.in_process import FirmwareDevice
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN
from tests.helpers import eventually

MODELS = Usage(chat="chat-model", guardrail="guard-model")
VOLUME_LLM = "self_audio_speaker_set_volume"
QUESTION = "How often should I brush my teeth?"


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


@pytest.fixture(params=["openai", "ollama"])
async def llm(request: pytest.FixtureRequest, fake: FakeLlm) -> AsyncIterator[LlmProvider]:
    cls = OpenAiProvider if request.param == "openai" else OllamaProvider
    provider = cls(fake.url, MODELS, timeout_s=5)
    yield provider
    await provider.aclose()


def service(db: Database, llm: LlmProvider, **options: Any) -> ChatService:
    return ChatService(SqliteMemoryStore(db), llm, **options)


def done(events: list[ChatEvent]) -> Done:
    last = events[-1]
    assert isinstance(last, Done), events
    return last


def spoken(events: list[ChatEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, Token))


async def stored_messages(db: Database) -> int:
    row = await db.fetchone("SELECT COUNT(*) FROM chat_messages")
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("fault", ["empty", "no_done"])
async def test_a_broken_stream_is_a_failure_with_the_offline_answer(
    fake: FakeLlm, llm: LlmProvider, db: Database, fault: str
) -> None:
    fake.script("chat", Reply("Brush twice", fault=fault))
    events = await collect(service(db, llm).run_turn(TurnRequest(text=QUESTION)))
    meta = done(events).metadata
    reason = meta.offline_reason or ""
    assert meta.offline and ("cut" in reason or "nothing" in reason), reason
    # The offline mode answered from the knowledge base: there is an answer, and it is stored.
    assert "(Offline mode" in spoken(events) or "offline" in spoken(events).lower()
    assert meta.stored and await stored_messages(db) == 2
    assert not fake.of_kind("summary")  # offline: the model is not asked to summarise


async def test_an_endless_model_is_cut_at_the_answer_cap(
    fake: FakeLlm, llm: LlmProvider, db: Database
) -> None:
    fake.script("chat", Reply("Well", fault="endless"))
    chat = service(db, llm, max_answer_tokens=40)
    events = await collect(chat.run_turn(TurnRequest(text=QUESTION)))
    meta = done(events).metadata
    assert meta.finish_reason == "length" and not meta.offline
    assert "and and" in spoken(events)
    # Within the cap, with the margin the bridge leaves for another tokenizer's counting
    assert count_tokens(spoken(events)) <= 40 + 40 // 2 + 8
    # The bridge hung up on the model: it stops sending.
    await asyncio.sleep(0.2)
    sent = fake.endless_words
    await asyncio.sleep(0.3)
    assert fake.endless_words == sent


async def test_a_turn_deadline_cuts_a_model_that_keeps_talking(
    fake: FakeLlm, llm: LlmProvider, db: Database
) -> None:
    fake.script("chat", Reply("Well", fault="endless"))
    chat = service(db, llm, turn_timeout_s=0.5, max_answer_tokens=100_000)
    events = await collect(chat.run_turn(TurnRequest(text=QUESTION)))
    meta = done(events).metadata
    assert meta.finish_reason == "length" and "and and" in spoken(events)
    assert meta.stored  # what was said before the deadline is the answer


async def test_tool_calls_go_back_with_empty_content_not_null(fake: FakeLlm, db: Database) -> None:
    fake.reject_null_content = True  # some OpenAI-compatible servers answer null with HTTP 500
    fake.script(
        "chat", Reply(calls=[FakeCall(VOLUME_LLM, {"volume": 30})]), Reply("Volume is 30 now.")
    )
    provider = OpenAiProvider(fake.url, MODELS, timeout_s=5)
    device = FirmwareDevice()
    request = TurnRequest(text="Set the volume to 30")
    events = await collect(service(db, provider).run_turn(request, DeviceToolBox(device)))
    await provider.aclose()
    assert spoken(events) == "Volume is 30 now." and not done(events).metadata.offline
    second = fake.of_kind("chat")[1].messages
    assert second[-2]["role"] == "assistant" and second[-2]["content"] == ""


async def test_tool_results_reach_the_user_when_the_model_then_fails(
    fake: FakeLlm, llm: LlmProvider, db: Database
) -> None:
    fake.script("chat", Reply(calls=[FakeCall(VOLUME_LLM, {"volume": 30})]), Reply(status=503))
    device = FirmwareDevice()
    request = TurnRequest(text="Set the volume to 30")
    events = await collect(service(db, llm).run_turn(request, DeviceToolBox(device)))
    assert device.hal.get_volume() == 30
    assert [e.tool for e in events if isinstance(e, ToolCompleted)] == [
        "self.audio_speaker.set_volume"
    ]
    meta = done(events).metadata
    assert meta.offline
    # Said once, in words, though the model never got to say it.
    assert spoken(events).count("self.audio_speaker.set_volume") == 1
    assert "Done" in spoken(events)


async def test_a_dropped_pooled_connection_is_retried_once_on_a_fresh_one(
    fake: FakeLlm, llm: LlmProvider, db: Database
) -> None:
    fake.drop_after_stream = True  # the summary call follows the streamed answer on the pool
    events = await collect(service(db, llm).run_turn(TurnRequest(text=QUESTION)))
    assert fake.dropped >= 1
    meta = done(events).metadata
    assert not meta.offline and meta.stored
    conversation = await SqliteMemoryStore(db).get(meta.conversation_id or "")
    assert conversation.summary == "Summary 1."  # the model's, not the extractive fallback


async def test_device_tools_are_offered_only_when_the_turn_is_about_the_device(
    fake: FakeLlm, llm: LlmProvider, db: Database
) -> None:
    device = FirmwareDevice()
    chat = service(db, llm)
    await collect(chat.run_turn(TurnRequest(text=QUESTION), DeviceToolBox(device)))
    assert fake.of_kind("chat")[-1].tools == []  # a toothache question raised the brightness
    fake.script("chat", Reply("Done."))
    text = "Set the volume to 30 and tell me how often to brush"
    await collect(chat.run_turn(TurnRequest(text=text), DeviceToolBox(device)))
    assert VOLUME_LLM in str(fake.of_kind("chat")[-1].tools)


async def test_guardrail_and_summary_calls_are_deterministic(
    fake: FakeLlm, llm: LlmProvider, db: Database
) -> None:
    await collect(service(db, llm).run_turn(TurnRequest(text="Is sugar bad?")))
    for kind in ("guardrail", "summary"):
        body = fake.of_kind(kind)[0].body
        options = body.get("options", body)  # Ollama's options, or OpenAI's top level
        assert options["temperature"] == 0 and options["seed"] == 0, kind


async def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(
    bridge_factory: Any, fake: FakeLlm
) -> None:
    bridge: Bridge = await bridge_factory(
        llm_provider="openai", llm_base_url=fake.url, chat_max_answer_tokens=100_000
    )
    fake.script("chat", Reply("Well", fault="endless"))
    body = {"model": "dental-duckduckgo", "messages": [{"role": "user", "content": QUESTION}]}
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as http:
        request = asyncio.create_task(http.post("/v1/chat/completions", json=body, timeout=60))
        # The client leaves once the model talks (a fixed client timeout could fire first
        # under load, and the model was then never reached).
        await eventually(lambda: fake.endless_words > 0, timeout_s=30)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
    # The bridge notices, cancels the turn and hangs up on the model: its words stop.
    async with asyncio.timeout(10):
        while True:
            before = fake.endless_words
            await asyncio.sleep(0.3)  # the model sends a word every 2 ms while it is read
            if fake.endless_words == before:
                break
    await asyncio.sleep(0.3)
    assert fake.endless_words == before
