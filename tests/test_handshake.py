"""The device endpoint's handshake and hello, over a real WebSocket on loopback."""

import asyncio
import json
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from testkit.settings import DEVICE_TOKEN
from testkit.stock_device import STOCK_HELLO, WireDevice
from tests.helpers import wait_state

HEADERS = {"Protocol-Version": "1", "Device-Id": "a4:cf:12:34:56:78", "Client-Id": "c-1"}


async def rejected_status(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    with pytest.raises(InvalidStatus) as info:
        async with connect(url, additional_headers=headers):
            pass
    return info.value.response.status_code, info.value.response.body


@pytest.mark.parametrize(
    ("headers", "status", "reason"),
    [
        (HEADERS, 401, b"missing device token"),
        ({**HEADERS, "Authorization": "Bearer wrong"}, 401, b"invalid device token"),
        (
            {"Authorization": f"Bearer {DEVICE_TOKEN}", "Protocol-Version": "1"},
            400,
            b"missing Device-Id",
        ),
        (
            {"Authorization": f"Bearer {DEVICE_TOKEN}", "Device-Id": "bad id!"},
            400,
            b"malformed Device-Id",
        ),
        (
            {**HEADERS, "Authorization": DEVICE_TOKEN, "Protocol-Version": "9"},
            400,
            b"Protocol-Version",
        ),
    ],
)
async def test_handshake_is_refused_with_http_status(bridge, headers, status, reason):
    code, body = await rejected_status(bridge.ws_url, headers)
    assert code == status
    assert reason in body
    assert len(bridge.registry) == 0


async def test_wrong_path_is_404(bridge):
    url = bridge.ws_url.replace("/xiaozhi/v1/", "/other/")
    code, _ = await rejected_status(url, {**HEADERS, "Authorization": f"Bearer {DEVICE_TOKEN}"})
    assert code == 404


@pytest.mark.serial  # a latency bound (hello within 1 s): alone on the CPU
@pytest.mark.parametrize("authorization", [f"Bearer {DEVICE_TOKEN}", DEVICE_TOKEN])
async def test_hello_reply_has_transport_session_and_audio_params(bridge, authorization):
    async with connect(
        bridge.ws_url, additional_headers={**HEADERS, "Authorization": authorization}
    ) as ws:
        started = time.perf_counter()
        await ws.send(json.dumps(STOCK_HELLO))
        hello = json.loads(await asyncio.wait_for(ws.recv(), 1))
        elapsed = time.perf_counter() - started
    assert hello["type"] == "hello"
    assert hello["transport"] == "websocket"
    assert set(hello["audio_params"]) >= {"format", "sample_rate", "channels", "frame_duration"}
    int(hello["session_id"], 16)  # JSON-safe hex: the firmware concatenates it unescaped
    assert len(hello["session_id"]) == 32
    assert elapsed < 1.0  # protocol reference §7.1 (the firmware itself gives up after 10 s)


async def test_identity_from_query_string_fallback(bridge):
    query = f"?device-id=aa:bb:cc:dd:ee:ff&client-id=q1&authorization=Bearer%20{DEVICE_TOKEN}"
    async with connect(bridge.ws_url + query) as ws:
        await ws.send(json.dumps({**STOCK_HELLO, "features": {}}))
        await ws.recv()
        device = await wait_state(bridge, "aa:bb:cc:dd:ee:ff")
    assert device.client_id == "q1"


async def test_session_ids_differ_per_connection(bridge, wire_devices):
    first = await wire_devices("a4:cf:00:00:00:01").connect()
    second = await wire_devices("a4:cf:00:00:00:02").connect()
    assert first["session_id"] != second["session_id"]


async def test_uppercase_mac_device_id_is_normalised(bridge, wire_devices):
    device = wire_devices("A4:CF:12:34:56:AA")
    await device.connect()
    assert (await wait_state(bridge, "a4:cf:12:34:56:aa")).device_id == "a4:cf:12:34:56:aa"


async def test_device_auth_can_be_disabled(bridge_factory):
    open_bridge = await bridge_factory(device_auth=False)
    device = WireDevice(open_bridge.ws_url, token=None)
    try:
        await device.connect()
        await wait_state(open_bridge, device.device_id)
    finally:
        await device.close()
