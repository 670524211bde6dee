"""The persistent device catalogue: devices stay listed (offline, with cached tools) after they
disconnect and after a restart; writes are coalesced; a bad database file is one clear error."""

import asyncio
import contextlib
import os
import sqlite3
import subprocess
from pathlib import Path

import httpx
import pytest

from backend.auth import Tokens
from backend.devices import DeviceState
from backend.devices.catalog import DeviceCatalog
from backend.server import Bridge
from backend.storage import Database, DatabaseError
from backend.storage.database import DATABASE_FILE
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN, make_settings
from testkit.stock_device import STATUS_TOOL, VOLUME_TOOL, WireDevice, stock_tools
from tests.helpers import eventually, run_cli
from tests.storage_helpers import bridge_database_url

__all__ = ["bridge_database_url"]  # the fixture: the catalogue's tests run on both engines

TOKENS = Tokens(admin=ADMIN_TOKEN, device=DEVICE_TOKEN)


def new_bridge(data_dir: Path, **overrides: object) -> Bridge:
    return Bridge(make_settings(data_dir, **overrides), TOKENS)


def admin(bridge: Bridge) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30)


async def connect_ready(bridge: Bridge, device: WireDevice) -> None:
    await device.connect()
    await bridge.registry.wait_for_state(device.device_id)


async def test_a_device_seen_before_a_restart_is_listed_offline_with_its_tools(
    tmp_path, bridge_database_url
):
    data_dir = tmp_path / "data"
    async with new_bridge(data_dir, database_url=bridge_database_url) as bridge:
        device = WireDevice(bridge.ws_url, DEVICE_TOKEN, tools=stock_tools())
        await connect_ready(bridge, device)
        await device.close()
        await eventually(lambda: bridge.registry.get(device.device_id) is None)

    restarted_bridge = new_bridge(data_dir, database_url=bridge_database_url)
    async with restarted_bridge as restarted, admin(restarted) as api:
        listing = (await api.get("/api/devices")).json()
        assert [d["device_id"] for d in listing["devices"]] == [device.device_id]
        summary = listing["devices"][0]
        assert summary["state"] == "offline" and summary["connected_at"] is None
        assert summary["last_seen"] and summary["tool_count"] == len(stock_tools())
        assert summary["server_info"] == {"name": "bread-compact-wifi", "version": "2.4.2"}

        tools = (await api.get(f"/api/devices/{device.device_id}/tools")).json()
        assert tools["cached"] is True and tools["state"] == "offline" and tools["read_at"]
        assert [t["name"] for t in tools["tools"]] == [t["name"] for t in stock_tools()]
        model_only = (await api.get(f"/api/devices/{device.device_id}/tools?user=false")).json()
        assert "self.reboot" not in [t["name"] for t in model_only["tools"]]

        call = await api.post(
            f"/api/devices/{device.device_id}/tools/call", json={"name": STATUS_TOOL["name"]}
        )
        assert call.status_code == 503
        assert call.json()["error"]["code"] == "device_offline"
        assert "offline" in call.json()["error"]["message"]

        # Back online: live again, with a live (not cached) tool list.
        again = WireDevice(restarted.ws_url, DEVICE_TOKEN, tools=stock_tools())
        await connect_ready(restarted, again)
        tools = (await api.get(f"/api/devices/{device.device_id}/tools")).json()
        assert tools["cached"] is False and tools["state"] == "ready"
        await again.close()


async def test_cli_lists_offline_devices_and_says_tools_are_cached(tmp_path):
    data_dir = tmp_path / "data"
    async with new_bridge(data_dir) as bridge:
        online = WireDevice(bridge.ws_url, DEVICE_TOKEN, "a4:cf:00:00:00:01")
        offline = WireDevice(bridge.ws_url, DEVICE_TOKEN, "a4:cf:00:00:00:02")
        await connect_ready(bridge, online)
        await connect_ready(bridge, offline)
        await offline.close()
        await eventually(lambda: bridge.registry.get(offline.device_id) is None)
        common = ("--data-dir", str(data_dir), "--token", ADMIN_TOKEN)

        code, out, err = await run_cli("devices", *common)
        assert code == 0, err
        assert online.device_id in out and offline.device_id in out and "offline" in out

        code, out, err = await run_cli("devices", "--online", *common)
        assert code == 0, err
        assert online.device_id in out and offline.device_id not in out

        code, out, err = await run_cli("tools", offline.device_id, *common)
        assert code == 0, err
        assert "offline: cached tools, read at" in out and VOLUME_TOOL["name"] in out

        code, out, err = await run_cli("forget", offline.device_id, *common)
        assert code == 0, err
        code, out, err = await run_cli("tools", offline.device_id, *common)
        assert code == 1 and "unknown device" in err
        await online.close()


