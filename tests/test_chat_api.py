"""The chat pipeline over HTTP: the OpenAI-compatible API driven by the official `openai` client,
the chat integration design's SSE stream, conversations, device tools under scopes. A real
bridge whose chat model is the loopback fake LLM, real simulated devices."""

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from backend.server import Bridge
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from testkit.stock_device import WireDevice
from tests.helpers import create_key, eventually, sse_events, wait_state

MODEL = "dental-duckduckgo"
VOLUME_LLM = "self_audio_speaker_set_volume"
QUESTION = "How long should I brush my teeth?"
ANSWER = "Brush twice a day for two minutes."


@pytest.fixture
async def llm_bridge(bridge_factory, fake_llm: FakeLlm) -> Bridge:
    bridge: Bridge = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    return bridge


@pytest.fixture
async def client(llm_bridge: Bridge) -> AsyncIterator[openai.AsyncOpenAI]:
    key = await create_key(llm_bridge, "chat:use")
    async with openai.AsyncOpenAI(
        base_url=f"{llm_bridge.api_url}/v1", api_key=key, max_retries=0, timeout=30
    ) as client:
        yield client


@pytest.fixture
async def http(llm_bridge: Bridge) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=llm_bridge.api_url, headers=headers, timeout=30) as c:
        yield c


async def stream(http: httpx.AsyncClient, body: dict[str, Any], **kwargs: Any) -> list[Any]:
    async with http.stream("POST", "/api/chat/stream", json=body, **kwargs) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-conversation-id"]
        return await sse_events(response)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    """Event kinds with consecutive tokens folded into one."""
    out: list[str] = []
    for event in events:
        kind = event["type"] + (f":{event['status']}" if event["type"] == "mcp_tool" else "")
        if not (out and kind == out[-1] == "token"):
            out.append(kind)
    return out


# ---- OpenAI-compatible ------------------------------------------------------------------------


async def test_completion_with_the_official_client(client, http, fake_llm):
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], store=True
    )
    completion = raw.parse()
    conversation_id = completion.system_fingerprint
    assert conversation_id and raw.headers["x-conversation-id"] == conversation_id
    extra = completion.model_extra or {}
    assert set(extra) == {"conversation_id", "sources"}  # the bridge's extensions
    assert extra["conversation_id"] == conversation_id
    assert completion.model == MODEL and completion.object == "chat.completion"
    [choice] = completion.choices
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    content = choice.message.content or ""
    assert content.startswith(ANSWER + "\n\nSources:\n1. ")  # the knowledge base's links
    assert extra["sources"] and all(source["link"] in content for source in extra["sources"])
    assert QUESTION in fake_llm.of_kind("chat")[0].messages[-1]["content"]

    stored = (await http.get(f"/v1/conversations/{conversation_id}")).json()
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    assert stored["messages"][1]["content"] == content and stored["summary"] == "Summary 1."


async def test_chat_id_continues_a_conversation(client, http, fake_llm):
    first = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"chat_id": "chat_123456"},
    )
    assert first.system_fingerprint == "chat_123456"
    fake_llm.script("chat", Reply("Floss once a day."))
    second = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "And how often should I floss?"}],
        extra_body={"chat_id": "chat_123456"},
    )
    assert second.system_fingerprint == "chat_123456"
    sent = fake_llm.of_kind("chat")[-1].messages
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[1]["content"] == QUESTION and "Sources:" not in sent[2]["content"]
    stored = (await http.get("/v1/conversations/chat_123456")).json()
    assert stored["message_count"] == 4 and stored["summary"] == "Summary 1.\n\nSummary 2."


async def test_streamed_completion_with_the_official_client(client, llm_bridge):
    chunks = [
        chunk
        async for chunk in await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], stream=True
        )
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text.startswith(ANSWER + "\n\nSources:\n1. ")
    assert len(chunks) > 4  # the answer arrives piece by piece
    # No chat_id, no store: the client keeps its own history and nothing is stored.
    assert {c.system_fingerprint for c in chunks} == {"fp_esp32_bridge"}
    assert (await llm_bridge.frontends.memory.list_conversations(limit=5)).total == 0


