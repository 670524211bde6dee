"""`esp32-bridge serve` as a real process: token files, runtime file, graceful SIGTERM/SIGINT,
one bridge per data directory, start-up errors that say what to change."""

import asyncio
import json
import os
import signal
import socket
import stat
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from backend.runtime import read_runtime_file, remove_runtime_file, write_runtime_file
from testkit.stock_device import CLIENT_ID, WireDevice, hang_and_signal
from tests.helpers import can_bind, eventually, run_cli, start_cli


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


# ---- one bridge per data directory; errors that name what to change --------------------------


async def test_a_second_bridge_on_the_data_dir_fails_at_once_and_leaves_the_first_alone(tmp_path):
    data_dir = tmp_path / "data"
    first = await start_serve(data_dir)
    runtime = json.loads((data_dir / "bridge.json").read_text())
    assert runtime["pid"] == first.pid
    ports = ["--ws-port", "0", "--http-port", "0", "--device-http-port", "0"]
    for command in ("serve", "demo"):
        code, out, err = await run_cli(command, "--data-dir", str(data_dir), *ports)
        assert code == 1, out + err
        (line,) = err.strip().splitlines()
        assert str(data_dir) in line and f"pid {first.pid}" in line and "--data-dir" in line
        # The first bridge keeps its runtime file (the CLI still finds it) and keeps serving.
        assert json.loads((data_dir / "bridge.json").read_text()) == runtime
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(runtime["api_url"] + "/healthz")).status_code == 200

    # A bridge that died without cleaning up leaves no lock behind (the kernel drops it).
    first.kill()
    await first.wait()
    second = await start_cli("serve", data_dir)
    await eventually(
        lambda: (read_runtime_file(data_dir) or {}).get("pid") == second.pid, timeout_s=30
    )
    second.send_signal(signal.SIGTERM)
    await asyncio.wait_for(second.communicate(), 15)
    assert second.returncode == 0


def test_a_runtime_file_of_another_process_is_not_removed(tmp_path):
    write_runtime_file(tmp_path, {"api_url": "http://127.0.0.1:1"})
    (tmp_path / "bridge.json").write_text(json.dumps({"pid": os.getpid() + 1}))
    remove_runtime_file(tmp_path)
    assert (tmp_path / "bridge.json").exists()
    write_runtime_file(tmp_path, {"api_url": "http://127.0.0.1:1"})
    remove_runtime_file(tmp_path)
    assert not (tmp_path / "bridge.json").exists()


@pytest.mark.parametrize(
    ("flag", "host"),
    [("--ws-port", "0.0.0.0"), ("--http-port", "127.0.0.1"), ("--device-http-port", "0.0.0.0")],
)
async def test_a_port_in_use_names_the_address_and_the_flag(tmp_path, flag, host):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--ws-port": "0", "--http-port": "0", "--device-http-port": "0", flag: str(port)}
        args = [item for pair in ports.items() for item in pair]
        code, out, err = await run_cli("serve", "--data-dir", str(tmp_path / "data"), *args)
    assert code == 1, out + err
    error = err.strip().splitlines()[-1]
    assert f"{host}:{port}" in error and "address already in use" in error
    assert flag in error and "Errno" not in error
    assert not (tmp_path / "data" / "bridge.json").exists()


async def test_an_unusable_data_dir_says_data_directory(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    code, _, err = await run_cli("serve", "--data-dir", str(not_a_dir))
    assert code == 1
    (line,) = err.strip().splitlines()
    assert f"data directory {not_a_dir}: not a directory" in line and "--data-dir" in line

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "firmware").write_text("")  # where the bridge keeps published firmware
    ports = ["--ws-port", "0", "--http-port", "0", "--device-http-port", "0"]
    code, _, err = await run_cli("serve", "--data-dir", str(data_dir), *ports)
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: data directory {data_dir}: {data_dir / 'firmware'}: ")
    assert "Errno" not in line