async def test_a_changed_tool_list_replaces_the_cached_one(tmp_path, bridge_database_url):
    data_dir = tmp_path / "data"
    async with new_bridge(data_dir, database_url=bridge_database_url) as bridge:
        device = WireDevice(bridge.ws_url, DEVICE_TOKEN, tools=[STATUS_TOOL])
        await connect_ready(bridge, device)
        await device.close()
        await eventually(lambda: bridge.registry.get(device.device_id) is None)
        device = WireDevice(bridge.ws_url, DEVICE_TOKEN, tools=[STATUS_TOOL, VOLUME_TOOL])
        await connect_ready(bridge, device)
        await device.close()
        await eventually(lambda: bridge.registry.get(device.device_id) is None)

    async with new_bridge(data_dir, database_url=bridge_database_url) as restarted:
        record = restarted.registry.require_record(device.device_id)
        assert [tool.name for tool in record.tools.tools] == [
            STATUS_TOOL["name"],
            VOLUME_TOOL["name"],
        ]
    stored = Database(bridge_database_url or data_dir / DATABASE_FILE)
    await stored.open()
    try:
        count = await stored.fetchone("SELECT COUNT(*) FROM tool_lists")
        assert count is not None and count[0] == 1  # the old list is gone
    finally:
        await stored.close()


