"""The audit log holds every device tool call, refused ones too: who, which device and tool, the
arguments' SHA-256, outcome, duration; readable through the admin API and `esp32-bridge
audit`, and kept across a restart."""

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.auth import Tokens
from backend.chat import DeviceToolBox
from backend.devices import DeviceRegistry
from backend.devices.audit import AUDIT_MIGRATIONS, AuditLog
from backend.devices.state import DeviceEvent, EventKind
from backend.server import Bridge
from backend.storage import Database, DatabaseError
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN, make_settings
from testkit.stock_device import WireDevice, stock_tools
from tests.helpers import create_key, eventually, run_cli, wait_state
from tests.storage_helpers import database_target

__all__ = ["database_target"]  # the fixture: the store test runs on SQLite and PostgreSQL

VOLUME = "self.audio_speaker.set_volume"


def digest(arguments: dict[str, Any]) -> str:
    canonical = json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def count_calls(registry: DeviceRegistry) -> list[DeviceEvent]:
    seen: list[DeviceEvent] = []
    registry.subscribe(
        lambda event: seen.append(event) if event.kind is EventKind.TOOL_CALLED else None
    )
    return seen


async def test_every_call_of_a_run_is_in_the_audit_log(tmp_path: Any) -> None:
    settings = make_settings(tmp_path / "data")
    async with Bridge(settings, Tokens(ADMIN_TOKEN, DEVICE_TOKEN)) as bridge:
        seen = count_calls(bridge.registry)
        device = WireDevice(bridge.ws_url, DEVICE_TOKEN, tools=stock_tools())
        await device.connect()
        await wait_state(bridge, device.device_id)
        key = await create_key(bridge, "devices:call")
        key_id = key.split("_")[1]
        base = f"/api/devices/{device.device_id}/tools/call"
        admin_headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(base_url=bridge.api_url, headers=admin_headers) as api:
            assert (
                await api.post(base, json={"name": VOLUME, "arguments": {"volume": 7}})
            ).is_success
            assert (
                await api.post(base, json={"name": VOLUME, "arguments": {"volume": 700}})
            ).status_code == 422
            assert (await api.post(base, json={"name": "self.reboot"})).status_code == 428
            assert (await api.post(base, json={"name": "self.reboot", "confirm": True})).is_success
            assert (await api.post(base, json={"name": "self.nope"})).status_code == 404
            as_key = {"Authorization": f"Bearer {key}"}
            body = {"name": VOLUME, "arguments": {"volume": 8}}
            assert (await api.post(base, json=body, headers=as_key)).is_success
        box = DeviceToolBox(bridge.registry.require(device.device_id), actor="chat:test")
        outcome = await box.call("self_audio_speaker_set_volume", {"volume": 9})
        assert not outcome.failed

        async with httpx.AsyncClient(base_url=bridge.api_url, headers=admin_headers) as api:
            entries = (await api.get("/api/audit", params={"limit": 100})).json()["entries"]
        assert len(entries) == len(seen) == 7
        rows = [(e["actor"], e["tool"], e["outcome"], e["error"], e["confirmed"]) for e in entries]
        assert rows == [  # newest first
            ("chat:test", VOLUME, "ok", None, False),
            (f"key:{key_id}", VOLUME, "ok", None, False),
            ("admin", "self.nope", "refused", "UnknownTool", False),
            ("admin", "self.reboot", "ok", None, True),
            ("admin", "self.reboot", "refused", "ConfirmationRequired", False),
            ("admin", VOLUME, "refused", "InvalidArguments", False),
            ("admin", VOLUME, "ok", None, False),
        ]
        assert entries[-1]["arguments_sha256"] == digest({"volume": 7})
        assert entries[0]["arguments_sha256"] == digest({"volume": 9})
        assert all(e["device_id"] == device.device_id for e in entries)
        assert all(e["duration_ms"] >= 0 for e in entries)
        # Arguments are kept as a digest only (a timestamp may well contain "700": no substring).
        assert entries[-2]["arguments_sha256"] == digest({"volume": 700})
        assert all("arguments" not in e and 700 not in e.values() for e in entries)

        code, out, err = await run_cli(
            "audit", "--device", device.device_id, "--tool", "self.reboot",
            "--server", bridge.api_url, "--token", ADMIN_TOKEN,
        )  # fmt: skip
        assert code == 0, err
        assert out.count("self.reboot") == 2 and "confirmed" in out and VOLUME not in out
        await device.close()

    async with Bridge(settings, Tokens(ADMIN_TOKEN, DEVICE_TOKEN)) as bridge:
        kept = await bridge.audit.entries(limit=100)
        assert len(kept) == 7


