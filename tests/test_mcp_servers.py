"""External MCP servers used by the chat beside device tools (backend/mcp_servers).

A real bridge whose chat model is the loopback fake LLM; external servers written with the
official SDK (tests/fakes/mcp_server.py) over stdio and over Streamable HTTP on loopback, and the
published `mcp-server-time` from PyPI. Turns go through the real HTTP API. Hostile servers: one
that hangs, one that dies mid-call, one that floods notifications, one that answers megabytes.
"""

import asyncio
import itertools
import json
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import mcp.types as mcp_types
import pytest
from pydantic import ValidationError

from backend.chat.llm.base import FunctionSpec
from backend.chat.tools import ToolOutcome
from backend.config import Settings
from backend.keys import McpScope, Principal, Scope
from backend.keys.store import parse_scopes
from backend.mcp_servers.connectors import ConfiguredServer
from backend.mcp_servers.hub import (
    McpServerHub,
    RiskyRule,
    ServerBusy,
    ServerState,
    SessionServer,
)
from backend.mcp_servers.settings import McpServerSettings
from backend.mcp_session import Tool
from backend.server import Bridge
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from testkit.stock_device import WireDevice
from tests.helpers import create_key, run_cli, sse_events, wait_state
from tests.mcp_servers_helpers import (
    http_mcp_server,
    server_of,
    stdio_entry,
    wait_ready,
    wait_until,
)

VOLUME_LLM = "self_audio_speaker_set_volume"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


async def start(bridge_factory: Callable[..., Any], fake_llm: FakeLlm, *entries: Any) -> Bridge:
    bridge: Bridge = await bridge_factory(
        llm_provider="openai", llm_base_url=fake_llm.url, mcp_servers=list(entries)
    )
    return bridge


def client(bridge: Bridge, token: str = ADMIN_TOKEN) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=60)


async def stream(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with http.stream("POST", "/api/chat/stream", json=body) as response:
        assert response.status_code == 200, await response.aread()
        return await sse_events(response)


def tool_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event for event in events if event["type"] == "mcp_tool"]


def detect(device: WireDevice, text: str) -> dict[str, Any]:
    """A text turn from a device (what the stock firmware sends for typed text)."""
    return {"session_id": device.session_id, "type": "listen", "state": "detect", "text": text}


def tts_stops(device: WireDevice) -> int:
    return sum(1 for m in device.messages if m.get("type") == "tts" and m["state"] == "stop")


def offered(fake_llm: FakeLlm, index: int = -1) -> list[str]:
    """The function names the bridge offered the model in a chat request."""
    return [tool["function"]["name"] for tool in fake_llm.of_kind("chat")[index].tools]


def tool_messages(fake_llm: FakeLlm, index: int = -1) -> list[str]:
    return [
        message["content"]
        for message in fake_llm.of_kind("chat")[index].messages
        if message["role"] == "tool"
    ]


async def audit_rows(http: httpx.AsyncClient, device_id: str) -> list[dict[str, Any]]:
    response = await http.get("/api/audit", params={"device_id": device_id})
    assert response.status_code == 200, response.text
    rows: list[dict[str, Any]] = response.json()["entries"]
    return rows


# ---- a chat turn per kind of server -----------------------------------------------------------


async def test_a_stdio_server_tool_in_a_chat_turn(bridge_factory, fake_llm):
    bridge = await start(bridge_factory, fake_llm, stdio_entry("fake"))
    await wait_ready(bridge, "fake")
    fake_llm.script(
        "chat", Reply(calls=[FakeCall("fake__echo", {"text": "hi"})]), Reply("It said hi.")
    )
    async with client(bridge) as http:
        events = await stream(http, {"message": "Echo hi please"})
        tools = tool_events(events)
        assert [(e["tool"], e["status"]) for e in tools] == [
            ("fake:echo", "started"),
            ("fake:echo", "completed"),
        ]
        assert tools[1]["result"] == [{"type": "text", "text": "echo:hi"}]
        assert "fake__echo" in offered(fake_llm, 0)
        spec = next(
            tool["function"]
            for tool in fake_llm.of_kind("chat")[0].tools
            if tool["function"]["name"] == "fake__echo"
        )
        assert spec["description"].startswith("[MCP server fake] Echo the text back.")
        assert spec["parameters"]["required"] == ["text"]
        assert "echo:hi" in tool_messages(fake_llm)
        rows = await audit_rows(http, "mcp:fake")
    assert [(r["tool"], r["outcome"], r["actor"]) for r in rows] == [("echo", "ok", "chat:admin")]


