"""Dialed-in tools on `/mcp`: a real bridge on loopback, a real MCP server dialed in through a pipe
(the stock `xiaozhi-mcp` relaying an SDK stdio server, or the raw JSON-RPC pipe of
tests/dialin_helpers.py), and the official SDK client (`ClientSession` over Streamable HTTP) on
`/mcp`: listing, calling, scopes (`mcp:dialin`, `mcp:dialin-<key id>`), confirmation, audit,
bounds, the server leaving, hostile names, arguments and results."""

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from mcp import types
from mcp.shared.exceptions import MCPError

from backend.keys import Principal, Scope
from backend.keys.store import parse_scopes
from backend.mcp_dialin.endpoint import DialInLimits, server_name
from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN
from tests.dialin_helpers import ECHO_TOOL, RawPipe, wait_for, write_stdio_server
from tests.helpers import create_key, run_cli
from tests.mcp_helpers import mcp_session

LENT_TO = "aa:bb:cc:dd:ee:01"  # the device the dial-in key is bound to (it need not be connected)
WIPE = {
    "name": "wipe",
    "description": "Wipe the notes.",
    "inputSchema": {"type": "object"},
    "annotations": {"destructiveHint": True},
}
DUMP = {"name": "dump", "description": "A lot of text.", "inputSchema": {"type": "object"}}
SLOW = {"name": "slow", "description": "Never answers.", "inputSchema": {"type": "object"}}
BIG = 200_000


class HostilePipe(RawPipe):
    """The raw pipe, plus `dump` (a result far over the cap) and `slow` (no answer at all)."""

    def reply(self, message: dict[str, Any]) -> dict[str, Any] | None:
        if message.get("method") == "tools/call" and message["params"]["name"] in ("dump", "slow"):
            self.calls.append(message["params"])
            if message["params"]["name"] == "slow":
                return None
            text = {"type": "text", "text": "x" * BIG}
            return {"jsonrpc": "2.0", "id": message["id"], "result": {"content": [text]}}
        return super().reply(message)


def _key_id(token: str) -> str:
    return token.split("_")[1]


def _dialin_url(bridge: Bridge, token: str) -> str:
    return f"ws://127.0.0.1:{bridge.http_port}/v1/mcp-endpoint/?token={token}"


async def _dial_in(bridge: Bridge, pipe_class: type[RawPipe] = RawPipe, **options: Any) -> Any:
    """A key bound to LENT_TO and a raw pipe dialed in with it: (pipe, server name)."""
    token = await create_key(bridge, "mcp:endpoint", devices=[LENT_TO])
    name = server_name(_key_id(token))
    pipe = await pipe_class(_dialin_url(bridge, token), **options).start()
    await wait_for(lambda: bridge.mcp_servers.get(name) is not None)
    return pipe, name


async def _names(token: str, bridge: Bridge) -> list[str]:
    async with mcp_session(bridge, token) as session:
        return [tool.name for tool in (await session.list_tools()).tools]


