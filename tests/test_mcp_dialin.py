"""The xiaozhi-style MCP endpoint: MCP servers dial in over a WebSocket and lend their tools.

Most tests serve `DialInEndpoint` alone on loopback (tests/dialin_helpers.py) with a real hub;
the last ones go through the whole bridge (keys, `/api/mcp/servers`, a chat turn).
"""

import asyncio
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from backend.keys import Scope
from backend.mcp_dialin.endpoint import REPLACED, DialInLimits, server_name
from backend.mcp_servers.hub import CallTimedOut, McpServerError, ServerState
from backend.server import Bridge
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from testkit.stock_device import WireDevice
from tests.dialin_helpers import (
    EndpointHost,
    RawPipe,
    closed_with,
    wait_for,
    write_stdio_server,
)
from tests.helpers import create_key, run_cli, sse_events

TOKEN = "esk_0123456789ab_secret"
NAME = server_name("0123456789ab")
DEVICE = "aa:bb:cc:dd:ee:01"
INVALID = "invalid or revoked API key"


@pytest.fixture
async def host() -> AsyncIterator[EndpointHost]:
    running = await EndpointHost(DialInLimits(init_timeout_s=1.0, max_frame_bytes=4096)).start()
    running.add_key(TOKEN)
    yield running
    await running.stop()


async def test_raw_pipe_registers_its_tools_and_answers_calls(host: EndpointHost) -> None:
    pipe = await RawPipe(host.url(TOKEN)).start()
    await wait_for(lambda: host.hub.get(NAME) is not None)
    server = host.hub.get(NAME)
    assert server is not None
    assert server.kind == "dialin"
    assert server.state is ServerState.READY
    assert server.bound_device_ids == frozenset({DEVICE})
    assert [tool.name for tool in server.tools] == ["echo"]
    assert server.serves_device(DEVICE) and not server.serves_device("aa:bb:cc:dd:ee:99")

    result = await server.call("echo", {"text": "hi"})
    assert result.content == [{"type": "text", "text": "echo: hi"}]
    assert pipe.calls == [{"name": "echo", "arguments": {"text": "hi"}}]

    await pipe.close()
    await wait_for(lambda: host.hub.get(NAME) is None)
    assert server.state is ServerState.FAILED
    await wait_for(lambda: host.endpoint.open_count == 0)


async def test_bearer_header_is_accepted_too(host: EndpointHost) -> None:
    pipe = await RawPipe(host.url(), headers={"Authorization": f"Bearer {TOKEN}"}).start()
    await wait_for(lambda: host.hub.get(NAME) is not None)
    await pipe.close()


@pytest.mark.parametrize(
    "token", [None, "", "garbage", "esk_0123456789ab_wrong", "esk_0123456789ac_secret"]
)
async def test_bad_tokens_are_closed_alike(host: EndpointHost, token: str | None) -> None:
    url = host.url(token) if token is not None else host.url()
    assert await closed_with(url) == (4401, "invalid or revoked API key")
    assert len(host.hub) == 0


async def test_revoked_key_is_closed_like_an_unknown_one(host: EndpointHost) -> None:
    del host.keys[TOKEN]  # what KeyStore.revoke does to its index
    assert await closed_with(host.url(TOKEN)) == (4401, "invalid or revoked API key")


async def test_key_without_the_scope_or_devices_is_refused(host: EndpointHost) -> None:
    host.add_key("chat", scopes=frozenset({Scope.CHAT_USE, Scope.DEVICES_CALL}))
    host.add_key("unbound", devices=None, key_id="0123456789ac")
    host.add_key("empty", devices=frozenset(), key_id="0123456789ad")
    assert await closed_with(host.url("chat")) == (4403, "this key lacks the scope mcp:endpoint")
    for token in ("unbound", "empty"):
        assert await closed_with(host.url(token)) == (4403, "this key is not bound to any device")
    assert len(host.hub) == 0


async def test_per_key_and_global_caps_refuse_more_dial_ins() -> None:
    limits = DialInLimits(max_per_key=2, max_connections=3, init_timeout_s=60)
    host = await EndpointHost(limits).start()
    try:
        host.add_key("a", key_id="aaaaaaaaaaaa")
        host.add_key("b", key_id="bbbbbbbbbbbb")
        silent = [
            await RawPipe(host.url("a"), answer_initialize=False).start(),
            await RawPipe(host.url("a"), answer_initialize=False).start(),
        ]
        await wait_for(lambda: host.endpoint.open_count == 2)
        assert await closed_with(host.url("a")) == (
            1013,
            "too many dial-in connections with this key",
        )
        silent.append(await RawPipe(host.url("b"), answer_initialize=False).start())
        await wait_for(lambda: host.endpoint.open_count == 3)
        assert await closed_with(host.url("b")) == (1013, "too many dial-in connections")
        for pipe in silent:
            await pipe.close()
        await wait_for(lambda: host.endpoint.open_count == 0)
        pipe = await RawPipe(host.url("b")).start()  # room again
        await wait_for(lambda: host.hub.get(server_name("bbbbbbbbbbbb")) is not None)
        await pipe.close()
    finally:
        await host.stop()


