"""End to end: firmware/main.py with the fake HAL under the MicroPython unix port, connected over
a real WebSocket to a real bridge, driven through the admin API; the bridge is killed and
restarted and the device comes back by itself; a wrong token is logged and retried."""

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.server import Bridge
from testkit.ports import reserve_port
from testkit.processes import WatchedProcess
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from tests.firmware_helpers import needs_micropython, running_firmware
from tests.fw.fw_support import MODEL_TOOLS, USER_TOOLS

REPO = Path(__file__).resolve().parents[1]
FIRMWARE = REPO / "firmware"
MAIN = FIRMWARE / "main.py"


def declared_firmware_version() -> str:
    """FIRMWARE_VERSION as main.py declares it; the device reports it as serverInfo.version."""
    match = re.search(r'^FIRMWARE_VERSION = "(.+)"$', MAIN.read_text(), re.M)
    assert match, "no FIRMWARE_VERSION in firmware/main.py"
    return match.group(1)


FIRMWARE_VERSION = declared_firmware_version()
BOARD = "e2e-board"
SET_VOLUME = "self.audio_speaker.set_volume"
ANNOUNCED = re.compile(r"^device (\S+) \(client (\S+)\) -> ws://")
SESSION_READY = re.compile(r"^link: session ([0-9a-f]+) ready$")
REJECTED = re.compile(
    r"^link: connect failed: HandshakeError: rejected: HTTP 401 \(.+\); "
    r"reconnecting in \d+\.\d s$"
)
WAIT_S = 30.0

pytestmark = [
    pytest.mark.micropython,
    needs_micropython,
]


# ---- helpers ------------------------------------------------------------------------------------


def write_config(directory: Path, url: str, token: str) -> Path:
    config = {
        "url": url,
        "token": token,
        "hal": "fake",
        "board_name": BOARD,
        "reconnect_min_s": 0.05,
        "reconnect_max_s": 0.5,
    }
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


async def announced_device_id(firmware: WatchedProcess) -> str:
    """main.py's first line names the Device-Id it derived (no device_id in the config)."""
    await firmware.wait_for(lambda: bool(firmware.lines), "the start-up line")
    match = ANNOUNCED.match(firmware.lines[0])
    assert match, firmware.lines[0]
    return match.group(1)


def sessions(firmware: WatchedProcess) -> list[str]:
    return [m.group(1) for line in firmware.lines if (m := SESSION_READY.match(line))]


async def wait_ready(api: httpx.AsyncClient, device_id: str) -> dict[str, Any]:
    """Poll GET /api/devices/{id} until the bridge reports the device ready."""
    async with asyncio.timeout(WAIT_S):
        while True:
            response = await api.get(f"/api/devices/{device_id}")
            if response.status_code == 200 and response.json()["state"] == "ready":
                return response.json()
            await asyncio.sleep(0.05)


async def call(api: httpx.AsyncClient, device_id: str, name: str, **arguments: Any) -> Any:
    body = {"name": name, "arguments": arguments}
    return await api.post(f"/api/devices/{device_id}/tools/call", json=body)


async def text_of(api: httpx.AsyncClient, device_id: str, name: str, **arguments: Any) -> str:
    """The single text result of a successful call."""
    response = await call(api, device_id, name, **arguments)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["isError"] is False
    [content] = result["content"]
    assert content["type"] == "text"
    return content["text"]


async def status(api: httpx.AsyncClient, device_id: str) -> dict[str, Any]:
    return json.loads(await text_of(api, device_id, "self.get_device_status"))


def admin_client(api_url: str) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return httpx.AsyncClient(base_url=api_url, headers=headers, timeout=WAIT_S)


# ---- against a bridge in this process ---------------------------------------------------------