async def _audit(bridge: Bridge, server: str, count: int) -> list[dict[str, Any]]:
    """The audit rows of `mcp:<server>`, oldest first, once there are `count` (rows are written
    in the background)."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30) as http:
        while True:
            found = await http.get("/api/audit", params={"device_id": f"mcp:{server}"})
            entries = found.json()["entries"]
            if len(entries) >= count:
                return list(reversed(entries))
            await asyncio.sleep(0.05)


async def test_a_stock_pipes_tools_are_listed_called_and_leave_with_it(
    bridge_factory, tmp_path: Path
) -> None:
    """The stock pipe `xiaozhi-mcp` relays an SDK stdio server (`add`): an MCP host with the
    scope `mcp:dialin` lists and calls it on `/mcp`, bad arguments never reach it, every call is
    audited, and when the pipe goes the host is told and the tool is gone."""
    bridge: Bridge = await bridge_factory(mcp_endpoint_init_timeout_s=60)
    dial = await create_key(bridge, "mcp:endpoint", devices=[LENT_TO])
    name = server_name(_key_id(dial))
    write_stdio_server(tmp_path)
    env = {
        **os.environ,
        "MCP_ENDPOINT": _dialin_url(bridge, dial),
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
        stderr=asyncio.subprocess.DEVNULL,
    )
    notices: list[Any] = []
    changed = anyio.Event()

    def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            notices.append(message)
            changed.set()

    host = await create_key(bridge, "mcp:dialin")
    try:
        await wait_for(
            lambda: bridge.mcp_servers.get(name) is not None or process.returncode is not None
        )
        assert bridge.mcp_servers.get(name) is not None, "the pipe did not register"
        add = f"{name}__add"
        async with mcp_session(bridge, host, on_message) as session:
            tools = {tool.name: tool for tool in (await session.list_tools()).tools}
            assert list(tools) == [add]  # no device, search or other tool for this key
            assert tools[add].meta == {
                "esp32-mcp-bridge/server": name,
                "esp32-mcp-bridge/tool": "add",
            }
            assert tools[add].description == f"[MCP server {name}] Add two whole numbers."
            assert tools[add].input_schema["properties"]["a"]["type"] == "integer"

            result = await session.call_tool(add, {"a": 2, "b": 40})
            assert not result.is_error
            assert [block.text for block in result.content] == ["sum=42"]

            wrong = await session.call_tool(add, {"a": "two", "b": 40})
            assert wrong.is_error
            assert wrong.content[0].text.startswith(f"invalid arguments for {name}:add: a: ")

            process.terminate()
            await process.wait()
            with anyio.fail_after(10):
                await changed.wait()
            await wait_for(lambda: bridge.mcp_servers.get(name) is None)
            assert add not in [tool.name for tool in (await session.list_tools()).tools]
            with pytest.raises(MCPError) as gone:
                await session.call_tool(add, {"a": 1, "b": 1})
            assert gone.value.code == types.INVALID_PARAMS
            assert gone.value.message == f"Unknown tool: {add}"
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    audit = await _audit(bridge, name, 2)
    assert [(r["tool"], r["outcome"], r["actor"], r["error"]) for r in audit] == [
        ("add", "ok", f"mcp:key:{_key_id(host)}", None),
        ("add", "refused", f"mcp:key:{_key_id(host)}", "InvalidToolArguments"),
    ]
    assert len(notices) >= 1


async def test_only_keys_with_a_dialin_scope_see_and_call_the_tools(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory()
    pipe, name = await _dial_in(bridge)
    echo = f"{name}__echo"
    every = await create_key(bridge, "mcp:dialin")
    this_one = await create_key(bridge, f"mcp:{name}")
    other_one = await create_key(bridge, "mcp:dialin-0123456789ab")
    plain = await create_key(bridge, "chat:use", "devices:call")
    lent_device = await create_key(bridge, "mcp:dialin", devices=[LENT_TO])
    other_device = await create_key(bridge, "mcp:dialin", devices=["aa:bb:cc:dd:ee:99"])
    for token in (every, this_one, lent_device, ADMIN_TOKEN):
        assert echo in await _names(token, bridge)
    for token in (plain, other_one, other_device):
        assert echo not in await _names(token, bridge)

    async with mcp_session(bridge, this_one) as session:
        result = await session.call_tool(echo, {"text": "hi"})
    assert [block.text for block in result.content] == ["echo: hi"]

    for token in (plain, other_one):
        async with mcp_session(bridge, token) as session:
            # Refused alike for a live tool and a name of nothing: no oracle for keys without it.
            for tool in (echo, "dialin-000000000000__echo"):
                with pytest.raises(MCPError) as refused:
                    await session.call_tool(tool, {"text": "sneaky"})
                assert refused.value.code == -32001
                assert refused.value.message.startswith("this key lacks the scope mcp:dialin")
                assert refused.value.data["required_scope"] == "mcp:dialin"
    async with mcp_session(bridge, other_device) as session:  # the server is lent elsewhere
        with pytest.raises(MCPError) as unknown:
            await session.call_tool(echo, {"text": "sneaky"})
        assert unknown.value.code == types.INVALID_PARAMS
    assert pipe.calls == [{"name": "echo", "arguments": {"text": "hi"}}]

    audit = await _audit(bridge, name, 3)
    assert [(r["outcome"], r["error"]) for r in audit] == [
        ("ok", None),
        ("refused", "MissingScope"),
        ("refused", "MissingScope"),
    ]
    await pipe.close()


async def test_the_scope_is_grantable_from_the_cli(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory()
    code, out, err = await run_cli("keys", "create", "--help")
    assert code == 0, err
    assert "mcp:dialin" in " ".join(out.split())
    code, out, err = await run_cli(
        "keys", "create", "agent", "--scope", "mcp:dialin",
        "--server", bridge.api_url, "--token", ADMIN_TOKEN,
    )  # fmt: skip
    assert code == 0, err
    assert "mcp:dialin" in out
    assert parse_scopes(["mcp:dialin"]) == {Scope.MCP_DIALIN}
    key = Principal("k", "k", frozenset({Scope.MCP_DIALIN}))
    assert key.may_use_server("dialin-0123456789ab", dialin=True)
    assert not key.may_use_server("time")  # a configured server is not a dialed-in one
    assert not key.may_use_server("dialin-0123456789ab")  # ...even when named like one


async def test_a_risky_dialed_in_tool_is_not_run_without_a_confirmation(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory()
    pipe, name = await _dial_in(bridge, tools=[WIPE])
    async with mcp_session(bridge, await create_key(bridge, "mcp:dialin")) as session:
        [tool] = (await session.list_tools()).tools
        assert tool.name == f"{name}__wipe"
        assert tool.annotations is not None and tool.annotations.destructive_hint is True
        result = await session.call_tool(tool.name, {})
    assert result.is_error
    assert result.content[0].text.startswith(f"not run: {name}:wipe needs a confirmation")
    assert pipe.calls == []
    [row] = await _audit(bridge, name, 1)
    assert (row["outcome"], row["error"], row["confirmed"]) == (
        "refused",
        "ServerConfirmationRequired",
        False,
    )
    await pipe.close()


async def test_hostile_names_arguments_and_results(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory()
    # A short call timeout for this bridge's dial-ins (the setting's default is 30 s).
    bridge.mcp_dialin.limits = DialInLimits(call_timeout_s=0.5)
    odd = {**ECHO_TOOL, "name": "say/ü hi", "description": "d" * 5000}
    pipe, name = await _dial_in(bridge, HostilePipe, tools=[ECHO_TOOL, DUMP, SLOW, odd])
    async with mcp_session(bridge, await create_key(bridge, "mcp:dialin")) as session:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        # A name outside the MCP tool-name pattern is dropped (tests/test_mcp_server_bounds.py).
        assert sorted(t.meta["esp32-mcp-bridge/tool"] for t in tools.values()) == [
            "dump",
            "echo",
            "slow",
        ]

        for unknown in (f"{name}__nope", f"{name}__", f"{name}__echo" + "x" * 5000):
            with pytest.raises(MCPError) as caught:
                await session.call_tool(unknown, {})
            assert caught.value.code == types.INVALID_PARAMS
            assert len(caught.value.message) < 300

        for arguments in ({"text": 5}, {}, {"text": ["a"]}):
            wrong = await session.call_tool(f"{name}__echo", arguments)
            assert wrong.is_error and "invalid arguments" in wrong.content[0].text

        dumped = await session.call_tool(f"{name}__dump", {})
        [block] = dumped.content
        assert not dumped.is_error
        assert block.text.endswith("\n[result cut at 65536 bytes]")
        assert len(block.text.encode()) < 65536 + 100

        slow = await session.call_tool(f"{name}__slow", {})
        assert slow.is_error and "gave no answer in 0.5 s" in slow.content[0].text
    assert [call["name"] for call in pipe.calls] == ["dump", "slow"]
    audit = await _audit(bridge, name, 5)
    assert [(r["tool"], r["outcome"]) for r in audit] == [
        *[("echo", "refused")] * 3,
        ("dump", "ok"),
        ("slow", "error"),
    ]
    await pipe.close()