async def test_an_http_server_with_a_bearer_token_through_the_openai_route(
    bridge_factory, fake_llm
):
    async with http_mcp_server("web", token="tok-123") as (url, guard):
        entry = {"name": "web", "url": url, "bearer_token": "tok-123"}
        bridge = await start(bridge_factory, fake_llm, entry)
        await wait_ready(bridge, "web")
        key = await create_key(bridge, "chat:use", "mcp:web")
        fake_llm.script(
            "chat", Reply(calls=[FakeCall("web__echo", {"text": "over http"})]), Reply("Done.")
        )
        body = {"model": "dental-duckduckgo", "messages": [{"role": "user", "content": "echo"}]}
        async with client(bridge, key) as http:
            response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "Done."
        assert "echo:over http" in tool_messages(fake_llm)
        assert b"Bearer tok-123" in guard.seen_authorization
        async with client(bridge) as http:
            listing = (await http.get("/api/mcp/servers")).text
        assert "tok-123" not in listing and json.loads(listing)["servers"][0]["state"] == "ready"


async def test_a_wrong_bearer_token_backs_off_and_says_why(bridge_factory, fake_llm):
    async with http_mcp_server("web", token="right") as (url, _guard):
        entry = {"name": "web", "url": url, "bearer_token": "wrong-secret"}
        bridge = await start(bridge_factory, fake_llm, entry)
        server = server_of(bridge, "web")
        await wait_until(lambda: server.last_error is not None)
        assert server.state is not ServerState.READY
        async with client(bridge) as http:
            listing = (await http.get("/api/mcp/servers")).json()["servers"][0]
            events = await stream(http, {"message": "How long should I brush?"})
        assert listing["state"] in ("backing-off", "connecting") and listing["last_error"]
        assert "wrong-secret" not in json.dumps(listing)
        assert not any(name.startswith("web__") for name in offered(fake_llm))
        assert events[-1]["type"] == "done"


async def test_the_published_time_server_from_pypi(bridge_factory, fake_llm):
    command = shutil.which("mcp-server-time", path=str(Path(sys.executable).parent))
    assert command is not None, "pip install mcp-server-time (the dev extra)"
    entry = {"name": "time", "command": command, "args": ["--local-timezone", "UTC"]}
    bridge = await start(bridge_factory, fake_llm, entry)
    server = await wait_ready(bridge, "time")
    assert {"get_current_time", "convert_time"} <= {tool.name for tool in server.tools}
    fake_llm.script(
        "chat",
        Reply(calls=[FakeCall("time__get_current_time", {"timezone": "Asia/Ho_Chi_Minh"})]),
        Reply("It is evening in Hanoi."),
    )
    async with client(bridge) as http:
        events = await stream(http, {"message": "What time is it in Hanoi?"})
    completed = tool_events(events)[-1]
    assert completed["status"] == "completed" and not completed["is_error"]
    assert json.loads(completed["result"][0]["text"])["timezone"] == "Asia/Ho_Chi_Minh"


async def test_a_device_tool_and_an_external_tool_in_one_turn(
    bridge_factory, fake_llm, simulated_devices
):
    bridge = await start(bridge_factory, fake_llm, stdio_entry("fake"))
    await wait_ready(bridge, "fake")
    sim = await simulated_devices(bridge)
    fake_llm.script(
        "chat",
        Reply(
            calls=[
                FakeCall(VOLUME_LLM, {"volume": 30}),
                FakeCall("fake__echo", {"text": "both"}),
            ]
        ),
        Reply("Volume set, and echoed."),
    )
    async with client(bridge) as http:
        events = await stream(
            http, {"message": "Set volume 30 and echo", "device_id": sim.device_id}
        )
    completed = {e["tool"]: e for e in tool_events(events) if e["status"] == "completed"}
    assert set(completed) == {"self.audio_speaker.set_volume", "fake:echo"}
    assert sim.hal.get_volume() == 30
    names = offered(fake_llm, 0)
    assert VOLUME_LLM in names and "fake__echo" in names and len(names) == len(set(names))


# ---- scopes -----------------------------------------------------------------------------------