async def test_a_server_that_never_answers_initialize_is_closed_unregistered(
    host: EndpointHost,
) -> None:
    pipe = await RawPipe(host.url(TOKEN), answer_initialize=False).start()
    assert await pipe.close_info() == (4408, "no answer to initialize in 1 s")
    assert host.hub.get(NAME) is None
    await wait_for(lambda: host.endpoint.open_count == 0)


async def test_an_error_reply_to_initialize_is_closed_unregistered(host: EndpointHost) -> None:
    pipe = await RawPipe(host.url(TOKEN), refuse_initialize=True).start()
    code, reason = await pipe.close_info()
    assert code == 4400
    assert reason.startswith("handshake failed:") and "unsupported protocol version" in reason
    assert host.hub.get(NAME) is None


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (b'{"jsonrpc":"2.0","id":1,"result":{}}', (1003, "binary frame")),
        ("this is not json", (1007, "frame is not a JSON-RPC message")),
        ('{"jsonrpc":"1.0","id":1}', (1007, "frame is not a JSON-RPC message")),
        ("[1, 2, 3]", (1007, "frame is not a JSON-RPC message")),
        (json.dumps({"pad": "x" * 5000}), (1009, "frame larger than 4096 bytes")),
    ],
)
async def test_frames_that_break_the_format_close_the_pipe(
    host: EndpointHost, frame: str | bytes, expected: tuple[int, str]
) -> None:
    async with connect(host.url(TOKEN)) as ws:
        initialize = json.loads(await ws.recv())
        assert initialize["method"] == "initialize"  # the bridge speaks first
        await ws.send(frame)
        with pytest.raises(ConnectionClosed):
            while True:
                await ws.recv()
        code, reason = ws.close_code, ws.close_reason or ""
    assert code == expected[0]
    assert reason.startswith(expected[1])
    assert host.hub.get(NAME) is None


async def test_blank_frames_are_skipped(host: EndpointHost) -> None:
    """Stock pipes relay every stdout line of their server, an empty one too."""
    async with connect(host.url(TOKEN)) as ws:
        initialize = json.loads(await ws.recv())
        await ws.send("\n")
        await ws.send("   ")
        reply = RawPipe(host.url(TOKEN)).reply(initialize)
        await ws.send(json.dumps(reply))
        assert json.loads(await ws.recv())["method"] == "notifications/initialized"
        tools_list = json.loads(await ws.recv())
        assert tools_list["method"] == "tools/list"


async def test_a_second_pipe_with_the_same_key_replaces_the_first(host: EndpointHost) -> None:
    first = await RawPipe(host.url(TOKEN)).start()
    await wait_for(lambda: host.hub.get(NAME) is not None)
    old = host.hub.get(NAME)
    shout = dict(name="shout", description="Shout.", inputSchema={"type": "object"})
    second = await RawPipe(host.url(TOKEN), tools=[shout]).start()
    assert await first.close_info() == (4409, "replaced by a newer connection with the same key")
    await wait_for(lambda: host.hub.get(NAME) is not old and host.hub.get(NAME) is not None)
    server = host.hub.get(NAME)
    assert server is not None
    assert [tool.name for tool in server.tools] == ["shout"]
    assert len(host.hub) == 1
    await second.close()
    await wait_for(lambda: host.hub.get(NAME) is None)


async def test_pipes_of_one_key_racing_leave_exactly_one_registered() -> None:
    host = await EndpointHost(DialInLimits(max_per_key=5)).start()
    try:
        host.add_key(TOKEN)
        pipes = await asyncio.gather(*(RawPipe(host.url(TOKEN)).start() for _ in range(5)))
        await wait_for(lambda: host.endpoint.open_count == 1 and host.hub.get(NAME) is not None)
        replaced = [pipe for pipe in pipes if pipe.closed.done()]
        assert len(replaced) == 4
        for pipe in replaced:
            assert pipe.closed.result() == (4409, REPLACED)
        server = host.hub.get(NAME)
        assert server is not None and server.state is ServerState.READY
        assert (await server.call("echo", {"text": "last"})).content[0]["text"] == "echo: last"
        for pipe in pipes:
            await pipe.close()
    finally:
        await host.stop()


