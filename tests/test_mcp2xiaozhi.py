"""The MCP endpoint with `mcp2xiaozhi` (PyPI), a stock pipe of the xiaozhi ecosystem.

mcp2xiaozhi 0.2.1 is written for the mcp 1.x SDK and drops every frame under 2.x, which the
bridge needs, so it runs from a venv of its own, `.venv-tools/mcp2xiaozhi/`, that
`scripts/setup --dev` builds from the pins in `tools/mcp2xiaozhi/requirements.txt`. Its stdio
server is written with the 1.x SDK too and runs on that venv's interpreter: an MCP server and a
pipe as a user of the official service would have them, dialing in to a real bridge.
"""

import asyncio
import contextlib
import json
import os
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from backend.mcp_dialin.endpoint import server_name
from backend.server import Bridge
from simulator import SimulatedDevice
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN
from tests.dialin_helpers import wait_for
from tests.helpers import create_key, sse_events

ROOT = Path(__file__).resolve().parent.parent
TOOLS_VENV = ROOT / ".venv-tools" / "mcp2xiaozhi"
PINS = ROOT / "tools" / "mcp2xiaozhi" / "requirements.txt"

# A stdio MCP server for the mcp 1.x SDK (FastMCP; 2.x renamed it MCPServer): one tool, `add`.
STDIO_SERVER_1X = textwrap.dedent(
    """
    from mcp.server.fastmcp import FastMCP

    server = FastMCP("adder")

    @server.tool()
    def add(a: int, b: int) -> str:
        \"\"\"Add two whole numbers.\"\"\"
        return f"sum={a + b}"

    if __name__ == "__main__":
        server.run(transport="stdio")
    """
)


def _tools_python() -> Path:
    """The isolated venv's interpreter; a missing or stale venv fails the test (never a skip)."""
    python = TOOLS_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{TOOLS_VENV} is missing: run scripts/setup --dev to build it")
    stamp = TOOLS_VENV / "pins.txt"
    if not stamp.exists() or stamp.read_bytes() != PINS.read_bytes():
        pytest.fail(f"{TOOLS_VENV} does not match {PINS}: run scripts/setup --dev to rebuild it")
    return python


