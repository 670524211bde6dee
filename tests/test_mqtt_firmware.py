"""The real firmware (firmware/main.py, fake HAL) on the MicroPython unix port, over MQTT to a real
Mosquitto started by the test, with the bridge as the broker's other client: tools listed and
called through the admin API with no hello ever sent; killed without goodbye, the device goes
offline through its last will and stays in the catalogue with its tools."""

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from backend.auth import Tokens
from backend.firmware import micropython_lib
from backend.firmware.source import firmware_dir
from backend.firmware.tools import find_tool, micropython_argv, micropython_env
from backend.server import Bridge
from backend.transports.mqtt_credentials import DerivedCredentials
from testkit.mosquitto import Mosquitto, mosquitto_available
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN, make_settings
from tests.helpers import eventually

SECRET = "firmware-mqtt-secret-0123456789abcdef"
DEVICE_ID = "02:aa:bb:cc:dd:01"
WAIT_S = 15.0

pytestmark = [
    pytest.mark.micropython,
    pytest.mark.skipif(find_tool("micropython") is None, reason="no MicroPython unix port"),
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto not installed"),
]


class Firmware:
    """`micropython firmware/main.py config.json` with its output collected line by line."""

    def __init__(self, config: Path) -> None:
        self.config = config
        self.lines: list[str] = []
        self.process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        firmware = firmware_dir()
        self.process = await asyncio.create_subprocess_exec(
            *micropython_argv(firmware / "main.py", str(self.config)),
            env=micropython_env(firmware / "lib", micropython_lib.ensure()),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        self._reader = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        async for raw in self.process.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    async def kill(self) -> None:
        """SIGKILL: no goodbye, no DISCONNECT; the broker publishes the last will."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
            await self.process.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


@contextlib.asynccontextmanager
async def firmware_over_mqtt(tmp_path: Path) -> AsyncIterator[tuple[Bridge, Firmware]]:
    credential = DerivedCredentials(SECRET.encode()).issue(DEVICE_ID)
    mosquitto = Mosquitto(tmp_path / "mosquitto", {credential.username: credential.password})
    await mosquitto.start()
    settings = make_settings(
        tmp_path / "data",
        mqtt_url=mosquitto.bridge_url,
        mqtt_secret=SECRET,
        udp_host="127.0.0.1",
        udp_port=0,
    )
    bridge = Bridge(settings, Tokens(ADMIN_TOKEN, DEVICE_TOKEN))
    config = {
        "transport": "mqtt",
        "hal": "fake",
        "device_id": DEVICE_ID,
        "client_id": "7d0c1a52-3b7e-4d0c-9a51-0b5a2f3c4d5e",
        "reconnect_min_s": 0.2,
        "reconnect_max_s": 1,
        "mqtt": {
            "url": f"mqtt://127.0.0.1:{mosquitto.port}",
            "username": credential.username,
            "password": credential.password,
            "keepalive": 30,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    firmware = Firmware(tmp_path / "config.json")
    try:
        await bridge.start()
        await firmware.start()
        yield bridge, firmware
    finally:
        await firmware.kill()
        print("firmware output:\n" + "\n".join(firmware.lines))
        await bridge.stop()
        await mosquitto.stop()


async def test_firmware_over_mqtt_serves_mcp_without_hello_and_goes_offline_when_killed(
    tmp_path: Path,
) -> None:
    async with firmware_over_mqtt(tmp_path) as (bridge, firmware):
        device = await bridge.registry.wait_for_state(DEVICE_ID, timeout_s=WAIT_S)
        assert device.transport == "mqtt"
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as api:
            tools = (await api.get(f"/api/devices/{DEVICE_ID}/tools")).json()["tools"]
            assert "self.audio_speaker.set_volume" in {tool["name"] for tool in tools}
            response = await api.post(
                f"/api/devices/{DEVICE_ID}/tools/call",
                json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": 37}},
            )
            assert response.status_code == 200, response.text
            assert response.json()["content"][0]["text"] == "true"
            await eventually(lambda: "[hal] volume = 37" in firmware.lines, WAIT_S)
            # MCP ran with no hello: the firmware never opened a conversation.
            assert not any("(udp audio)" in line for line in firmware.lines)

            await firmware.kill()
            await eventually(lambda: bridge.registry.get(DEVICE_ID) is None, WAIT_S)
            listed = (await api.get("/api/devices")).json()["devices"]
            row = next(row for row in listed if row["device_id"] == DEVICE_ID)
            assert row["state"] == "offline" and row["transport"] == "mqtt"
            cached = (await api.get(f"/api/devices/{DEVICE_ID}/tools")).json()
            assert cached["cached"] is True
            assert "self.audio_speaker.set_volume" in {tool["name"] for tool in cached["tools"]}
            response = await api.post(
                f"/api/devices/{DEVICE_ID}/tools/call",
                json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": 1}},
            )
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "device_offline"


async def test_unix_port_aes_ctr_matches_the_bridge(tmp_path: Path) -> None:
    """The firmware's AES-128-CTR on the unix port (ECB keystream: it has no CTR mode) decrypts
    what the bridge's UDP channel encrypts, for a counter that wraps across blocks."""
    from backend.transports.udp_packet import ctr_xor

    key, counter = bytes(range(16)), bytes([1, 0, 0, 0xFF] + [0xFF] * 12)
    data = bytes(range(200))
    script = tmp_path / "ctr.py"
    script.write_text(
        f"from compat import aes_ctr\nprint(aes_ctr({key!r}, {counter!r}, {data!r}).hex())\n"
    )
    process = await asyncio.create_subprocess_exec(
        *micropython_argv(script),
        env=micropython_env(firmware_dir() / "lib"),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0
    assert bytes.fromhex(out.decode().strip()) == ctr_xor(key, counter, data)


def test_deploy_installs_umqtt_with_mip_for_an_mqtt_config(tmp_path: Path) -> None:
    from backend.firmware.deploy import MQTT_PACKAGES
    from backend.firmware.deploy import deploy_command as _deploy_command

    out, config = tmp_path / "build", tmp_path / "config.json"
    port = "/dev/ttyUSB0"
    command = _deploy_command("mpremote", port, out, config, ":", False, True, MQTT_PACKAGES)
    assert command[:6] == ["mpremote", "connect", "/dev/ttyUSB0", "mip", "install", "umqtt.simple"]
    assert command[6] == "+" and command[7:9] == ["cp", "-r"]
    plain = _deploy_command("mpremote", "/dev/ttyUSB0", out, config, ":", False, True)
    assert "mip" not in plain


def test_an_ota_config_may_be_sent_to_mqtt_so_deploy_installs_umqtt() -> None:
    from backend.firmware.device_config import check_device_config, may_use_mqtt
    from backend.firmware.errors import DeviceConfigError

    ota_only = {"ota_url": "http://10.0.0.2:8002/xiaozhi/ota/", "ssid": "lab"}
    check_device_config("c.json", ota_only)
    check_device_config("c.json", {**ota_only, "transport": "mqtt"})  # the login comes by OTA
    assert may_use_mqtt(ota_only) and may_use_mqtt({"transport": "mqtt"})
    assert not may_use_mqtt({"url": "ws://10.0.0.2:8000/x/", "token": "t"})
    bad_url = {**ota_only, "transport": "mqtt", "mqtt": {"url": "ws://h/"}}
    with pytest.raises(DeviceConfigError, match=r'"mqtt\.url": MQTT URL must start'):
        check_device_config("c.json", bad_url)
