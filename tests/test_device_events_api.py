"""The console's server API: `GET /api/whoami`, the live fleet stream `GET /api/fleet/events`
and `GET /api/audit?device_id=` for a devices:read key (backend/api/device_events.py)."""

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from backend.api.device_events import DeviceStreams
from backend.devices import DeviceRegistry
from backend.keys import Principal, Scope
from backend.server import Bridge
from simulator.fleet import device_id_for
from testkit.settings import ADMIN_TOKEN
from tests.helpers import create_key, eventually
from tests.stream_helpers import EVENTS, open_stream, stream_ready, stream_state

# ---- the stream -----------------------------------------------------------------------------


async def test_a_device_appears_goes_offline_and_is_removed_live(
    bridge: Bridge, api: httpx.AsyncClient, simulated_devices: Callable[..., Any]
) -> None:
    async with open_stream(bridge, ADMIN_TOKEN) as stream:
        assert stream.status == 200
        await stream_ready(stream)
        assert stream.named("ready") == [{"total": 0}]
        device = await simulated_devices(bridge)
        await eventually(lambda: stream_state(stream, device.device_id) == "ready")
        row = stream.rows()[device.device_id]
        listed = (await api.get(f"/api/devices/{device.device_id}")).json()
        assert row.keys() == listed.keys()  # rows exactly as GET /api/devices rows
        assert row["tool_count"] == listed["tool_count"] > 0
        assert row["transport"] == "websocket"
        await device.stop()
        await eventually(lambda: stream_state(stream, device.device_id) == "offline")
        assert (await api.delete(f"/api/devices/{device.device_id}")).status_code == 204
        await eventually(lambda: device.device_id not in stream.rows())
        assert stream.named("removed")[-1] == {"device_ids": [device.device_id]}


