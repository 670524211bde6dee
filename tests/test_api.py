"""Admin API surface: auth, health, error format."""

import httpx
import pytest

from testkit.stock_device import never_answer
from tests.helpers import wait_state


async def test_healthz_needs_no_token(bridge):
    async with httpx.AsyncClient(base_url=bridge.api_url) as client:
        response = await client.get("/healthz")
    assert response.status_code == 200 and response.json()["status"] == "ok"


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "device-secret-token-for-tests"])
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/devices"),
        ("GET", "/api/devices/x"),
        ("GET", "/api/devices/x/tools"),
        ("POST", "/api/devices/x/tools/call"),
    ],
)
async def test_admin_routes_need_the_admin_token(bridge, authorization, method, path):
    headers = {"Authorization": authorization} if authorization else {}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as client:
        response = await client.request(method, path, json={"name": "x"})
    assert response.status_code == 401
    assert response.json() == {
        "error": {
            "message": "missing or invalid admin token",
            "type": "invalid_request_error",
            "param": None,
            "code": "unauthorized",
        }
    }


async def test_api_listens_on_localhost_only(bridge):
    assert bridge.settings.http_host == "127.0.0.1"
    assert bridge.api_url.startswith("http://127.0.0.1:")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({}, "name"),
        ({"name": ""}, "name"),
        ({"name": "t", "arguments": [1]}, "arguments"),
        ({"name": "t", "timeout_s": -1}, "timeout_s"),
    ],
)
async def test_malformed_call_request_is_422(bridge, api, wire_devices, body, fragment):
    device = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    response = await api.post(f"/api/devices/{device.device_id}/tools/call", json=body)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_request"
    assert fragment in response.json()["error"]["message"]


async def test_unknown_route_is_json_404(api):
    response = await api.get("/api/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "http_error"


async def test_tools_of_unknown_device_is_404(api):
    response = await api.get("/api/devices/ff:ff:ff:ff:ff:ff/tools")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_device"


async def test_call_while_initializing_is_409(bridge, api, wire_devices):
    device = wire_devices()

    device.handlers["tools/list"] = never_answer
    await device.connect()
    await device.wait_for_method("tools/list")
    response = await api.post(
        f"/api/devices/{device.device_id}/tools/call", json={"name": "self.get_device_status"}
    )
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "device_not_ready"


async def test_api_connections_have_tcp_nodelay():
    """Without TCP_NODELAY each kept-alive API response waited ~40 ms for a delayed ACK."""
    import asyncio
    import socket

    from backend.common import tcp_listener

    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    listening = tcp_listener("127.0.0.1", 0)
    server = await asyncio.get_running_loop().create_server(Probe, sock=listening)
    try:
        _reader, writer = await asyncio.open_connection(*listening.getsockname())
        assert await asyncio.wait_for(accepted, 5) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


async def _chunks(total: int, size: int = 16384):
    """A body sent chunked (no Content-Length), so the cap is met while it streams."""
    sent = 0
    while sent < total:
        yield b"x" * min(size, total - sent)
        sent += size


@pytest.mark.parametrize(
    "path",
    ["/api/keys", "/api/devices/02:00:00:00:00:01/tools/call", "/api/provisioning/approve"],
)
async def test_bodies_over_the_cap_are_413_declared_or_streamed(bridge, api, path):
    too_big = 65536 + 1
    declared = await api.post(path, content=b"x" * too_big)
    assert declared.status_code == 413
    streamed = await api.post(path, content=_chunks(too_big))
    assert streamed.status_code == 413, streamed.text
    assert streamed.json()["error"]["code"] == "body_too_large"
    # Without the token nothing is read: 401 before the body.
    stranger = await api.post(path, content=_chunks(too_big), headers={"Authorization": "x"})
    assert stranger.status_code == 401


@pytest.mark.parametrize(
    ("path", "status"),
    [("/api/keys", 422), ("/api/chat/stream", 422), ("/v1/chat/completions", 400)],
)
async def test_a_truncated_json_body_says_so_with_the_position(api, path, status):
    response = await api.post(
        path, content=b'{"name": "ab', headers={"Content-Type": "application/json"}
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["message"] == (
        "request body is not valid JSON: Unterminated string starting at position 9"
    )


async def test_an_unknown_tool_suggests_the_closest_names(bridge, api, wire_devices):
    device = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    call = f"/api/devices/{device.device_id}/tools/call"
    response = await api.post(call, json={"name": "self.audio_speaker.set_volum"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "unknown_tool"
    assert error["message"].endswith("did you mean 'self.audio_speaker.set_volume'?")
    response = await api.post(call, json={"name": "zzzz"})
    assert "did you mean" not in response.json()["error"]["message"]