async def test_an_admin_token_path_without_a_token_stops_serve(tmp_path):
    """An admin.token that is a directory (or an empty file) used to leave the bridge serving
    with a token kept only in memory, which no CLI command could ever find."""
    ports = ["--ws-port", "0", "--http-port", "0", "--device-http-port", "0"]
    for name, make in (("as-dir", Path.mkdir), ("empty", Path.touch)):
        data_dir = tmp_path / name
        data_dir.mkdir()
        make(data_dir / "admin.token")
        code, out, err = await run_cli("serve", "--data-dir", str(data_dir), *ports)
        assert code == 1, out + err
        line = err.strip().splitlines()[-1]
        token_path = data_dir / "admin.token"
        assert line == (
            f"error: data directory {data_dir}: {token_path}: exists but holds no token "
            "(use another one with --data-dir or BRIDGE_DATA_DIR)"
        )
        assert not (data_dir / "bridge.json").exists()


async def test_serve_prints_addresses_a_device_can_use(tmp_path):
    """Bound to every interface, the device URLs name this machine's network addresses (the
    loopback URL only works on the bridge's own machine)."""
    data_dir = tmp_path / "data"
    process = await start_serve(data_dir)
    runtime = json.loads((data_dir / "bridge.json").read_text())
    line = ""
    async with asyncio.timeout(10):
        while not line.startswith("bridge ready:"):
            line = (await process.stdout.readline()).decode()
    ws_port = urlsplit(runtime["ws_url"]).port
    ota_port = urlsplit(runtime["ota_url"]).port
    hosts = [
        address.address
        for addresses in psutil.net_if_addrs().values()
        for address in addresses
        if address.family == socket.AF_INET and not address.address.startswith(("127.", "169.254."))
    ]
    if not hosts:  # a machine without a network: the line says so
        assert "no network address found" in line
        hosts = ["127.0.0.1"]
    for host in hosts:
        assert f"ws://{host}:{ws_port}/xiaozhi/v1/" in line
        assert f"http://{host}:{ota_port}/xiaozhi/ota/" in line
    assert f"admin API at {runtime['api_url']}" in line
    if hosts != ["127.0.0.1"]:
        assert "ws://127.0.0.1" not in line
    process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(process.communicate(), 15)


@pytest.mark.skipif(not can_bind("::1"), reason="no IPv6 loopback here")
async def test_an_ipv6_admin_listener_writes_a_url_the_cli_can_use(tmp_path):
    """`http_host = "::1"` wrote `http://::1:PORT` into bridge.json, which httpx cannot parse:
    every CLI command then died with a traceback."""
    data_dir = tmp_path / "data"
    process = await start_cli("serve", data_dir, {"BRIDGE_HTTP_HOST": "::1"})
    await eventually(lambda: (data_dir / "bridge.json").exists(), timeout_s=30)
    runtime = json.loads((data_dir / "bridge.json").read_text())
    assert urlsplit(runtime["api_url"]).hostname == "::1"
    assert runtime["api_url"].startswith("http://[::1]:")
    code, out, err = await run_cli("devices", "--json", "--data-dir", str(data_dir))
    assert code == 0, err
    assert json.loads(out) == []
    process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(process.communicate(), 15)


async def test_a_server_url_that_is_not_a_url_is_one_line(tmp_path):
    code, _, err = await run_cli("devices", "--server", "http://::1:8080", "--token", "x")
    assert code != 0
    (line,) = err.strip().splitlines()
    assert "is not valid" in line and "Traceback" not in err


async def test_a_lock_file_symlink_is_refused_and_its_target_left_alone(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    (data_dir / "bridge.lock").symlink_to(precious)
    ports = ["--ws-port", "0", "--http-port", "0", "--device-http-port", "0"]
    code, out, err = await run_cli("serve", "--data-dir", str(data_dir), *ports)
    assert code == 1, out + err
    assert err.strip().splitlines()[-1].startswith(f"error: data directory {data_dir}")
    assert precious.read_text() == "keep me\n"