async def test_firmware_serves_tools_through_the_admin_api(
    bridge: Bridge, api: httpx.AsyncClient, tmp_path: Path
) -> None:
    async with running_firmware(write_config(tmp_path, bridge.ws_url, DEVICE_TOKEN)) as firmware:
        device_id = await announced_device_id(firmware)
        summary = await wait_ready(api, device_id)
        assert [
            device["device_id"] for device in (await api.get("/api/devices")).json()["devices"]
        ] == [device_id]
        assert summary["state"] == "ready"
        assert summary["server_info"] == {"name": BOARD, "version": FIRMWARE_VERSION}
        assert summary["client_id"] == (tmp_path / "client_id").read_text()
        assert summary["transport"] == "websocket"

        await check_tool_lists(api, device_id)
        await check_calls(api, device_id, firmware)
        await check_refusals(bridge, api, device_id, firmware)
    assert "Traceback" not in firmware.output


async def check_tool_lists(api: httpx.AsyncClient, device_id: str) -> None:
    tools = (await api.get(f"/api/devices/{device_id}/tools", params={"user": "true"})).json()[
        "tools"
    ]
    assert [tool["name"] for tool in tools] == MODEL_TOOLS + USER_TOOLS
    by_name = {tool["name"]: tool for tool in tools}
    for name in USER_TOOLS:
        assert by_name[name]["annotations"] == {"audience": ["user"]}
    for name in MODEL_TOOLS:
        assert by_name[name]["annotations"] is None
    assert by_name[SET_VOLUME]["inputSchema"] == {
        "type": "object",
        "properties": {"volume": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["volume"],
    }
    for_the_model = await api.get(f"/api/devices/{device_id}/tools", params={"user": "false"})
    assert [tool["name"] for tool in for_the_model.json()["tools"]] == MODEL_TOOLS


async def check_calls(api: httpx.AsyncClient, device_id: str, firmware: WatchedProcess) -> None:
    assert await text_of(api, device_id, SET_VOLUME, volume=42) == "true"
    await firmware.wait_for_line("[hal] volume = 42")  # main.py prints the fake HAL's changes
    device_status = await status(api, device_id)
    assert device_status["audio_speaker"] == {"volume": 42}
    assert device_status["screen"] == {"brightness": 80, "theme": "light"}

    # Stock: an unknown theme is a `false` result, not an error.
    assert await text_of(api, device_id, "self.screen.set_theme", theme="sepia") == "false"
    assert await text_of(api, device_id, "self.screen.set_theme", theme="dark") == "true"
    await firmware.wait_for_line("[hal] theme = dark")


async def check_refusals(
    bridge: Bridge, api: httpx.AsyncClient, device_id: str, firmware: WatchedProcess
) -> None:
    # Out of range: the bridge checks the device's schema and never sends the call.
    response = await call(api, device_id, SET_VOLUME, volume=101)
    assert response.status_code == 422
    assert response.json()["error"] == {
        "code": "invalid_arguments",
        "message": f"invalid arguments for '{SET_VOLUME}': "
        "volume: 101 is greater than the maximum of 100",
        "type": "invalid_request_error",
        "param": None,
    }
    # Every stock argument error is caught that way. The device's own check answers only when the
    # bridge cannot check: a tool whose schema is not valid JSON Schema is left to the device
    # (backend/devices/validation.py). Give the bridge's copy of the schema such a flaw.
    device = bridge.registry.require(device_id)
    unusable = {"type": "object", "properties": {"volume": {"type": "integer", "maximum": "100"}}}
    flawed = [
        tool.model_copy(update={"input_schema": unusable}) if tool.name == SET_VOLUME else tool
        for tool in device.tool_list()
    ]
    bridge.registry.tools_changed(device, flawed)
    response = await call(api, device_id, SET_VOLUME, volume=101)
    assert response.status_code == 502
    assert response.json()["error"] == {
        "code": "device_error",
        "message": "Value exceeds maximum allowed: 100",  # the stock firmware's text
        "type": "server_error",
        "param": None,
    }
    assert (await status(api, device_id))["audio_speaker"] == {"volume": 42}
    assert not any("volume = 101" in line for line in firmware.lines)


async def test_wrong_token_is_logged_in_one_line_and_retried(
    bridge: Bridge, tmp_path: Path
) -> None:
    config = write_config(tmp_path, bridge.ws_url, "not-the-device-token")
    async with running_firmware(config) as firmware:
        await firmware.wait_for(
            lambda: sum("HTTP 401" in line for line in firmware.lines) >= 3, "three rejections"
        )
        assert firmware.running
        assert len(bridge.registry) == 0
    # After the start-up line, each attempt printed exactly one line: the rejection.
    startup, *attempts = firmware.lines
    assert ANNOUNCED.match(startup)
    assert len(attempts) >= 3
    for line in attempts:
        assert REJECTED.match(line), line


# ---- against a bridge process that is killed and restarted ------------------------------------


class BridgeProcess:
    """`python -m backend.cli serve` on fixed ports, so a restart listens where the device dials."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        # Reserved while this object lives: no parallel test takes them between restarts.
        self.ws_port, self.http_port = reserve_port(self), reserve_port(self)
        self.runs: list[WatchedProcess] = []

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.ws_port}/xiaozhi/v1/"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    async def start(self) -> WatchedProcess:
        command = [sys.executable, "-m", "backend.cli", "serve", "--data-dir", str(self.data_dir)]
        command += ["--ws-port", str(self.ws_port), "--http-port", str(self.http_port)]
        env = {
            **os.environ,
            "BRIDGE_WS_HOST": "127.0.0.1",
            "BRIDGE_ADMIN_TOKEN": ADMIN_TOKEN,
            "BRIDGE_DEVICE_TOKEN": DEVICE_TOKEN,
            "BRIDGE_DEVICE_AUTH": "shared",  # this test is about reconnecting, not enrolment
            "BRIDGE_DEVICE_HTTP_HOST": "127.0.0.1",
            "BRIDGE_DEVICE_HTTP_PORT": "0",
        }
        process = WatchedProcess(command, env, cwd=REPO)
        self.runs.append(process)
        await process.start()
        await process.wait_for(
            lambda: any(line.startswith("bridge ready:") for line in process.lines),
            "the bridge ready",
        )
        return process

    async def kill(self) -> None:
        await self.runs[-1].kill()
        assert self.runs[-1].process is not None
        assert self.runs[-1].process.returncode == -signal.SIGKILL

    async def stop(self) -> None:
        for process in self.runs:
            await process.stop()


@pytest.fixture
async def bridge_process(tmp_path: Path) -> AsyncIterator[BridgeProcess]:
    bridge = BridgeProcess(tmp_path / "bridge")
    try:
        yield bridge
    finally:
        await bridge.stop()
        for number, run in enumerate(bridge.runs, 1):
            print(f"bridge run {number} output:\n{run.output}")


async def test_firmware_reconnects_by_itself_after_the_bridge_is_killed(
    bridge_process: BridgeProcess, tmp_path: Path
) -> None:
    await bridge_process.start()
    config = write_config(tmp_path, bridge_process.ws_url, DEVICE_TOKEN)
    async with running_firmware(config) as firmware:
        device_id = await announced_device_id(firmware)
        async with admin_client(bridge_process.api_url) as api:
            await wait_ready(api, device_id)
            assert await text_of(api, device_id, SET_VOLUME, volume=42) == "true"
        [first_session] = sessions(firmware)

        await bridge_process.kill()  # no close frame: the kernel just drops the sockets
        await firmware.wait_for(
            lambda: any(line.startswith("link: connect failed") for line in firmware.lines),
            "a failed reconnect while the bridge is down",
        )
        restarted = await bridge_process.start()  # same ports

        await firmware.wait_for(lambda: len(sessions(firmware)) == 2, "a second session")
        second_session = sessions(firmware)[1]
        assert second_session != first_session
        await restarted.wait_for(lambda: second_session in restarted.output, "the new session")
        async with admin_client(bridge_process.api_url) as api:
            summary = await wait_ready(api, device_id)
            assert summary["server_info"] == {"name": BOARD, "version": FIRMWARE_VERSION}
            # The same firmware process: its state survived the bridge's restart.
            assert (await status(api, device_id))["audio_speaker"] == {"volume": 42}
            assert await text_of(api, device_id, SET_VOLUME, volume=7) == "true"
            await firmware.wait_for_line("[hal] volume = 7")
        assert firmware.running
    connects = [line for line in firmware.lines if line.startswith("link: connected to")]
    assert len(connects) == 2
    assert "Traceback" not in firmware.output