async def test_the_snapshot_lists_known_devices_then_ready(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    first = await simulated_devices(bridge, 1)
    second = await simulated_devices(bridge, 2)
    await second.stop()
    async with open_stream(bridge, ADMIN_TOKEN) as stream:
        await stream_ready(stream)
        names = [name for name, _ in stream.events]
        assert names == ["snapshot", "ready"]
        assert stream.named("ready") == [{"total": 2}]
        assert stream_state(stream, first.device_id) == "ready"
        assert stream_state(stream, second.device_id) == "offline"


async def test_snapshot_only_ends_after_ready(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    await simulated_devices(bridge)
    async with open_stream(bridge, ADMIN_TOKEN, "?snapshot_only=true") as stream:
        await asyncio.wait_for(stream.ended.wait(), 5)
        assert [name for name, _ in stream.events] == ["snapshot", "ready"]


async def test_a_limited_key_sees_only_its_devices(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    mine, other = device_id_for(1), device_id_for(2)
    await simulated_devices(bridge, 2)
    token = await create_key(bridge, "devices:read", devices=[mine])
    async with open_stream(bridge, token) as stream:
        await stream_ready(stream)
        assert stream.named("ready") == [{"total": 0}]  # the other one exists, unseen
        device = await simulated_devices(bridge, 1)
        await eventually(lambda: stream_state(stream, mine) == "ready")
        await device.stop()
        await eventually(lambda: stream_state(stream, mine) == "offline")
        assert other not in json.dumps(stream.events)


async def test_refused_calls_to_made_up_devices_send_nothing(
    bridge: Bridge, api: httpx.AsyncClient
) -> None:
    """A refused call is an event naming any device id: it must not reach a stream."""
    async with open_stream(bridge, ADMIN_TOKEN) as stream:
        await stream_ready(stream)
        for name in ("ghost", "x" * 300):
            answer = await api.post(f"/api/devices/{name}/tools/call", json={"name": "t"})
            assert answer.status_code == 404
        bridge.registry.reported("real-one", None, {"firmware_version": "1.0"})
        await eventually(lambda: "real-one" in stream.rows())
        assert "ghost" not in json.dumps(stream.events)
        assert stream.named("removed") == []


async def test_the_stream_needs_a_reading_key(bridge: Bridge, api: httpx.AsyncClient) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url, timeout=10) as anonymous:
        assert (await anonymous.get(EVENTS)).status_code == 401
        bad = {"Authorization": "Bearer esk_not-a-key"}
        assert (await anonymous.get(EVENTS, headers=bad)).status_code == 401
        chatter = await create_key(bridge, "chat:use")
        refused = await anonymous.get(EVENTS, headers={"Authorization": f"Bearer {chatter}"})
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "forbidden"
    malformed = await api.get(EVENTS, params={"snapshot_only": "maybe"})
    assert malformed.status_code == 422
    assert malformed.json()["error"]["param"] == "snapshot_only"


async def test_a_client_leaving_unsubscribes(bridge: Bridge) -> None:
    before = len(bridge.registry._listeners)
    async with open_stream(bridge, ADMIN_TOKEN) as stream:
        await stream_ready(stream)
        assert len(bridge.registry._listeners) == before + 1
        assert len(bridge.device_streams) == 1
    await eventually(lambda: len(bridge.registry._listeners) == before)
    assert len(bridge.device_streams) == 0


async def test_the_bridge_stopping_ends_the_stream(
    bridge_factory: Callable[..., Any],
) -> None:
    bridge: Bridge = await bridge_factory()
    async with open_stream(bridge, ADMIN_TOKEN) as stream:
        await stream_ready(stream)
        await asyncio.wait_for(bridge.stop(), 10)  # would wait forever for an open stream
        await asyncio.wait_for(stream.ended.wait(), 5)
    assert len(bridge.device_streams) == 0


async def test_a_revoked_key_s_stream_ends(bridge: Bridge) -> None:
    token = await create_key(bridge, "devices:read")
    async with open_stream(bridge, token) as stream:
        await stream_ready(stream)
        bridge.registry.reported("before", None, {})
        await eventually(lambda: "before" in stream.rows())
        await bridge.frontends.keys.revoke(token.split("_")[1])  # esk_<key id>_<secret>
        bridge.registry.reported("after", None, {})
        await asyncio.wait_for(stream.ended.wait(), 5)
        assert "after" not in stream.rows()
    await eventually(lambda: len(bridge.device_streams) == 0)


# ---- coalescing and bounds, on a registry alone ---------------------------------------------


async def _frames(stream_gen: AsyncIterator[bytes], count: int) -> list[bytes]:
    return [await anext(stream_gen) for _ in range(count)]


async def test_changes_to_one_device_are_coalesced_into_one_row() -> None:
    registry = DeviceRegistry()
    streams = DeviceStreams(registry, flush_interval_s=0.2)
    admin = Principal("admin", "admin", frozenset({Scope.ADMIN}))
    frames = streams.open(admin).frames()
    assert (await _frames(frames, 1))[0].startswith(b"event: ready")
    for version in range(50):
        registry.reported("dev", None, {"firmware_version": f"1.{version}"})
    registry.reported("other", None, {})
    chunk = (await _frames(frames, 1))[0]
    name, data = chunk.decode().split("\n")[:2]
    rows = json.loads(data[len("data: ") :])["devices"]
    assert name == "event: devices"
    assert [row["device_id"] for row in rows] == ["dev", "other"]
    assert rows[0]["ota"]["firmware_version"] == "1.49"  # the last state, once
    registry.forget("dev")
    assert (await _frames(frames, 1))[0].startswith(b'event: removed\ndata: {"device_ids":["dev"]}')
    await frames.aclose()
    assert registry._listeners == []


async def test_a_stream_that_falls_too_far_behind_ends() -> None:
    registry = DeviceRegistry()
    streams = DeviceStreams(registry, max_pending=3)
    admin = Principal("admin", "admin", frozenset({Scope.ADMIN}))
    frames = streams.open(admin).frames()
    await _frames(frames, 1)  # ready
    for index in range(10):
        registry.reported(f"dev-{index}", None, {})
    with pytest.raises(StopAsyncIteration):
        await anext(frames)
    assert registry._listeners == []


async def test_a_quiet_stream_sends_pings() -> None:
    registry = DeviceRegistry()
    streams = DeviceStreams(registry, ping_interval_s=0.01)
    admin = Principal("admin", "admin", frozenset({Scope.ADMIN}))
    frames = streams.open(admin).frames()
    await _frames(frames, 1)
    assert await _frames(frames, 2) == [b": ping\n\n", b": ping\n\n"]
    await frames.aclose()


# ---- whoami -----------------------------------------------------------------------------------


async def test_whoami(bridge: Bridge, api: httpx.AsyncClient) -> None:
    admin = (await api.get("/api/whoami")).json()
    assert admin["is_admin"] is True and admin["key_id"] == "admin"
    assert admin["device_ids"] is None
    token = await create_key(bridge, "devices:read", "chat:use", devices=["b", "a"])
    async with httpx.AsyncClient(base_url=bridge.api_url, timeout=10) as client:
        me = (await client.get("/api/whoami", headers={"Authorization": f"Bearer {token}"})).json()
        assert me["scopes"] == ["chat:use", "devices:read"]
        assert me["device_ids"] == ["a", "b"]
        assert me["is_admin"] is False
        assert me["name"].startswith("test ")
        assert token not in json.dumps(me)
        assert (await client.get("/api/whoami")).status_code == 401
        bad = {"Authorization": f"Bearer {token}x"}
        assert (await client.get("/api/whoami", headers=bad)).status_code == 401


# ---- audit of one device ----------------------------------------------------------------------


async def test_a_reading_key_reads_the_audit_of_its_devices_only(
    bridge: Bridge, api: httpx.AsyncClient, simulated_devices: Callable[..., Any]
) -> None:
    mine, other = device_id_for(1), device_id_for(2)
    await simulated_devices(bridge, 1)
    await simulated_devices(bridge, 2)
    for device_id in (mine, other):
        call = {"name": "self.audio_speaker.set_volume", "arguments": {"volume": 7}}
        answer = await api.post(f"/api/devices/{device_id}/tools/call", json=call)
        assert answer.status_code == 200
    limited = await create_key(bridge, "devices:read", devices=[mine])
    reader = await create_key(bridge, "devices:read")
    chatter = await create_key(bridge, "chat:use")
    async with httpx.AsyncClient(base_url=bridge.api_url, timeout=10) as client:

        async def audit(token: str, **params: str) -> httpx.Response:
            headers = {"Authorization": f"Bearer {token}"}
            return await client.get("/api/audit", params=params, headers=headers)

        async def entries(token: str, device_id: str) -> list[dict[str, Any]]:
            answer = await audit(token, device_id=device_id)
            assert answer.status_code == 200, answer.text
            found: list[dict[str, Any]] = answer.json()["entries"]
            return found

        rows = await entries(limited, mine)
        assert rows and {row["device_id"] for row in rows} == {mine}
        assert (await entries(reader, other))[0]["device_id"] == other
        assert (await audit(limited, device_id=other)).status_code == 403
        assert (await audit(limited)).status_code == 403  # the whole log stays admin's
        assert (await audit(reader)).status_code == 403
        assert (await audit(chatter, device_id=mine)).status_code == 403
        assert (await audit("esk_nope", device_id=mine)).status_code == 401
        assert (await api.get("/api/audit")).status_code == 200