async def test_forgetting_needs_an_offline_device(bridge, api, wire_devices):
    device = wire_devices()
    await connect_ready(bridge, device)
    live = await api.delete(f"/api/devices/{device.device_id}")
    assert live.status_code == 409 and live.json()["error"]["code"] == "device_online"
    await device.close()
    await eventually(lambda: bridge.registry.get(device.device_id) is None)
    assert (await api.delete(f"/api/devices/{device.device_id}")).status_code == 204
    gone = await api.get(f"/api/devices/{device.device_id}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_device"
    assert (await api.delete(f"/api/devices/{device.device_id}")).status_code == 404


@pytest.mark.slow
async def test_a_reconnect_storm_writes_each_device_at_most_once(tmp_path, bridge_database_url):
    count = 1000
    # The handshakes' deadline of a real deployment, not the tests' 5 s: the 1,000 devices answer
    # from this one process, and under the parallel phase's load some answered too late.
    settings = {
        "database_url": bridge_database_url,
        "hello_timeout_s": 30.0,
        "init_timeout_s": 30.0,
    }
    async with new_bridge(tmp_path / "data", **settings) as bridge:
        ids = [f"a4:cf:00:00:{i // 256:02x}:{i % 256:02x}" for i in range(count)]
        first = [WireDevice(bridge.ws_url, DEVICE_TOKEN, device_id) for device_id in ids]
        await connect_in_waves(first)
        await eventually(lambda: _ready(bridge) == count, timeout_s=60)
        await bridge.catalog.flush()
        written, flushes = bridge.catalog.rows_written, bridge.catalog.flushes
        assert written >= count  # every new device was stored

        # Every device connects again at once: each new link replaces the old one.
        second = [WireDevice(bridge.ws_url, DEVICE_TOKEN, device_id) for device_id in ids]
        await connect_in_waves(second)
        await eventually(lambda: _ready(bridge) == count and _replaced(bridge, second), 60)
        await bridge.catalog.flush()
        assert 0 < bridge.catalog.rows_written - written <= count
        assert bridge.catalog.flushes - flushes < count / 10  # batched, not one per device
        await asyncio.gather(*(device.close() for device in first + second))


async def connect_in_waves(devices: list[WireDevice], wave: int = 200) -> None:
    """Connect in waves of `wave` at once: still a storm for the catalogue's writer (a wave
    lands within one flush interval), but 1,000 opening handshakes at once from one test
    process timed out when the suite's parallel workers loaded both cores."""
    for start in range(0, len(devices), wave):
        await asyncio.gather(*(device.connect() for device in devices[start : start + wave]))


def _replaced(bridge: Bridge, devices: list[WireDevice]) -> bool:
    return all(
        (live := bridge.registry.get(device.device_id)) is not None
        and live.session_id == device.session_id
        for device in devices
    )


def _ready(bridge: Bridge) -> int:
    return sum(device.state is DeviceState.READY for device in bridge.registry)


async def test_a_corrupted_database_is_one_clear_error_at_start(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / DATABASE_FILE).write_bytes(b"this is not a database " * 200)
    with pytest.raises(DatabaseError, match="not a SQLite database"):
        await new_bridge(data_dir).start()

    code, out, err = await run_cli(
        "serve", "--data-dir", str(data_dir), "--ws-port", "0", "--http-port", "0"
    )
    assert code == 1
    assert err.startswith("error:") and err.count("\n") == 1 and "not a SQLite database" in err
    assert "Traceback" not in out + err


async def test_a_read_only_database_is_one_clear_error_at_start(tmp_path):
    data_dir = tmp_path / "data"
    async with new_bridge(data_dir):
        pass
    for leftover in data_dir.glob(f"{DATABASE_FILE}-*"):
        leftover.unlink()
    # chattr +i binds root too, unlike file modes (the suite may run as root).
    if not await asyncio.to_thread(_chattr, "+i", data_dir):
        pytest.skip("chattr +i is not supported here")
    try:
        with pytest.raises(DatabaseError, match=r"read-only|readonly|writable") as refused:
            await new_bridge(data_dir).start()
        assert "\n" not in str(refused.value)
    finally:
        await asyncio.to_thread(_chattr, "-i", data_dir)


async def test_a_read_only_database_file_in_a_writable_folder_is_one_clear_error_at_start(
    tmp_path,
):
    # Every migration applied, nothing to write at start: the bridge must still notice.
    data_dir = tmp_path / "data"
    async with new_bridge(data_dir):
        pass
    database = data_dir / DATABASE_FILE
    immutable = await asyncio.to_thread(_chattr, "+i", database)  # binds root too
    if not immutable:
        if os.geteuid() == 0:  # root writes through file modes
            pytest.skip("running as root without chattr +i: cannot make the file read-only")
        database.chmod(0o444)
    try:
        with pytest.raises(DatabaseError, match=r"read-only|readonly|writable") as refused:
            await new_bridge(data_dir).start()
        assert "\n" not in str(refused.value) and DATABASE_FILE in str(refused.value)

        code, out, err = await run_cli(
            "serve", "--data-dir", str(data_dir), "--ws-port", "0", "--http-port", "0"
        )
        assert code == 1
        assert err.startswith("error:") and err.count("\n") == 1 and "read-only" in err
        assert "Traceback" not in out + err
    finally:
        if immutable:
            await asyncio.to_thread(_chattr, "-i", database)
        else:
            database.chmod(0o644)


def _chattr(flag: str, path: Path) -> bool:
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


async def test_a_database_from_a_newer_bridge_is_refused(tmp_path):
    data_dir = tmp_path / "data"
    async with new_bridge(data_dir):
        pass
    with sqlite3.connect(data_dir / DATABASE_FILE) as db:
        db.execute("INSERT INTO schema_migrations (component, version) VALUES ('devices', 99)")
    with pytest.raises(DatabaseError, match="newer than this bridge knows"):
        await new_bridge(data_dir).start()


async def test_the_heartbeat_stores_last_seen_of_a_device_that_stays_online(tmp_path):
    data_dir = tmp_path / "data"
    bridge = new_bridge(data_dir)
    bridge.catalog = DeviceCatalog(
        bridge.database, bridge.registry, flush_interval_s=0.01, heartbeat_s=0.1
    )
    async with bridge:
        device = WireDevice(bridge.ws_url, DEVICE_TOKEN, tools=stock_tools())
        await connect_ready(bridge, device)
        connected_at = bridge.registry.require_record(device.device_id).last_seen
        catalog = bridge.catalog
        rows, flushes = catalog.rows_written, catalog.flushes

        # What a crash now would leave on disk: read the file, not the bridge's connection.
        path = data_dir / DATABASE_FILE
        async with asyncio.timeout(10):
            while True:
                seen = await asyncio.to_thread(_last_seen, path, device.device_id)
                if seen is not None and seen > connected_at:
                    break
                await asyncio.sleep(0.02)
        live = bridge.registry.get(device.device_id)
        assert live is not None and live.session_id == device.session_id  # never disconnected
        # A heartbeat is at most one row write per device, folded into the flush's batch.
        assert catalog.rows_written - rows <= catalog.flushes - flushes

        # A later row write for another reason keeps the heartbeat's last_seen (no going back).
        bridge.registry.reported(device.device_id, None, {"board_type": "bread-compact-wifi"})
        await catalog.flush()
        stored = await bridge.database.fetchone(
            "SELECT last_seen, ota FROM devices WHERE device_id = ?", (device.device_id,)
        )
        assert stored is not None and stored["ota"] and stored["last_seen"] >= seen
        await device.close()


def _last_seen(path: Path, device_id: str) -> float | None:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        row = db.execute("SELECT last_seen FROM devices WHERE device_id = ?", (device_id,))
        found = row.fetchone()
    return None if found is None else float(found[0])
