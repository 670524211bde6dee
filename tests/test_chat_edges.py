"""Chat at its edges (issue 16, item 8): a lone surrogate is a clear 400 over HTTP and repaired
(U+FFFD) in a device's text turn, never a 500; the conversation summary stays within its bound
however many turns there are, and so does what is sent to the model; confirmation rules match
tool names case- and zero-width-insensitively. A real bridge on loopback, the fake LLM, a
stock device over a real WebSocket."""

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from backend.chat.history import SUMMARY_MAX_CHARS, SUMMARY_MAX_TOKENS
from backend.chat.text import bounded_summary, estimated_tokens
from backend.devices.confirm import ConfirmationPolicy, normalized_name
from backend.mcp_session import Tool
from backend.server import Bridge
from testkit.llm_server import FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from testkit.stock_device import STATUS_TOOL, WireDevice
from tests.helpers import wait_state

QUESTION = "How long should I brush my teeth?"
MAC = "a4:cf:12:34:56:78"
# JSON text as a client writes it: the escape is valid JSON, the character is not Unicode.
SURROGATE = "\\ud800"


@pytest.fixture
async def llm_bridge(bridge_factory: Any, fake_llm: FakeLlm) -> Bridge:
    bridge: Bridge = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    return bridge


@pytest.fixture
async def http(llm_bridge: Bridge) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=llm_bridge.api_url, headers=headers, timeout=30) as c:
        yield c