async def test_audit_pages_and_filters(bridge: Bridge, api: httpx.AsyncClient) -> None:
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN)
    await device.connect()
    await wait_state(bridge, device.device_id)
    for volume in range(5):
        body = {"name": VOLUME, "arguments": {"volume": volume}}
        assert (await api.post(f"/api/devices/{device.device_id}/tools/call", json=body)).is_success
    first = (await api.get("/api/audit", params={"limit": 3})).json()
    assert len(first["entries"]) == 3 and first["next_before"] == first["entries"][-1]["id"]
    rest = (await api.get("/api/audit", params={"limit": 3, "before": first["next_before"]})).json()
    assert len(rest["entries"]) == 2 and rest["next_before"] is None
    assert (await api.get("/api/audit", params={"actor": "key:none"})).json()["entries"] == []
    await device.close()


async def test_calls_refused_before_they_reach_a_device_are_audited(
    bridge: Bridge, api: httpx.AsyncClient
) -> None:
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN)
    await device.connect()
    await wait_state(bridge, device.device_id)
    reader = await create_key(bridge, "devices:read")  # may list, may not call
    body = {"name": VOLUME, "arguments": {"volume": 5}}
    url = f"/api/devices/{device.device_id}/tools/call"
    assert (
        await api.post("/api/devices/ff:ff:ff:ff:ff:ff/tools/call", json=body)
    ).status_code == 404
    as_reader = {"Authorization": f"Bearer {reader}"}
    assert (await api.post(url, json=body, headers=as_reader)).status_code == 403
    await device.close()
    await eventually(lambda: bridge.registry.get(device.device_id) is None)
    assert (await api.post(url, json=body)).status_code == 503

    entries = (await api.get("/api/audit", params={"limit": 10})).json()["entries"]
    rows = [(e["device_id"], e["tool"], e["outcome"], e["error"]) for e in entries]
    assert rows == [  # newest first; the 403 was refused before its body was read
        (device.device_id, VOLUME, "refused", "DeviceOffline"),
        (device.device_id, "", "refused", "MissingScope"),
        ("ff:ff:ff:ff:ff:ff", VOLUME, "refused", "UnknownDevice"),
    ]
    assert entries[1]["actor"] == f"key:{reader.split('_')[1]}"
    assert entries[0]["arguments_sha256"] == digest({"volume": 5})


async def test_rows_a_failed_write_kept_are_written_later_as_digests_only(
    database_target: Path | str,
) -> None:
    registry = DeviceRegistry()
    database = Database(database_target, AUDIT_MIGRATIONS)
    await database.open()
    audit = AuditLog(database, registry, flush_interval_s=3600)
    audit.start()
    arguments = {"volume": 70, "note": "private words"}
    try:
        await database.execute("ALTER TABLE audit_log RENAME TO audit_log_away")
        registry.emit(
            EventKind.TOOL_CALLED, "a4:cf:00:00:00:01", tool=VOLUME, outcome="ok",
            duration_ms=1.5, actor="admin", arguments=arguments, confirmed=False, error=None,
        )  # fmt: skip
        with pytest.raises(DatabaseError, match=r"no such table|does not exist"):
            await audit.flush()
        assert audit.written == 0
        await database.execute("ALTER TABLE audit_log_away RENAME TO audit_log")
        entries = await audit.entries()
        assert [(e.tool, e.arguments_sha256) for e in entries] == [(VOLUME, digest(arguments))]
        rows = await database.fetchall("SELECT * FROM audit_log")
        assert not any("private" in str(value) for row in rows for value in tuple(row))
    finally:
        await audit.stop()
        await database.close()
