"""`esp32-bridge serve` as a real process: token files, runtime file, graceful SIGTERM/SIGINT."""

import asyncio
import json
import signal
import stat
from pathlib import Path

import httpx
import pytest

from tests.helpers import eventually, start_cli
from tests.stock_device import CLIENT_ID, WireDevice, hang_and_signal


async def enrolled_token(runtime: dict, admin: str) -> str:
    """A device's own token, as a stock device gets it: OTA check, approval, OTA check."""
    headers = {"Device-Id": "a4:cf:12:34:56:78", "Client-Id": CLIENT_ID}
    async with httpx.AsyncClient(timeout=10) as http:
        first = await http.post(runtime["ota_url"], json={}, headers=headers)
        code = first.json()["activation"]["code"]
        approved = await http.post(
            runtime["api_url"] + "/api/provisioning/approve",
            json={"target": code},
            headers={"Authorization": f"Bearer {admin}"},
        )
        assert approved.status_code == 200, approved.text
        token: str = (await http.post(runtime["ota_url"], json={}, headers=headers)).json()[
            "websocket"
        ]["token"]
    return token


async def start_serve(data_dir: Path) -> asyncio.subprocess.Process:
    process = await start_cli("serve", data_dir)
    await eventually(lambda: (data_dir / "bridge.json").exists(), timeout_s=30)
    return process


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_signal_stops_gracefully(tmp_path, sig):
    data_dir = tmp_path / "data"
    process = await start_serve(data_dir)
    runtime = json.loads((data_dir / "bridge.json").read_text())
    admin = (data_dir / "admin.token").read_text().strip()
    for name in ("admin.token", "device-credentials.secret"):
        assert stat.S_IMODE((data_dir / name).stat().st_mode) == 0o600
    assert not (data_dir / "device.token").exists()  # per-device tokens by default
    assert runtime["device_auth"] == "device"

    device_token = await enrolled_token(runtime, admin)
    device = WireDevice(runtime["ws_url"], device_token)
    hung = asyncio.Event()
    device.handlers["tools/call"] = hang_and_signal(hung)
    await device.connect()
    async with httpx.AsyncClient(
        base_url=runtime["api_url"], headers={"Authorization": f"Bearer {admin}"}, timeout=30
    ) as api:
        for _ in range(200):
            listing = (await api.get("/api/devices")).json()["devices"]
            if listing and listing[0]["state"] == "ready":
                break
            await asyncio.sleep(0.02)
        pending = asyncio.create_task(
            api.post(
                f"/api/devices/{device.device_id}/tools/call",
                json={"name": "self.get_device_status", "timeout_s": 30},
            )
        )
        await hung.wait()
        process.send_signal(sig)
        response = await pending

    assert response.status_code == 503
    assert "shutting down" in response.json()["error"]["message"]
    await device.ws.wait_closed()
    assert device.ws.close_code == 1001
    out, err = await asyncio.wait_for(process.communicate(), 15)
    assert process.returncode == 0, err.decode()
    assert not (data_dir / "bridge.json").exists()
    logs = err.decode()
    assert admin not in logs + out.decode() and device_token not in logs + out.decode()
    events = [json.loads(line)["event"] for line in logs.splitlines() if line.startswith("{")]
    assert "bridge stopping" in events and "bridge stopped" in events
    assert "created secret file" in out.decode()