async def test_stream_ends_with_done_marker(llm_bridge, http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = await sse_events(response)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert "x-conversation-id" not in response.headers  # nothing stored without chat_id/store


async def test_models_and_unknown_model(client):
    assert [model.id async for model in client.models.list()] == [MODEL]
    assert (await client.models.retrieve(MODEL)).owned_by == "esp32-mcp-bridge"
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": QUESTION}]
        )
    assert "dental-duckduckgo" in str(caught.value)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "system", "content": "hi"}]}, "user message"),
        ({"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "stream": "x"}, ""),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4001}]},
            "at most 4,000 characters",
        ),
    ],
)
async def test_malformed_completion_requests_are_400(http, fake_llm, body, fragment):
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text  # OpenAI's status: BadRequestError
    too_long = "4,000" in fragment
    code = "context_length_exceeded" if too_long else "invalid_request"
    assert response.json()["error"]["code"] == code
    assert fragment in response.json()["error"]["message"]
    assert not fake_llm.requests


# ---- SSE (the chat integration design) and device tools --------------------------------------


async def test_sse_events_in_order_with_a_device_tool(
    llm_bridge, http, fake_llm, simulated_devices
):
    sim = await simulated_devices(llm_bridge)
    fake_llm.script(
        "chat",
        Reply(calls=[FakeCall(VOLUME_LLM, {"volume": 30})]),
        Reply("The volume is now 30."),
    )
    events = await stream(http, {"message": "Set the volume to 30", "device_id": sim.device_id})
    assert kinds(events) == ["mcp_tool:started", "mcp_tool:completed", "token", "done"]
    started, completed = events[0], events[1]
    assert started["tool"] == completed["tool"] == "self.audio_speaker.set_volume"
    assert started["arguments"] == {"volume": 30}
    assert completed["result"] == [{"type": "text", "text": "true"}] and not completed["is_error"]
    assert "".join(e["token"] for e in events if e["type"] == "token") == "The volume is now 30."
    done = events[-1]
    assert done["metadata"]["device_id"] == sim.device_id and done["metadata"]["tool_rounds"] == 1
    assert sim.hal.get_volume() == 30


async def test_sse_dental_question_has_sources_before_done(llm_bridge, http):
    events = await stream(http, {"message": QUESTION, "conversationId": "c-seed"})
    assert kinds(events) == ["token", "sources", "done"]
    assert events[-2]["section"].startswith("Sources:\n1. ")
    assert events[-1]["conversation_id"] == "c-seed" and events[-1]["metadata"]["stored"]


async def test_without_devices_call_the_turn_goes_on_and_says_why(
    llm_bridge, fake_llm, simulated_devices
):
    sim = await simulated_devices(llm_bridge)
    before = sim.hal.get_volume()
    key = await create_key(llm_bridge, "chat:use")
    fake_llm.script("chat", Reply("I cannot change the volume for you."))
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=llm_bridge.api_url, headers=headers, timeout=30) as c:
        events = await stream(c, {"message": "Set the volume to 30", "device_id": sim.device_id})
    assert kinds(events) == ["mcp_tool:error", "token", "done"]
    assert events[0]["tool"] == "self.audio_speaker.set_volume"
    assert events[0]["error"] == "missing scope devices:call"
    assert fake_llm.of_kind("chat")[0].tools == []  # the model was offered no tools
    assert sim.hal.get_volume() == before


async def test_a_device_limited_key_cannot_use_another_devices_tools(llm_bridge, simulated_devices):
    sim = await simulated_devices(llm_bridge)
    key = await create_key(llm_bridge, "chat:use", "devices:call", devices=["02:00:00:00:00:99"])
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=llm_bridge.api_url, headers=headers, timeout=30) as c:
        events = await stream(c, {"message": "Set the volume to 30", "device_id": sim.device_id})
    assert events[0]["status"] == "error"
    assert events[0]["error"] == f"scope devices:call does not cover device {sim.device_id}"