class Mcp2Xiaozhi:
    """`python -m mcp2xiaozhi --config … run adder` from the isolated venv, endpoint in the env.

    The URL (and its key) goes in `MCP_ENDPOINT`, as its docs say, not in `--endpoint`: argv is
    readable by every user of the machine. Its log goes to a file (a pipe nobody reads fills).
    """

    def __init__(self, folder: Path, endpoint: str) -> None:
        self.folder = folder
        self.endpoint = endpoint
        self.log = folder / "mcp2xiaozhi.log"
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> "Mcp2Xiaozhi":
        python = _tools_python()
        script = self.folder / "adder_server_1x.py"
        script.write_text(STDIO_SERVER_1X)
        server = {"type": "stdio", "command": str(python), "args": [str(script)]}
        config = self.folder / "mcp_config.json"
        config.write_text(json.dumps({"mcpServers": {"adder": server}}))
        # Nothing of the bridge's venv may leak into the 1.x one (it passes its env on to the
        # stdio server).
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MCP_CONFIG"}
            and not key.startswith("MCP_ENDPOINT")
        }
        env["MCP_ENDPOINT"] = self.endpoint
        with self.log.open("wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                str(python),
                "-m",
                "mcp2xiaozhi",
                "--config",
                str(config),
                "run",
                "adder",
                env=env,
                cwd=self.folder,  # it loads a .env from its working directory
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def stop(self) -> None:
        """SIGTERM, which it handles by closing its WebSocket and its server."""
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            await self.process.wait()

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


@pytest.fixture
async def mcp2xiaozhi(tmp_path: Path) -> AsyncIterator[Callable[[str], Awaitable[Mcp2Xiaozhi]]]:
    """Start mcp2xiaozhi pipes to an endpoint URL; all are killed at teardown."""
    started: list[Mcp2Xiaozhi] = []

    async def start(endpoint: str) -> Mcp2Xiaozhi:
        folder = tmp_path / f"pipe{len(started)}"
        folder.mkdir()
        pipe = Mcp2Xiaozhi(folder, endpoint)
        started.append(pipe)
        return await pipe.start()

    yield start
    for pipe in started:
        with contextlib.suppress(ProcessLookupError):
            await pipe.kill()


def _dialin_url(bridge: Bridge, token: str) -> str:
    return f"ws://127.0.0.1:{bridge.http_port}/v1/mcp-endpoint/?token={token}"


async def test_mcp2xiaozhi_lends_its_servers_tool_to_a_bound_devices_chat_turn(
    bridge_factory: Callable[..., Awaitable[Bridge]],
    fake_llm: FakeLlm,
    simulated_devices: Callable[[Bridge], Awaitable[SimulatedDevice]],
    mcp2xiaozhi: Callable[[str], Awaitable[Mcp2Xiaozhi]],
) -> None:
    # mcp2xiaozhi starts its stdio server, a Python process importing the SDK, and relays our
    # initialize to it: on a loaded machine that takes seconds, so the handshake gets a minute.
    bridge = await bridge_factory(
        llm_provider="openai", llm_base_url=fake_llm.url, mcp_endpoint_init_timeout_s=60
    )
    sim = await simulated_devices(bridge)
    token = await create_key(bridge, "mcp:endpoint", devices=[sim.device_id])
    name = server_name(token.split("_")[1])
    pipe = await mcp2xiaozhi(_dialin_url(bridge, token))
    await wait_for(lambda: bridge.mcp_servers.get(name) is not None or not pipe.running)
    assert bridge.mcp_servers.get(name) is not None, (
        f"mcp2xiaozhi did not dial in:\n{pipe.output()}"
    )

    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=60) as http:
        listed = (await http.get("/api/mcp/servers")).json()
        rows = [row for row in listed["servers"] if row["name"] == name]
        assert [(r["kind"], r["state"], r["bound_device_ids"]) for r in rows] == [
            ("dialin", "ready", [sim.device_id])
        ]
        assert [tool["name"] for tool in rows[0]["tools"]] == ["add"]

        function = f"{name}__add"
        fake_llm.script("chat", Reply(calls=[FakeCall(function, {"a": 2, "b": 40})]), Reply("42."))
        body = {"message": "What is 2 + 40?", "device_id": sim.device_id}
        async with http.stream("POST", "/api/chat/stream", json=body) as response:
            assert response.status_code == 200
            events = await sse_events(response)
        tool_events = [e for e in events if e["type"] == "mcp_tool"]
        assert [e["status"] for e in tool_events][-1] == "completed", tool_events
        assert tool_events[-1]["result"] == [{"type": "text", "text": "sum=42"}]
        # The LLM got the result back as the tool's answer.
        follow_up = fake_llm.of_kind("chat")[-1].messages
        assert any("sum=42" in str(m.get("content")) for m in follow_up if m["role"] == "tool")
        audit = (await http.get("/api/audit", params={"device_id": f"mcp:{name}"})).json()
        assert [(r["tool"], r["outcome"]) for r in audit["entries"]] == [("add", "ok")]

        await pipe.stop()
        await wait_for(lambda: bridge.mcp_servers.get(name) is None)
        listed = (await http.get("/api/mcp/servers")).json()
        assert name not in [row["name"] for row in listed["servers"]]


async def test_mcp2xiaozhi_with_a_bad_key_is_refused_and_told_why(
    bridge_factory: Callable[..., Awaitable[Bridge]],
    mcp2xiaozhi: Callable[[str], Awaitable[Mcp2Xiaozhi]],
) -> None:
    bridge = await bridge_factory()
    chat_key = await create_key(bridge, "chat:use")
    unbound = await create_key(bridge, "mcp:endpoint")
    refused = [
        ("esk_0123456789ab_wrong", "4401 (private use) invalid or revoked API key"),
        (ADMIN_TOKEN, "4401 (private use) invalid or revoked API key"),
        (chat_key, "4403 (private use) this key lacks the scope mcp:endpoint"),
        (unbound, "4403 (private use) this key is not bound to any device"),
    ]
    pipes = [(await mcp2xiaozhi(_dialin_url(bridge, token)), why) for token, why in refused]
    for pipe, why in pipes:
        # It logs the close code and reason it got ("received 4401 (private use) …") and
        # retries with backoff, still running; nothing joins the hub meanwhile.
        await wait_for(_logged_or_exited(pipe, f"received {why}"))
        assert pipe.running, pipe.output()
    assert not [server for server in bridge.mcp_servers if server.kind == "dialin"]


def _logged_or_exited(pipe: Mcp2Xiaozhi, text: str) -> Callable[[], bool]:
    return lambda: text in pipe.output() or not pipe.running