async def test_only_keys_with_the_servers_scope_get_its_tools(bridge_factory, fake_llm):
    bridge = await start(bridge_factory, fake_llm, stdio_entry("fake"))
    await wait_ready(bridge, "fake")
    for scopes, expected in (
        (("chat:use",), False),
        (("chat:use", "mcp:other"), False),
        (("chat:use", "mcp:fake"), True),
    ):
        key = await create_key(bridge, *scopes)
        async with client(bridge, key) as http:
            await stream(http, {"message": "Echo something"})
        assert any(name.startswith("fake__") for name in offered(fake_llm)) is expected, scopes

    # a key without the scope cannot call the tool even if the model names it
    key = await create_key(bridge, "chat:use")
    fake_llm.script("chat", Reply(calls=[FakeCall("fake__echo", {"text": "x"})]), Reply("No."))
    async with client(bridge, key) as http:
        events = await stream(http, {"message": "Echo x"})
    failed = tool_events(events)[-1]
    assert failed["status"] == "error" and "no function 'fake__echo'" in failed["error"]
    assert not any(row["outcome"] == "ok" for row in await _admin_audit(bridge))


async def _admin_audit(bridge: Bridge) -> list[dict[str, Any]]:
    async with client(bridge) as http:
        return await audit_rows(http, "mcp:fake")


async def test_the_servers_route_needs_devices_read_and_keys_take_mcp_scopes(
    bridge_factory, fake_llm
):
    bridge = await start(bridge_factory, fake_llm, stdio_entry("fake"))
    await wait_ready(bridge, "fake")
    chat_only = await create_key(bridge, "chat:use")
    reader = await create_key(bridge, "devices:read")
    async with client(bridge, chat_only) as http:
        assert (await http.get("/api/mcp/servers")).status_code == 403
    async with client(bridge, "esk_000000000000_bogus") as http:
        assert (await http.get("/api/mcp/servers")).status_code == 401
    async with client(bridge, reader) as http:
        listed = (await http.get("/api/mcp/servers")).json()["servers"]
    assert [(s["name"], s["kind"], s["state"]) for s in listed] == [("fake", "stdio", "ready")]
    assert {"echo", "erase"} <= {tool["name"] for tool in listed[0]["tools"]}
    assert str(Path(__file__).parent) not in json.dumps(listed)  # args are not shown
    async with client(bridge) as http:
        made = await http.post("/api/keys", json={"name": "k", "scopes": ["chat:use", "mcp:fake"]})
        assert made.status_code == 201 and made.json()["scopes"] == ["chat:use", "mcp:fake"]
        for bad in ("mcp:", "mcp:Fake", "mcp:a b", "mcp:" + "x" * 33, "mcp:fake\u200b"):
            refused = await http.post("/api/keys", json={"name": "k", "scopes": [bad]})
            assert refused.status_code == 422, bad


async def test_cli_mcp_servers(bridge_factory, fake_llm):
    bridge = await start(bridge_factory, fake_llm, stdio_entry("fake"))
    await wait_ready(bridge, "fake")
    code, out, err = await run_cli(
        "mcp", "servers", "--server", bridge.api_url, "--token", ADMIN_TOKEN
    )
    assert code == 0, err
    assert "fake" in out and "stdio" in out and "ready" in out and "erase (risky)" in out
    code, out, err = await run_cli(
        "mcp", "servers", "--json", "--server", bridge.api_url, "--token", ADMIN_TOKEN
    )
    assert code == 0, err and json.loads(out)[0]["name"] == "fake"
    code, _out, err = await run_cli("mcp", "servers", "--server", bridge.api_url, "--token", "x")
    assert code != 0 and err


# ---- risky tools and list changes -------------------------------------------------------------


async def test_a_destructive_tool_waits_for_a_yes(bridge_factory, fake_llm):
    bridge = await start(bridge_factory, fake_llm, stdio_entry("fake"))
    await wait_ready(bridge, "fake")
    fake_llm.script(
        "chat", Reply(calls=[FakeCall("fake__erase", {"what": "notes"})]), Reply("Asked.")
    )
    async with client(bridge) as http:
        first = await stream(http, {"message": "Erase the notes", "conversationId": "risky-1"})
        assert tool_events(first)[-1]["status"] == "error"
        assert "not run yet" in tool_events(first)[-1]["error"]
        assert server_of(bridge, "fake").calls == 0
        second = await stream(http, {"message": "yes", "conversationId": "risky-1"})
        completed = tool_events(second)[-1]
        assert completed["status"] == "completed"
        assert completed["result"] == [{"type": "text", "text": "erased notes"}]
        rows = await audit_rows(http, "mcp:fake")
    assert [(r["outcome"], r["confirmed"]) for r in rows] == [("ok", True), ("refused", False)]


