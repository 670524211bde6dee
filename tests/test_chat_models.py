"""The console's chat API (issue #19): `GET /api/chat/models` for each provider, per-request
chat and guardrail models reaching the model service, `duration_ms` on tool events and
`done.metadata.confirmation`. A real bridge on loopback, the fake LLM, real devices."""

import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from backend.server import Bridge
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from testkit.stock_device import STATUS_TOOL, VOLUME_TOOL, WireDevice
from tests.helpers import create_key, sse_events, wait_state

MODEL = "dental-duckduckgo"
CHAT_DEFAULT = "server-chat"
GUARD_DEFAULT = "server-guard"
# Not clearly dental ("gum" has other meanings): the guardrail model is asked.
GUARDED = "Chewing gum brands"
QUESTION = "How long should I brush my teeth?"
UPGRADE = "self.firmware.upgrade"
MAC = "a4:cf:12:34:56:78"


@pytest.fixture
async def llm_bridge(bridge_factory: Any, fake_llm: FakeLlm) -> Bridge:
    bridge: Bridge = await bridge_factory(
        llm_provider="openai",
        llm_base_url=fake_llm.url,
        llm_model=CHAT_DEFAULT,
        guardrail_model=GUARD_DEFAULT,
    )
    return bridge


def admin(bridge: Bridge, token: str = ADMIN_TOKEN) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30)


@pytest.fixture
async def http(llm_bridge: Bridge) -> AsyncIterator[httpx.AsyncClient]:
    async with admin(llm_bridge) as client:
        yield client