async def test_disconnect_mid_call_fails_the_call_at_once() -> None:
    host = await EndpointHost(DialInLimits(call_timeout_s=600)).start()
    try:
        host.add_key(TOKEN)
        pipe = await RawPipe(host.url(TOKEN), hold_calls=True).start()
        await wait_for(lambda: host.hub.get(NAME) is not None)
        server = host.hub.get(NAME)
        assert server is not None
        call = asyncio.create_task(server.call("echo", {"text": "hi"}))
        await pipe.call_seen.wait()
        await pipe.close()
        with pytest.raises(McpServerError) as failure:
            await call
        assert not isinstance(failure.value, CallTimedOut)
        assert NAME in str(failure.value)
        await wait_for(lambda: host.hub.get(NAME) is None)
    finally:
        await host.stop()


async def test_stock_pipe_relays_a_stdio_server_to_the_endpoint(tmp_path: Path) -> None:
    """`xiaozhi-mcp` (PyPI) is xiaozhi's `mcp_pipe.py` packaged: it relays lines between its
    stdio server and the WebSocket without parsing them, as the stock sample does."""
    # The pipe starts its stdio server (a Python process importing the SDK) and relays our
    # initialize to it: on a loaded machine that takes seconds, so the handshake gets a minute.
    host = await EndpointHost(DialInLimits(init_timeout_s=60)).start()
    host.add_key(TOKEN)
    write_stdio_server(tmp_path)
    env = {
        **os.environ,
        "MCP_ENDPOINT": host.url(TOKEN),
        "MCP_CONFIG": str(tmp_path / "mcp_config.json"),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "xiaozhi_mcp",
        "adder",
        env=env,
        cwd=tmp_path,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_for(lambda: host.hub.get(NAME) is not None or process.returncode is not None)
        server = host.hub.get(NAME)
        assert server is not None, "the pipe did not register"
        assert [tool.name for tool in server.tools] == ["add"]
        result = await server.call("add", {"a": 2, "b": 40})
        assert not result.is_error
        assert result.content == [{"type": "text", "text": "sum=42"}]
        process.terminate()
        await process.wait()
        await wait_for(lambda: host.hub.get(NAME) is None)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await host.stop()


# ---- through the whole bridge -----------------------------------------------------------------


def _key_id(token: str) -> str:
    return token.split("_")[1]


def _dialin_url(bridge: Bridge, token: str) -> str:
    return f"ws://127.0.0.1:{bridge.http_port}/v1/mcp-endpoint/?token={token}"


async def test_a_dialed_in_tool_in_a_bound_devices_chat_turn(
    bridge_factory, fake_llm: FakeLlm, simulated_devices
) -> None:
    bridge: Bridge = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    sim = await simulated_devices(bridge)
    token = await create_key(bridge, "mcp:endpoint", devices=[sim.device_id])
    name = server_name(_key_id(token))
    pipe = await RawPipe(_dialin_url(bridge, token)).start()
    await wait_for(lambda: bridge.mcp_servers.get(name) is not None)
    function = f"{name}__echo"
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=60) as http:
        listed = (await http.get("/api/mcp/servers")).json()
        rows = [row for row in listed["servers"] if row["name"] == name]
        assert [(r["kind"], r["state"], r["bound_device_ids"]) for r in rows] == [
            ("dialin", "ready", [sim.device_id])
        ]
        fake_llm.script(
            "chat", Reply(calls=[FakeCall(function, {"text": "hello"})]), Reply("It echoed.")
        )
        body = {"message": "Echo hello", "device_id": sim.device_id}
        async with http.stream("POST", "/api/chat/stream", json=body) as response:
            assert response.status_code == 200
            events = await sse_events(response)
        completed = [e for e in events if e["type"] == "mcp_tool" and e["status"] == "completed"]
        assert [e["result"] for e in completed] == [[{"type": "text", "text": "echo: hello"}]]
        assert pipe.calls == [{"name": "echo", "arguments": {"text": "hello"}}]
        audit = (await http.get("/api/audit", params={"device_id": f"mcp:{name}"})).json()
        assert [(r["tool"], r["outcome"]) for r in audit["entries"]] == [("echo", "ok")]

        # A turn without the device is not offered the tool: the server is bound to it.
        fake_llm.script("chat", Reply("No tools."))
        async with http.stream("POST", "/api/chat/stream", json={"message": "Hi"}) as response:
            await sse_events(response)
        offered = [t["function"]["name"] for t in fake_llm.of_kind("chat")[-1].tools or []]
        assert function not in offered

        await pipe.close()
        await wait_for(lambda: bridge.mcp_servers.get(name) is None)
        listed = (await http.get("/api/mcp/servers")).json()
        assert name not in [row["name"] for row in listed["servers"]]