async def test_a_changed_tool_list_is_followed(bridge_factory, fake_llm):
    bridge = await start(bridge_factory, fake_llm, stdio_entry("fake"))
    server = await wait_ready(bridge, "fake")
    fake_llm.script("chat", Reply(calls=[FakeCall("fake__grow", {})]), Reply("Grown."))
    async with client(bridge) as http:
        await stream(http, {"message": "Grow a tool"})
        await wait_until(lambda: server.tool("late_tool") is not None)
        await stream(http, {"message": "What now?"})
    assert "fake__late_tool" in offered(fake_llm)
    assert "fake__late_tool" not in offered(fake_llm, 0)


# ---- hostile servers --------------------------------------------------------------------------


async def test_a_hanging_call_hurts_only_its_own_turn_and_can_be_cancelled(
    bridge_factory, fake_llm
):
    bridge = await start(bridge_factory, fake_llm, stdio_entry("fake", timeout_s=120))
    server = await wait_ready(bridge, "fake")
    fake_llm.script("chat", Reply(calls=[FakeCall("fake__hang", {})]))
    async with client(bridge) as http:
        started = asyncio.Event()

        async def hanging_turn() -> None:
            async with http.stream("POST", "/api/chat/stream", json={"message": "hang"}) as r:
                async for line in r.aiter_lines():
                    if '"started"' in line:
                        started.set()

        hanging = asyncio.create_task(hanging_turn())
        await asyncio.wait_for(started.wait(), 30)
        fake_llm.script(
            "chat", Reply(calls=[FakeCall("fake__echo", {"text": "meanwhile"})]), Reply("Ok.")
        )
        other = await stream(http, {"message": "echo meanwhile"})
        assert tool_events(other)[-1]["result"][0]["text"] == "echo:meanwhile"
        assert not hanging.done()  # still waiting on its own call
        hanging.cancel()  # the client goes away: the turn and its call are cancelled
        await asyncio.gather(hanging, return_exceptions=True)
        await wait_until(lambda: len(bridge.audit._buffer) > 0 or bridge.audit.written >= 2)
        rows = await audit_rows(http, "mcp:fake")
    assert ("hang", "error", "cancelled") in [(r["tool"], r["outcome"], r["error"]) for r in rows]
    assert server.state is ServerState.READY


async def test_a_call_that_times_out_is_an_error_the_model_hears(bridge_factory, fake_llm):
    bridge = await start(bridge_factory, fake_llm, stdio_entry("fake", timeout_s=0.5))
    await wait_ready(bridge, "fake")
    fake_llm.script("chat", Reply(calls=[FakeCall("fake__hang", {})]), Reply("It timed out."))
    async with client(bridge) as http:
        events = await stream(http, {"message": "hang"})
    failed = tool_events(events)[-1]
    assert failed["status"] == "error" and "gave no answer in 0.5 s" in failed["error"]
    assert any("gave no answer" in text for text in tool_messages(fake_llm))
    assert events[-1]["type"] == "done"


async def test_a_server_that_dies_mid_call_is_reconnected(bridge_factory, fake_llm):
    bridge = await start(bridge_factory, fake_llm, stdio_entry("fake"))
    server = await wait_ready(bridge, "fake")
    fake_llm.script("chat", Reply(calls=[FakeCall("fake__crash", {})]), Reply("It crashed."))
    async with client(bridge) as http:
        events = await stream(http, {"message": "crash"})
        failed = tool_events(events)[-1]
        assert failed["status"] == "error" and "Connection closed" in failed["error"]
        await wait_ready(bridge, "fake", connects=2)
        assert server.last_error == "connection lost"
        fake_llm.script(
            "chat", Reply(calls=[FakeCall("fake__echo", {"text": "back"})]), Reply("Back.")
        )
        again = await stream(http, {"message": "echo back"})
    assert tool_events(again)[-1]["result"][0]["text"] == "echo:back"