async def stream(http: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    async with http.stream("POST", "/api/chat/stream", json=body) as response:
        assert response.status_code == 200, await response.aread()
        return await sse_events(response)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


# ---- GET /api/chat/models ---------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["openai", "ollama"])
async def test_the_providers_models_are_listed_with_the_defaults(
    provider: str, bridge_factory: Any, fake_llm: FakeLlm
) -> None:
    fake_llm.models = ["zeta:1b", "alpha", "zeta:1b", "hf.co/org/repo:Q4_K_M"]
    bridge = await bridge_factory(
        llm_provider=provider,
        llm_base_url=fake_llm.url,
        llm_model=CHAT_DEFAULT,
        guardrail_model=GUARD_DEFAULT,
    )
    key = await create_key(bridge, "chat:use")
    async with admin(bridge, key) as client:
        response = await client.get("/api/chat/models")
    assert response.status_code == 200, response.text
    assert response.json() == {
        "provider": provider,
        "defaults": {"chat": CHAT_DEFAULT, "guardrail": GUARD_DEFAULT},
        "models": ["alpha", "hf.co/org/repo:Q4_K_M", "zeta:1b"],  # sorted, once each
        "error": None,
    }
    assert fake_llm.listings == 1 and not fake_llm.requests  # a GET, no chat request


async def test_no_provider_lists_nothing_and_says_why(
    bridge: Bridge, api: httpx.AsyncClient
) -> None:
    body = (await api.get("/api/chat/models")).json()
    assert body["provider"] == "none" and body["models"] == []
    assert body["defaults"] == {"chat": None, "guardrail": None}
    assert "llm_provider = none" in body["error"]


async def test_an_unreachable_or_failing_provider_lists_nothing_with_the_error(
    bridge_factory: Any, fake_llm: FakeLlm
) -> None:
    down = await bridge_factory(
        llm_provider="ollama", llm_base_url=f"http://127.0.0.1:{closed_port()}"
    )
    async with admin(down) as client:
        body = (await client.get("/api/chat/models")).json()
    assert body["provider"] == "ollama" and body["models"] == []
    assert "unreachable" in body["error"]
    assert body["defaults"]["chat"] == down.settings.llm_model

    fake_llm.models_status = 503
    failing = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    async with admin(failing) as client:
        body = (await client.get("/api/chat/models")).json()
    assert body["models"] == [] and "HTTP 503" in body["error"]


@pytest.mark.parametrize(
    "raw",
    [b"not json", b'{"models": null, "data": 7}', b"[1, 2]", b'{"data": [{"id": 5}, "x"]}'],
)
@pytest.mark.parametrize("provider", ["openai", "ollama"])
async def test_a_garbled_listing_is_an_error_or_skipped_never_a_crash(
    provider: str, raw: bytes, bridge_factory: Any, fake_llm: FakeLlm
) -> None:
    fake_llm.models_body = raw
    bridge = await bridge_factory(llm_provider=provider, llm_base_url=fake_llm.url)
    async with admin(bridge) as client:
        response = await client.get("/api/chat/models")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["models"] == []
    # Entries that are not {"id": str} are skipped; a reply that is no listing is an error.
    skipped = provider == "openai" and raw.startswith(b'{"data": [')
    assert (body["error"] is None) if skipped else ("not" in body["error"])


async def test_an_empty_listing_is_not_an_error(bridge_factory: Any, fake_llm: FakeLlm) -> None:
    fake_llm.models = []
    bridge = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    async with admin(bridge) as client:
        body = (await client.get("/api/chat/models")).json()
    assert body["models"] == [] and body["error"] is None


async def test_models_need_a_key_with_chat_use(llm_bridge: Bridge) -> None:
    async with httpx.AsyncClient(base_url=llm_bridge.api_url) as anonymous:
        assert (await anonymous.get("/api/chat/models")).status_code == 401
        bad = {"Authorization": "Bearer not-a-key"}
        assert (await anonymous.get("/api/chat/models", headers=bad)).status_code == 401
    reader = await create_key(llm_bridge, "devices:read")
    async with admin(llm_bridge, reader) as client:
        response = await client.get("/api/chat/models")
    assert response.status_code == 403


# ---- per-request models -----------------------------------------------------------------------


async def test_the_server_models_are_used_by_default(
    http: httpx.AsyncClient, fake_llm: FakeLlm
) -> None:
    await stream(http, {"message": GUARDED})
    assert fake_llm.models_of("guardrail") == [GUARD_DEFAULT]
    assert fake_llm.models_of("chat") == [CHAT_DEFAULT]
    assert fake_llm.models_of("summary") == [CHAT_DEFAULT]


@pytest.mark.parametrize(
    "names",
    [("chat_model", "guardrail_model"), ("ollama_model", "ollama_guardrail_model")],
)
async def test_the_requests_models_reach_the_model_service(
    names: tuple[str, str], http: httpx.AsyncClient, fake_llm: FakeLlm
) -> None:
    chat, guard = names
    body = {"message": GUARDED, chat: "mine:7b", guard: "mine-guard"}
    events = await stream(http, body)
    assert events[-1]["type"] == "done"
    assert fake_llm.models_of("guardrail") == ["mine-guard"]
    assert fake_llm.models_of("chat") == ["mine:7b"]
    assert fake_llm.models_of("summary") == ["mine:7b"]  # the answer's model summarises it


async def test_the_openai_api_takes_the_models_too(
    http: httpx.AsyncClient, fake_llm: FakeLlm
) -> None:
    messages = [{"role": "user", "content": GUARDED}]
    body = {"model": MODEL, "messages": messages, "chat_model": "a", "guardrail_model": "b"}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert fake_llm.models_of("guardrail") == ["b"] and fake_llm.models_of("chat") == ["a"]
    # Only the chat model given: the guardrail is the server's.
    body = {"model": MODEL, "messages": messages, "ollama_model": "c", "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as streamed:
        assert streamed.status_code == 200
        assert (await sse_events(streamed))[-1] == "[DONE]"
    assert fake_llm.models_of("guardrail")[-1] == GUARD_DEFAULT
    assert fake_llm.models_of("chat")[-1] == "c"


BAD_MODELS: list[Any] = [
    "",
    "x" * 201,
    "two words",
    "line\nbreak",
    '"quoted"',
    "-starts-with-dash",
    "é-accent",
    42,
    ["list"],
    {"object": 1},
]


@pytest.mark.parametrize("value", BAD_MODELS)
@pytest.mark.parametrize("field", ["chat_model", "guardrail_model", "ollama_model"])
async def test_bad_model_names_are_refused_before_any_model_call(
    field: str, value: Any, http: httpx.AsyncClient, fake_llm: FakeLlm
) -> None:
    completion = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}]}
    response = await http.post("/v1/chat/completions", json={**completion, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    # The admin API's own convention for a body that does not validate: 422.
    response = await http.post("/api/chat/stream", json={"message": QUESTION, field: value})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    assert not fake_llm.requests


async def test_an_allow_list_bounds_the_models_a_request_may_ask_for(
    bridge_factory: Any, fake_llm: FakeLlm
) -> None:
    fake_llm.models = ["cheap:1b", "costly-xl", CHAT_DEFAULT]
    bridge = await bridge_factory(
        llm_provider="openai",
        llm_base_url=fake_llm.url,
        llm_model=CHAT_DEFAULT,
        guardrail_model=GUARD_DEFAULT,
        chat_models_allowed=["cheap:1b"],
    )
    key = await create_key(bridge, "chat:use")
    async with admin(bridge, key) as client:
        # The listing offers only what a request may ask for.
        listed = (await client.get("/api/chat/models")).json()["models"]
        assert listed == ["cheap:1b", CHAT_DEFAULT]
        completion = {"model": MODEL, "messages": [{"role": "user", "content": GUARDED}]}
        for field in ("chat_model", "ollama_guardrail_model"):
            response = await client.post(
                "/v1/chat/completions", json={**completion, field: "costly-xl"}
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "model_not_allowed"
            assert error["param"] == field.replace("ollama_", "")
            streamed = await client.post(
                "/api/chat/stream", json={"message": GUARDED, field: "costly-xl"}
            )
            assert streamed.status_code == 400
            assert streamed.json()["error"]["code"] == "model_not_allowed"
        assert not fake_llm.requests  # refused before any model call
        # An allowed one, and the configured defaults, go through.
        body = {"message": GUARDED, "chat_model": "cheap:1b", "guardrail_model": GUARD_DEFAULT}
        events = await stream(client, body)
    assert events[-1]["type"] == "done"
    assert fake_llm.models_of("chat") == ["cheap:1b"]
    assert fake_llm.models_of("guardrail") == [GUARD_DEFAULT]


async def test_a_name_and_its_alias_together_are_refused(
    http: httpx.AsyncClient, fake_llm: FakeLlm
) -> None:
    body = {"message": QUESTION, "chat_model": "a", "ollama_model": "b"}
    assert (await http.post("/api/chat/stream", json=body)).status_code == 422
    body = {"message": QUESTION, "guardrail_model": "a", "ollama_guardrail_model": "b"}
    assert (await http.post("/api/chat/stream", json=body)).status_code == 422
    assert not fake_llm.requests


async def test_a_model_the_service_does_not_have_means_offline_mode(
    http: httpx.AsyncClient, fake_llm: FakeLlm
) -> None:
    fake_llm.script("chat", Reply(status=404))  # what Ollama answers for an unknown model
    events = await stream(http, {"message": QUESTION, "chat_model": "missing"})
    metadata = events[-1]["metadata"]
    assert metadata["offline"] and "HTTP 404" in metadata["offline_reason"]


# ---- duration_ms and confirmation -------------------------------------------------------------


async def test_tool_events_carry_their_duration(
    llm_bridge: Bridge, http: httpx.AsyncClient, fake_llm: FakeLlm, simulated_devices: Any
) -> None:
    sim = await simulated_devices(llm_bridge)
    volume = FakeCall("self_audio_speaker_set_volume", {"volume": 30})
    fake_llm.script("chat", Reply(calls=[volume]), Reply("Done."))
    events = await stream(http, {"message": "Set the volume to 30", "device_id": sim.device_id})
    started, completed = (e for e in events if e["type"] == "mcp_tool")
    assert "duration_ms" not in started
    assert isinstance(completed["duration_ms"], float) and completed["duration_ms"] > 0
    assert events[-1]["metadata"]["confirmation"] is None

    # No call was made (the key may not call the device): no duration to show.
    key = await create_key(llm_bridge, "chat:use")
    fake_llm.script("chat", Reply("I cannot."))
    async with admin(llm_bridge, key) as client:
        events = await stream(
            client, {"message": "Set the volume to 30", "device_id": sim.device_id}
        )
    [denied] = [e for e in events if e["type"] == "mcp_tool"]
    assert denied["status"] == "error" and denied["duration_ms"] is None


@pytest.fixture
async def risky_device(llm_bridge: Bridge) -> AsyncIterator[WireDevice]:
    url = {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}
    upgrade = {"name": UPGRADE, "description": "Upgrade the firmware.", "inputSchema": url}
    wire = WireDevice(
        llm_bridge.ws_url, DEVICE_TOKEN, MAC, tools=[STATUS_TOOL, VOLUME_TOOL, upgrade]
    )
    await wire.connect()
    await wait_state(llm_bridge, MAC)
    yield wire
    await wire.close()


async def test_a_turn_asking_for_a_yes_says_so_in_its_metadata(
    http: httpx.AsyncClient, fake_llm: FakeLlm, risky_device: WireDevice
) -> None:
    arguments = {"url": "http://x/f.bin"}
    fake_llm.script(
        "chat", Reply("Let me upgrade it.", calls=[FakeCall("self_firmware_upgrade", arguments)])
    )
    body = {"message": "Upgrade your firmware from http://x/f.bin", "device_id": MAC}
    first = await stream(http, {**body, "conversation_id": "risky"})
    confirmation = first[-1]["metadata"]["confirmation"]
    assert confirmation is not None
    assert (confirmation["tool"], confirmation["arguments"]) == (UPGRADE, arguments)
    assert confirmation["reason"] == "rule '*upgrade*'"  # why the policy asks
    assert risky_device.stock.calls == []

    yes = await stream(http, {"message": "yes", "device_id": MAC, "conversation_id": "risky"})
    assert yes[-1]["metadata"]["confirmation"] is None
    [completed] = [e for e in yes if e.get("status") == "completed"]
    assert completed["tool"] == UPGRADE and completed["duration_ms"] > 0
    assert [name for name, _ in risky_device.stock.calls] == [UPGRADE]