@pytest.mark.parametrize("model", ["answers", "fails"])
async def test_a_key_not_covering_the_device_gets_one_error_event(
    llm_bridge, fake_llm, simulated_devices, model
):
    """The refusal is said once, whether the model answers or offline mode takes over after
    it failed (both stages used to report it: two `mcp_tool` errors for one request)."""
    sim = await simulated_devices(llm_bridge)
    before = sim.hal.get_volume()
    key = await create_key(llm_bridge, "chat:use", "devices:call", devices=["02:00:00:00:00:99"])
    if model == "fails":
        fake_llm.script("chat", Reply(status=503))
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=llm_bridge.api_url, headers=headers, timeout=30) as c:
        events = await stream(c, {"message": "Set the volume to 30", "device_id": sim.device_id})
    tool_events = [event for event in events if event["type"] == "mcp_tool"]
    reason = f"scope devices:call does not cover device {sim.device_id}"
    assert [(e["status"], e["tool"], e["error"]) for e in tool_events] == [
        ("error", "self.audio_speaker.set_volume", reason)
    ]
    assert kinds(events) == ["mcp_tool:error", "token", "done"]
    metadata = events[-1]["metadata"]
    assert metadata["offline"] is (model == "fails")
    if model == "fails":  # offline mode says why in words, once
        assert metadata["answer"].count(reason) == 1
    assert sim.hal.get_volume() == before


async def test_unknown_and_offline_devices(llm_bridge, http, fake_llm):
    unknown = await http.post(
        "/api/chat/stream", json={"message": QUESTION, "device_id": "ff:ff:ff:ff:ff:ff"}
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_device"

    device = WireDevice(llm_bridge.ws_url, DEVICE_TOKEN)
    await device.connect()
    await wait_state(llm_bridge, device.device_id)
    await device.close()
    await eventually(lambda: llm_bridge.registry.get(device.device_id) is None)
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}]}
    offline = await http.post("/v1/chat/completions", json={**body, "device_id": device.device_id})
    assert offline.status_code == 503 and offline.json()["error"]["code"] == "device_offline"
    assert not fake_llm.requests


# ---- conversations ----------------------------------------------------------------------------


async def test_conversations_list_get_delete(llm_bridge, http):
    for name in ("c1", "c2", "c3"):
        await stream(http, {"message": QUESTION, "conversation_id": name})
    page = (await http.get("/v1/conversations", params={"limit": 2})).json()
    assert [c["id"] for c in page["data"]] == ["c3", "c2"]
    assert (page["total"], page["next_offset"]) == (3, 2)
    rest = (await http.get("/v1/conversations", params={"limit": 2, "offset": 2})).json()
    assert [c["id"] for c in rest["data"]] == ["c1"] and rest["next_offset"] is None

    one = (await http.get("/v1/conversations/c2")).json()
    assert one["title"] == QUESTION and len(one["messages"]) == 2 and one["summary"]

    assert (await http.delete("/v1/conversations/c2")).status_code == 204
    gone = await http.get("/v1/conversations/c2")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_conversation"
    assert (await http.delete("/v1/conversations/c2")).status_code == 404
    assert (await http.get("/v1/conversations")).json()["total"] == 2


async def test_a_refused_device_turn_leaves_no_conversation_and_the_next_one_stays(
    llm_bridge, http, fake_llm, simulated_devices
):
    sim = await simulated_devices(llm_bridge)
    fake_llm.script("guardrail", Reply("NO"))
    refused = await stream(http, {"message": "Who won the match?", "device_id": sim.device_id})
    assert refused[-1]["metadata"]["guardrail"]["verdict"] == "refused"
    assert (await http.get("/v1/conversations")).json()["total"] == 0  # nothing written

    first = await stream(http, {"message": QUESTION, "device_id": sim.device_id})
    second = await stream(http, {"message": QUESTION, "device_id": sim.device_id})
    assert first[-1]["conversation_id"] == second[-1]["conversation_id"]  # the device's own
    [row] = (await http.get("/v1/conversations")).json()["data"]
    assert row["id"] == first[-1]["conversation_id"] and row["device_id"] == sim.device_id