async def test_the_bridge_checks_real_keys(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory()
    chat = await create_key(bridge, "chat:use", "devices:call")
    dial = await create_key(bridge, "mcp:endpoint", devices=["aa:bb:cc:dd:ee:01"])
    assert await closed_with(_dialin_url(bridge, ADMIN_TOKEN)) == (
        4401,
        "invalid or revoked API key",
    )
    assert await closed_with(_dialin_url(bridge, chat)) == (
        4403,
        "this key lacks the scope mcp:endpoint",
    )
    pipe = await RawPipe(_dialin_url(bridge, dial)).start()
    name = server_name(_key_id(dial))
    await wait_for(lambda: bridge.mcp_servers.get(name) is not None)
    await pipe.close()
    await bridge.frontends.keys.revoke(_key_id(dial))
    assert await closed_with(_dialin_url(bridge, dial)) == (4401, "invalid or revoked API key")


async def test_a_rude_pipe_does_not_disturb_its_calls(host: EndpointHost) -> None:
    pipe = await RawPipe(host.url(TOKEN)).start()
    await wait_for(lambda: host.hub.get(NAME) is not None)
    server = host.hub.get(NAME)
    assert server is not None and pipe.ws is not None
    rude = [
        {"jsonrpc": "2.0", "id": "s1", "method": "sampling/createMessage", "params": {}},
        {"jsonrpc": "2.0", "id": "r1", "method": "roots/list"},
        {"jsonrpc": "2.0", "id": 999, "result": {}},  # a reply to nothing
        *(
            {"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info"}}
            for _ in range(300)
        ),
    ]
    for message in rude:
        await pipe.ws.send(json.dumps(message))
    shout = {"name": "shout", "description": "Shout.", "inputSchema": {"type": "object"}}
    pipe.tools = [shout]
    await pipe.ws.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}))
    await wait_for(lambda: [tool.name for tool in server.tools] == ["shout"])
    pipe.tools = [shout, {**shout, "name": "echo"}]
    await pipe.ws.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}))
    await wait_for(lambda: len(server.tools) == 2)
    result = await server.call("echo", {"text": "still here"})
    assert result.content == [{"type": "text", "text": "echo: still here"}]
    await pipe.close()


async def test_a_risky_dialed_in_tool_waits_for_a_yes_and_the_cli_lists_it(
    bridge_factory, fake_llm: FakeLlm, simulated_devices
) -> None:
    bridge: Bridge = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    sim = await simulated_devices(bridge)
    token = await create_key(bridge, "mcp:endpoint", devices=[sim.device_id])
    name = server_name(_key_id(token))
    wipe = {
        "name": "wipe",
        "description": "Wipe the notes.",
        "inputSchema": {"type": "object"},
        "annotations": {"destructiveHint": True},
    }
    pipe = await RawPipe(_dialin_url(bridge, token), tools=[wipe]).start()
    await wait_for(lambda: bridge.mcp_servers.get(name) is not None)

    code, out, err = await run_cli(
        "mcp", "servers", "--server", bridge.api_url, "--token", ADMIN_TOKEN
    )
    assert code == 0, err
    assert name in out and "dialin" in out and "wipe (risky)" in out

    fake_llm.script("chat", Reply(calls=[FakeCall(f"{name}__wipe", {})]), Reply("Asked."))
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {"message": "Wipe my notes", "device_id": sim.device_id}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=60) as http:
        async with http.stream("POST", "/api/chat/stream", json=body) as response:
            first = [e for e in await sse_events(response) if e["type"] == "mcp_tool"]
        assert first[-1]["status"] == "error" and "not run yet" in first[-1]["error"]
        assert pipe.calls == []
        body = {"message": "yes", "device_id": sim.device_id}
        async with http.stream("POST", "/api/chat/stream", json=body) as response:
            second = [e for e in await sse_events(response) if e["type"] == "mcp_tool"]
    assert second[-1]["status"] == "completed"
    assert pipe.calls == [{"name": "wipe", "arguments": {}}]
    await pipe.close()