async def test_a_notification_flood_is_coalesced(bridge_factory, fake_llm):
    bridge = await start(bridge_factory, fake_llm, stdio_entry("fake"))
    server = await wait_ready(bridge, "fake")
    assert isinstance(server, SessionServer)
    fake_llm.script("chat", Reply(calls=[FakeCall("fake__flood", {"count": 3000})]), Reply("Ok."))
    async with client(bridge) as http:
        events = await stream(http, {"message": "flood"})
        assert tool_events(events)[-1]["result"][0]["text"] == "flooded 3000"
        await wait_until(lambda: server.notifications == 3000)
        assert (await http.get("/api/mcp/servers")).status_code == 200
    # Re-lists wait for each other (at most one per 2 s, as a device's): the first may be pending.
    await wait_until(lambda: server.relists >= 1)
    assert 1 <= server.relists < server.notifications
    assert server.state is ServerState.READY


async def test_a_huge_result_is_cut_to_max_result_bytes(bridge_factory, fake_llm):
    entry = stdio_entry("fake", max_result_bytes=1024)
    bridge = await start(bridge_factory, fake_llm, entry)
    await wait_ready(bridge, "fake")
    fake_llm.script(
        "chat", Reply(calls=[FakeCall("fake__huge", {"size": 4_000_000})]), Reply("Big.")
    )
    async with client(bridge) as http:
        events = await stream(http, {"message": "huge"})
    text = tool_events(events)[-1]["result"][0]["text"]
    assert text.startswith("x" * 1024) and text.endswith("[result cut at 1024 bytes]")
    assert len(text.encode()) < 1100
    assert max(len(message) for message in tool_messages(fake_llm)) < 1100


# ---- configuration, scopes, toolbox units -----------------------------------------------------


@pytest.mark.parametrize(
    "entry",
    [
        {"name": "Fake", "command": "x"},
        {"name": "a.b", "command": "x"},
        {"name": "", "command": "x"},
        {"name": "x" * 33, "command": "x"},
        {"name": "endpoint", "command": "x"},
        {"name": "both", "command": "x", "url": "http://127.0.0.1/mcp"},
        {"name": "neither"},
        {"name": "hdr", "command": "x", "bearer_token": "t"},
        {"name": "args", "url": "http://127.0.0.1/mcp", "args": ["a"]},
        {"name": "scheme", "url": "file:///etc/passwd"},
        {"name": "userinfo", "url": "https://user:pw@x.test/mcp"},
        {"name": "small", "command": "x", "max_result_bytes": 10},
        {"name": "extra", "command": "x", "unknown": 1},
    ],
)
def test_bad_server_entries_are_refused(tmp_path, entry):
    with pytest.raises(ValidationError):
        Settings.on_loopback(tmp_path, mcp_servers=[entry])


def test_server_names_are_unique_and_secrets_stay_hidden(tmp_path):
    with pytest.raises(ValidationError, match="unique"):
        Settings.on_loopback(tmp_path, mcp_servers=[stdio_entry("a"), stdio_entry("a")])
    entry = McpServerSettings(
        name="web", url="https://x.test/mcp", bearer_token="s3cret", headers={"X-Key": "k3y"}
    )
    assert "s3cret" not in repr(entry) and "k3y" not in repr(entry)
    assert entry.http_headers() == {"X-Key": "k3y", "Authorization": "Bearer s3cret"}


def test_mcp_scopes_parse_and_admin_uses_every_server():
    scopes = parse_scopes(["chat:use", "mcp:fs"])
    assert McpScope("mcp:fs") in scopes and McpScope("mcp:fs").server == "fs"
    with pytest.raises(ValueError, match="unknown scope"):
        parse_scopes(["mcp:FS"])
    key = Principal("k", "k", scopes)
    assert key.may_use_server("fs") and not key.may_use_server("db")
    assert Principal("a", "a", frozenset({Scope.ADMIN})).may_use_server("db")


def test_risky_rules():
    plain = Tool(name="write_file")
    marked = Tool(name="rm", annotations={"destructiveHint": True})
    assert RiskyRule.from_setting(None).reason(marked) and not RiskyRule.from_setting(None).reason(
        plain
    )
    assert RiskyRule.from_setting(True).reason(plain)
    assert not RiskyRule.from_setting(False).reason(marked)
    listed = RiskyRule.from_setting(["write_*"])
    assert listed.reason(plain) and not listed.reason(marked)


