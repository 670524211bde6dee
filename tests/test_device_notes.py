"""A device's display name and notes (`PUT /api/devices/{id}/notes`, scope admin): set, changed one
field at a time, cleared, shown in every device row, kept across a restart and dropped when the
device is forgotten; hostile bodies, unknown devices and keys without admin are refused."""

from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.auth import Tokens
from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN, make_settings
from testkit.stock_device import WireDevice, stock_tools
from tests.helpers import create_key, eventually
from tests.storage_helpers import bridge_database_url

__all__ = ["bridge_database_url"]  # the fixture: the restart test runs on both engines

pytestmark = pytest.mark.timeout(120)


def client(bridge: Bridge, token: str | None = ADMIN_TOKEN) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30)


async def seen_device(bridge: Bridge, mac: str = "a4:cf:12:34:56:78") -> WireDevice:
    """A device that connected, became ready and left (so it is remembered, offline)."""
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN, mac, tools=stock_tools())
    await device.connect()
    await bridge.registry.wait_for_state(device.device_id)
    await device.close()
    await eventually(lambda: bridge.registry.get(device.device_id) is None)
    return device


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


async def test_name_and_notes_are_set_shown_and_kept_across_a_restart(
    tmp_path: Path, bridge_database_url: str | None
) -> None:
    settings = make_settings(tmp_path / "data", database_url=bridge_database_url)
    tokens = Tokens(admin=ADMIN_TOKEN, device=DEVICE_TOKEN)
    async with Bridge(settings, tokens) as bridge, client(bridge) as api:
        device = await seen_device(bridge)
        path = f"/api/devices/{device.device_id}"
        assert (await api.get(path)).json()["name"] is None
        notes = "Bếp, trên tủ lạnh.\r\nPin thay tháng 3."
        answer = await api.put(
            f"{path}/notes", json={"name": "  Kitchen   speaker ", "notes": notes}
        )
        assert answer.status_code == 200, answer.text
        row = answer.json()
        assert row["name"] == "Kitchen speaker"  # one line, runs of spaces as one
        assert row["notes"] == "Bếp, trên tủ lạnh.\nPin thay tháng 3."
        assert row["device_id"] == device.device_id and row["state"] == "offline"
        listed = (await api.get("/api/devices")).json()["devices"]
        assert [(d["name"], d["notes"]) for d in listed] == [(row["name"], row["notes"])]
        # One field at a time: the other is kept.
        renamed = (await api.put(f"{path}/notes", json={"name": "Bếp"})).json()
        assert renamed["name"] == "Bếp" and renamed["notes"] == row["notes"]
        # Live again: the live row carries them too.
        again = WireDevice(bridge.ws_url, DEVICE_TOKEN, device.device_id, tools=stock_tools())
        await again.connect()
        await bridge.registry.wait_for_state(device.device_id)
        live = (await api.get(path)).json()
        assert live["state"] == "ready" and live["name"] == "Bếp"
        await again.close()

    async with Bridge(settings, tokens) as restarted, client(restarted) as api:
        kept = (await api.get(path)).json()
        assert kept["name"] == "Bếp" and kept["notes"] == "Bếp, trên tủ lạnh.\nPin thay tháng 3."
        # null and "" clear.
        cleared = (await api.put(f"{path}/notes", json={"name": None, "notes": ""})).json()
        assert cleared["name"] is None and cleared["notes"] is None

    async with Bridge(settings, tokens) as restarted, client(restarted) as api:
        kept = (await api.get(path)).json()
        assert kept["name"] is None and kept["notes"] is None


async def test_a_forgotten_device_loses_its_notes(bridge: Bridge) -> None:
    async with client(bridge) as api:
        device = await seen_device(bridge)
        path = f"/api/devices/{device.device_id}"
        assert (await api.put(f"{path}/notes", json={"name": "Old"})).status_code == 200
        assert (await api.delete(path)).status_code == 204
        assert (await api.get(path)).status_code == 404
        assert (await api.put(f"{path}/notes", json={"name": "x"})).status_code == 404
        await seen_device(bridge)  # seen again: a new record, without the old name
        assert (await api.get(path)).json()["name"] is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"name": 5}, "name", id="name-not-a-string"),
        pytest.param({"notes": ["a"]}, "notes", id="notes-not-a-string"),
        pytest.param({"name": "x" * 65}, "name", id="name-too-long"),
        pytest.param({"notes": "x" * 2001}, "notes", id="notes-too-long"),
        pytest.param({"name": "two\x00parts"}, "name", id="name-control-character"),
        pytest.param({"name": "two\nlines"}, "name", id="name-two-lines"),
        pytest.param({"name": "evil\u202eexe.gnp"}, "name", id="name-bidi-override"),
        pytest.param({"notes": "bell\x07"}, "notes", id="notes-control-character"),
        pytest.param({"colour": "red"}, "colour", id="unknown-field"),
    ],
)
async def test_bad_bodies_are_422_naming_the_field(
    bridge: Bridge, body: dict[str, Any], param: str
) -> None:
    async with client(bridge) as api:
        device = await seen_device(bridge)
        answer = await api.put(f"/api/devices/{device.device_id}/notes", json=body)
        assert answer.status_code == 422, answer.text
        error = error_of(answer)
        assert error["code"] == "invalid_request" and error["param"] == param
        assert param in error["message"]
        assert (await api.get(f"/api/devices/{device.device_id}")).json()["name"] is None


async def test_garbage_unknown_devices_and_keys_without_admin_are_refused(bridge: Bridge) -> None:
    async with client(bridge) as api:
        device = await seen_device(bridge)
        path = f"/api/devices/{device.device_id}/notes"
        not_json = await api.put(
            path, content=b"{name", headers={"Content-Type": "application/json"}
        )
        assert not_json.status_code == 422 and "not valid JSON" in error_of(not_json)["message"]
        array = await api.put(path, json=["name"])
        assert array.status_code == 422
        surrogate = await api.put(
            path, content=b'{"name": "\\ud800"}', headers={"Content-Type": "application/json"}
        )
        assert surrogate.status_code == 400 and error_of(surrogate)["code"] == "invalid_text"
        unknown = await api.put("/api/devices/no-such-device/notes", json={"name": "x"})
        assert unknown.status_code == 404 and error_of(unknown)["code"] == "unknown_device"
        assert "no-such-device" in error_of(unknown)["message"]
        huge = await api.put(path, json={"notes": "x" * 70_000})
        assert huge.status_code == 413

    reader = await create_key(bridge, "devices:read", "devices:call", "chat:use")
    async with client(bridge, reader) as api:
        refused = await api.put(path, json={"name": "mine"})
        assert refused.status_code == 403 and error_of(refused)["code"] == "forbidden"
        assert "admin" in error_of(refused)["message"]
        # It may read the name, not change it; nor revoke nor forget the device.
        assert (await api.get(f"/api/devices/{device.device_id}")).json()["name"] is None
        revoke = await api.post(f"/api/provisioning/devices/{device.device_id}/revoke")
        assert revoke.status_code == 403
        assert (await api.delete(f"/api/devices/{device.device_id}")).status_code == 403
    async with client(bridge, None) as api:
        assert (await api.put(path, json={"name": "x"})).status_code == 401