async def test_the_bridge_caps_frames_and_closes_dial_ins_when_it_stops(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(mcp_endpoint_max_frame_bytes=1024)
    token = await create_key(bridge, "mcp:endpoint", devices=["aa:bb:cc:dd:ee:01"])
    async with connect(_dialin_url(bridge, token), max_size=None) as ws:
        assert json.loads(await ws.recv())["method"] == "initialize"
        await ws.send(json.dumps({"pad": "x" * 2000}))
        with pytest.raises(ConnectionClosed):
            while True:
                await ws.recv()
        assert ws.close_code == 1009
    pipe = await RawPipe(_dialin_url(bridge, token)).start()
    await wait_for(lambda: bridge.mcp_servers.get(server_name(_key_id(token))) is not None)
    await bridge.stop()
    assert await pipe.close_info() == (1001, "bridge shutting down")


async def test_an_api_key_needs_the_servers_scope_for_dialed_in_tools(
    bridge_factory, fake_llm: FakeLlm, simulated_devices
) -> None:
    bridge: Bridge = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    sim = await simulated_devices(bridge)
    token = await create_key(bridge, "mcp:endpoint", devices=[sim.device_id])
    name = server_name(_key_id(token))
    pipe = await RawPipe(_dialin_url(bridge, token)).start()
    await wait_for(lambda: bridge.mcp_servers.get(name) is not None)
    offered: dict[str, list[str]] = {}
    for scopes in (("chat:use", "devices:call"), ("chat:use", "devices:call", f"mcp:{name}")):
        chat_key = await create_key(bridge, *scopes)
        fake_llm.script("chat", Reply("Fine."))
        headers = {"Authorization": f"Bearer {chat_key}"}
        body = {"message": "Echo something", "device_id": sim.device_id}
        async with (
            httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=60) as http,
            http.stream("POST", "/api/chat/stream", json=body) as response,
        ):
            assert response.status_code == 200
            await sse_events(response)
        tools = fake_llm.of_kind("chat")[-1].tools or []
        offered[scopes[-1]] = [tool["function"]["name"] for tool in tools]
    assert f"{name}__echo" not in offered["devices:call"]
    assert f"{name}__echo" in offered[f"mcp:{name}"]
    await pipe.close()


async def test_the_key_in_the_url_never_reaches_the_log(
    host: EndpointHost, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    pipe = await RawPipe(host.url(TOKEN)).start()
    await wait_for(lambda: host.hub.get(NAME) is not None)
    await pipe.close()
    assert await closed_with(host.url("esk_0123456789ab_wrong")) == (4401, INVALID)
    assert "/v1/mcp-endpoint/?token=***" in caplog.text  # uvicorn logs the path and its query
    assert TOKEN not in caplog.text and "esk_0123456789ab_wrong" not in caplog.text


async def test_a_bound_devices_own_text_turn_uses_the_dialed_in_tool(
    bridge_factory, fake_llm: FakeLlm
) -> None:
    bridge: Bridge = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    mine, other = "02:00:00:00:00:0a", "02:00:00:00:00:0b"
    token = await create_key(bridge, "mcp:endpoint", devices=[mine])
    name = server_name(_key_id(token))
    pipe = await RawPipe(_dialin_url(bridge, token)).start()
    await wait_for(lambda: bridge.mcp_servers.get(name) is not None)
    devices = [WireDevice(bridge.ws_url, DEVICE_TOKEN, device_id) for device_id in (mine, other)]
    offered: list[list[str]] = []
    try:
        for device in devices:
            await device.connect()
            await bridge.registry.wait_for_state(device.device_id)
        fake_llm.script(
            "chat", Reply(calls=[FakeCall(f"{name}__echo", {"text": "lamp"})]), Reply("Echoed.")
        )
        for device in devices:
            # What the stock firmware sends for typed text.
            text = {"session_id": device.session_id, "type": "listen", "state": "detect"}
            await device.send({**text, "text": "Echo lamp"})
            await device.wait_for_count(lambda d=device: _tts_stops(d), 1)
            tools = fake_llm.of_kind("chat")[-1 if device is devices[1] else 0].tools or []
            offered.append([tool["function"]["name"] for tool in tools])
    finally:
        for device in devices:
            await device.close()
        await pipe.close()
    assert f"{name}__echo" in offered[0]
    assert f"{name}__echo" not in offered[1]
    assert pipe.calls == [{"name": "echo", "arguments": {"text": "lamp"}}]


def _tts_stops(device: WireDevice) -> int:
    return sum(1 for m in device.messages if m.get("type") == "tts" and m["state"] == "stop")