class _Session:
    """A stand-in for an initialized ClientSession (only list_tools and call_tool)."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.called: list[str] = []

    async def list_tools(self, *, params: Any = None) -> mcp_types.ListToolsResult:
        tools = [mcp_types.Tool(name=name, input_schema={"type": "object"}) for name in self.names]
        return mcp_types.ListToolsResult(tools=tools)

    async def call_tool(self, name: str, arguments: Any = None, *_: Any) -> Any:
        self.called.append(name)
        return mcp_types.CallToolResult(content=[mcp_types.TextContent(text=f"ran {name}")])


class _DeviceBox:
    unavailable_reason: str | None = None

    def __init__(self, *names: str) -> None:
        self.names = names
        self.called: list[str] = []

    def functions(self) -> list[FunctionSpec]:
        return [FunctionSpec(name, "device tool", {"type": "object"}) for name in self.names]

    def device_tool_name(self, llm_name: str) -> str:
        return llm_name

    async def call(self, llm_name: str, arguments: Any, *, confirmed: bool = False) -> ToolOutcome:
        self.called.append(llm_name)
        return ToolOutcome("device ran")


async def test_bound_servers_serve_only_their_devices_and_names_never_collide():
    hub = McpServerHub()
    everyone, bound = (
        SessionServer("fs", kind="dialin"),
        SessionServer("home", kind="dialin", bound_device_ids=frozenset({"dev-1"})),
    )
    await everyone.attach(_Session("echo", "read"))
    await bound.attach(_Session("lamp"))
    hub.add(everyone)
    hub.add(bound)

    device = _DeviceBox("fs__echo", "self_reboot")  # a device tool named like an external one
    box = hub.toolbox_for(None, "dev-1", device)
    names = [spec.llm_name for spec in box.functions()]
    assert len(names) == len(set(names)) == 5
    assert "fs__echo" in names and "home__lamp" in names and "fs__read" in names
    external_echo = next(n for n in names if n.startswith("fs__echo") and n != "fs__echo")
    assert (await box.call("fs__echo", {})).text == "device ran"
    assert (await box.call(external_echo, {})).text == "ran echo"
    assert box.device_tool_name(external_echo) == "fs:echo"

    other = hub.toolbox_for(None, "dev-2", None)
    assert [spec.llm_name for spec in other.functions()] == ["fs__echo", "fs__read"]
    no_device = hub.toolbox_for(Principal("a", "a", frozenset({Scope.ADMIN})), None, None)
    assert "home__lamp" not in [spec.llm_name for spec in no_device.functions()]

    hub.remove("fs", everyone)
    everyone.detach("disconnected")
    assert [spec.llm_name for spec in other.functions()] == []
    assert (await other.call("fs__echo", {})).failed


# ---- a device's own turns; a server that never starts -----------------------------------------


async def test_a_devices_own_turn_gets_the_servers_bound_to_it_or_to_all(bridge_factory, fake_llm):
    mine, other = "02:00:00:00:00:0a", "02:00:00:00:00:0b"
    bridge = await start(
        bridge_factory,
        fake_llm,
        stdio_entry("shared"),
        stdio_entry("home", device_ids=[mine]),
    )
    await wait_ready(bridge, "shared")
    await wait_ready(bridge, "home")
    devices = [WireDevice(bridge.ws_url, DEVICE_TOKEN, device_id) for device_id in (mine, other)]
    try:
        for device in devices:
            await device.connect()
            await wait_state(bridge, device.device_id)
        fake_llm.script(
            "chat", Reply(calls=[FakeCall("home__echo", {"text": "lamp"})]), Reply("Lamp echoed.")
        )
        await devices[0].send(detect(devices[0], "Echo lamp"))
        await devices[0].wait_for_count(lambda: tts_stops(devices[0]), 1)
        offered_to_mine = offered(fake_llm, 0)
        await devices[1].send(detect(devices[1], "Echo lamp"))
        await devices[1].wait_for_count(lambda: tts_stops(devices[1]), 1)
        offered_to_other = offered(fake_llm)
    finally:
        for device in devices:
            await device.close()
    assert "home__echo" in offered_to_mine and "shared__echo" in offered_to_mine
    assert "shared__echo" in offered_to_other and "home__echo" not in offered_to_other
    assert "echo:lamp" in tool_messages(fake_llm, 1)
    async with client(bridge) as http:
        rows = await audit_rows(http, "mcp:home")
    assert [(r["tool"], r["outcome"], r["actor"]) for r in rows] == [
        ("echo", "ok", f"device:{mine}")
    ]


async def test_a_server_that_never_answers_initialize_backs_off_and_hurts_no_turn(
    bridge_factory, fake_llm
):
    silent = {
        "name": "silent",
        "command": sys.executable,
        "args": ["-c", "import time; time.sleep(3600)"],
        "connect_timeout_s": 0.3,
    }
    bridge = await start(bridge_factory, fake_llm, silent, stdio_entry("fake"))
    await wait_ready(bridge, "fake")
    server = server_of(bridge, "silent")
    await wait_until(lambda: server.last_error is not None)
    assert server.state is not ServerState.READY and "Timeout" in (server.last_error or "")
    fake_llm.script("chat", Reply(calls=[FakeCall("fake__echo", {"text": "ok"})]), Reply("Ok."))
    async with client(bridge) as http:
        events = await stream(http, {"message": "echo ok"})
    assert tool_events(events)[-1]["result"][0]["text"] == "echo:ok"
    assert not any(name.startswith("silent__") for name in offered(fake_llm))


def _processes_with(token: str) -> list[int]:
    """The pids whose command line holds `token`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue  # it exited while we looked
    return pids