# ---- lone surrogates --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/v1/chat/completions",
            '{"model":"dental-duckduckgo","messages":[{"role":"user","content":"teeth %s?"}]}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            '{"messages":[{"role":"user","content":"ok"}],"stream":true,"chat_id":"c%s"}',
            "chat_id",
        ),
        (
            "/v1/chat/completions",
            '{"messages":[{"role":"user","content":[{"type":"text","text":"a%s"}]}]}',
            "messages[0].content[0].text",
        ),
        ("/api/chat/stream", '{"message":"brush %s teeth"}', "message"),
        ("/api/chat/stream", '{"message":"brush","conversationId":"x%s"}', "conversationId"),
    ],
)
async def test_a_lone_surrogate_over_http_is_a_clear_400(
    http: httpx.AsyncClient, fake_llm: FakeLlm, path: str, body: str, field: str
) -> None:
    response = await http.post(path, content=(body % SURROGATE).encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_text"
    assert error["message"].startswith(f"{field}: ") and "surrogate" in error["message"]
    assert fake_llm.requests == []  # refused before the turn began
    # The bridge is fine: the same request with valid text (an escaped pair is valid) works.
    fixed = "1" if field.lower().endswith("id") else "\\ud83d\\ude00"
    valid = await http.post(path, content=(body % fixed).encode())
    assert valid.status_code == 200, valid.text


async def test_a_device_text_turn_with_a_lone_surrogate_is_answered(
    bridge: Bridge, wire_devices: Any
) -> None:
    device: WireDevice = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    raw = json.dumps(
        {"session_id": device.session_id, "type": "listen", "state": "detect", "text": "X"}
    ).replace('"X"', f'"How long should I brush {SURROGATE} my teeth?"')
    await device.send(raw)

    def stops() -> int:
        return sum(1 for m in device.messages if m.get("type") == "tts" and m["state"] == "stop")

    await device.wait_for_count(stops, 1)
    stt = device.messages[0]
    assert stt["type"] == "stt" and stt["text"] == "How long should I brush \ufffd my teeth?"
    spoken = [m["text"] for m in device.messages if m.get("state") == "sentence_start"]
    assert not any("went wrong" in line for line in spoken), spoken
    memory = bridge.frontends.memory
    conversation = await memory.conversation_for_device(device.device_id)
    stored = await memory.get(conversation.id, with_messages=True)
    assert stored.messages[0].content == "How long should I brush \ufffd my teeth?"


# ---- the summary's bound ----------------------------------------------------------------------


def long_summary(number: int) -> str:
    # ~720 characters in 107 words: longer than the 600-character bound, within the 120 tokens
    # a summary may take (the fake model honours max_tokens, a word a token)
    return f"Summary {number}: " + "the patient asked about brushing and flossing. " * 15


async def test_the_summary_and_the_prompt_stay_bounded_over_many_turns(
    http: httpx.AsyncClient, fake_llm: FakeLlm
) -> None:
    turns = 30  # each summary piece is ~1.2 KB: unbounded, 36 KB by the end
    fake_llm.script("summary", *(Reply(long_summary(n)) for n in range(1, turns + 1)))
    prompt_sizes: list[int] = []
    for _ in range(turns):
        response = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": QUESTION}], "chat_id": "many-turns"},
        )
        assert response.status_code == 200, response.text
        last_chat = fake_llm.of_kind("chat")[-1]
        prompt_sizes.append(sum(len(m.get("content") or "") for m in last_chat.messages))
    stored = (await http.get("/v1/conversations/many-turns")).json()["summary"]
    assert len(stored) <= SUMMARY_MAX_CHARS and estimated_tokens(stored) <= SUMMARY_MAX_TOKENS
    assert f"Summary {turns}:" in stored  # the newest piece is kept
    assert "Summary 1:" not in stored  # the oldest pieces went first
    # What the model gets: the bounded summary plus the fixed parts (system prompt, the last 6
    # messages, the question), so it stops growing once the summary reaches its bound.
    last_user = fake_llm.of_kind("chat")[-1].messages[-1]["content"]
    assert "Summary 1:" not in last_user and len(last_user) < SUMMARY_MAX_CHARS + 1000
    assert max(prompt_sizes) == max(prompt_sizes[turns // 2 :])  # no growth in the second half
    assert prompt_sizes[-1] - min(prompt_sizes[turns // 2 :]) < 1500


async def test_a_huge_stored_summary_is_cut_before_it_reaches_the_model(
    llm_bridge: Bridge, http: httpx.AsyncClient, fake_llm: FakeLlm
) -> None:
    """A summary stored before the bound existed (160 KB) is cut when read, and again when
    written back."""
    memory = llm_bridge.frontends.memory
    body = {"messages": [{"role": "user", "content": QUESTION}], "chat_id": "old-one"}
    assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    await memory.set_summary("old-one", "\n\n".join(long_summary(n) for n in range(135)))
    assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    last_user = fake_llm.of_kind("chat")[-1].messages[-1]["content"]
    assert len(last_user) < SUMMARY_MAX_CHARS + 1000 and "Summary 134:" in last_user
    stored = (await http.get("/v1/conversations/old-one")).json()["summary"]
    assert len(stored) <= SUMMARY_MAX_CHARS


async def test_the_summary_bound_is_a_setting(bridge_factory: Any, fake_llm: FakeLlm) -> None:
    bridge: Bridge = await bridge_factory(
        llm_provider="openai", llm_base_url=fake_llm.url, chat_summary_max_chars=600
    )
    fake_llm.script("summary", *(Reply(long_summary(n)) for n in range(4)))
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {"messages": [{"role": "user", "content": QUESTION}], "chat_id": "small"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30) as http:
        for _ in range(4):
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        stored = (await http.get("/v1/conversations/small")).json()["summary"]
    # Each piece is longer than 600 characters: the newest one's end is kept.
    assert 0 < len(stored) <= 600 and stored.startswith("…")
    assert long_summary(3).strip().endswith(stored[1:])


@pytest.mark.parametrize(
    "summary",
    [
        "\n\n".join(f"piece {n} " + "x" * 300 for n in range(100)),
        "y" * 50_000,  # one piece longer than the bound
        "屋" * 50_000,  # 3 bytes a character: the token bound is the tighter one
        "😀" * 50_000,  # 4 bytes a character
    ],
)
def test_bounded_summary_keeps_within_both_bounds(summary: str) -> None:
    for chars, tokens in ((4000, 1000), (500, 10_000), (10_000, 50), (2, 2)):
        cut = bounded_summary(summary, chars, tokens)
        assert len(cut) <= chars and estimated_tokens(cut) <= tokens
        assert cut or chars == 2  # room for an ellipsis and at most one character
        assert summary.endswith(cut.lstrip("…"))  # the newest part


# ---- confirmation rules on normalized names ---------------------------------------------------

VARIANTS = [
    "self.reboot",
    "self.REBOOT",
    "Self.Reboot",
    "self.reboot\u200b",
    "self.re\u200dboot",
    "\ufeffself.reboot",
    "self.re\u00adboot",  # soft hyphen
    "ｓｅｌｆ．ｒｅｂｏｏｔ",  # full-width
    "self.reboot\u2060",  # word joiner
    "self.reboot ",
]


def tool(name: str) -> Tool:
    return Tool.model_validate({"name": name, "inputSchema": {"type": "object"}})


@pytest.mark.parametrize("name", VARIANTS)
def test_confirmation_rules_match_normalized_names(name: str) -> None:
    assert normalized_name(name) == "self.reboot"
    assert ConfirmationPolicy(["self.reboot"]).reason(MAC, tool(name)) is not None
    assert ConfirmationPolicy(["*.REBOOT"]).reason(MAC, tool(name)) is not None
    assert ConfirmationPolicy([f"{MAC.upper()}/self.reboot"]).reason(MAC, tool(name)) is not None
    # An exemption for the device applies to every spelling too, and other tools stay free.
    exempt = ConfirmationPolicy(["self.reboot", f"!{MAC}/SELF.REBOOT"])
    assert exempt.reason(MAC, tool(name)) is None
    assert exempt.reason("other", tool(name)) is not None
    assert ConfirmationPolicy(["self.reboot"]).reason(MAC, tool("self.rebooted")) is None


@pytest.mark.parametrize("name", ["self.REBOOT", "self.reboot\u200b"])
async def test_a_device_spelling_its_reboot_oddly_still_needs_confirmation(
    bridge: Bridge, name: str
) -> None:
    schema = {"type": "object", "properties": {}}
    tools = [STATUS_TOOL, {"name": name, "description": "Reboot.", "inputSchema": schema}]
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN, MAC, tools=tools)
    await device.connect()
    try:
        await wait_state(bridge, MAC)
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as api:
            path = f"/api/devices/{MAC}/tools/call"
            refused = await api.post(path, json={"name": name, "arguments": {}})
            assert refused.status_code == 428, refused.text
            assert refused.json()["error"]["code"] == "confirmation_required"
            confirmed = await api.post(path, json={"name": name, "arguments": {}, "confirm": True})
            assert confirmed.status_code == 200, confirmed.text
    finally:
        await device.close()