@pytest.mark.parametrize("phase", ["handshake", "closing", "backoff"])
async def test_the_bridge_stops_at_once_while_a_silent_server_starts_and_leaves_no_process(
    bridge_factory, fake_llm, phase
):
    """A server that keeps stdout open and never answers. Cancelled while the SDK closed its
    stdio transport (the 2 s it gives the server to exit after its handshake timed out), the
    shutdown drained the server's stdout until it exited: an hour here."""
    token = f"silent-{phase}-{uuid.uuid4().hex}"
    connect_timeout_s = {"handshake": 60.0, "closing": 0.5, "backoff": 0.3}[phase]
    silent = {
        "name": "silent",
        "command": sys.executable,
        "args": ["-c", "import time; time.sleep(3600)", token],
        "connect_timeout_s": connect_timeout_s,
    }
    bridge = await start(bridge_factory, fake_llm, silent)
    server = server_of(bridge, "silent")
    if phase == "backoff":
        await wait_until(lambda: server.last_error is not None)  # timed out, waits to retry
    else:
        await wait_until(lambda: bool(_processes_with(token)))  # spawned, in `initialize`
        if phase == "closing":  # the handshake timed out; the SDK waits for the server to exit
            await asyncio.sleep(connect_timeout_s + 0.7)
    await asyncio.wait_for(bridge.stop(), 30)  # a hang guard: it took as long as the server lived
    assert server.state is ServerState.STOPPED
    await wait_until(lambda: not _processes_with(token), timeout_s=10)


async def test_reconnects_back_off_exponentially_up_to_the_cap():
    settings = McpServerSettings(name="gone", command=sys.executable, args=["-c", "pass"])
    server = ConfiguredServer(settings, backoff_initial_s=0.01, backoff_max_s=0.08)
    waits: list[float] = []
    enough = asyncio.Event()

    async def record(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) >= 6:
            enough.set()
        await asyncio.sleep(0)

    server._sleep = record
    await server.start()
    try:
        await asyncio.wait_for(enough.wait(), 60)
    finally:
        await server.stop()
    assert server.connects == 0 and server.state is ServerState.STOPPED
    assert server.last_error is not None
    assert all(later > earlier for earlier, later in itertools.pairwise(waits[:4]))
    assert 0.008 <= waits[0] <= 0.012 and all(wait <= 0.08 * 1.2 for wait in waits)
    assert waits[-1] >= 0.08 * 0.8  # reached the cap


async def test_calls_beyond_max_pending_calls_are_refused_at_once():
    settings = McpServerSettings(**stdio_entry("fake", max_pending_calls=2))
    server = ConfiguredServer(settings)
    await server.start()
    try:
        await wait_until(lambda: server.state is ServerState.READY)
        hung = [asyncio.create_task(server.call("hang", {})) for _ in range(2)]
        await wait_until(lambda: server.pending == 2)
        with pytest.raises(ServerBusy, match="2 calls in flight"):
            await server.call("echo", {"text": "x"})
        for task in hung:
            task.cancel()
        await asyncio.gather(*hung, return_exceptions=True)
        assert server.pending == 0
        assert (await server.call("echo", {"text": "again"})).text == "echo:again"
    finally:
        await server.stop()
