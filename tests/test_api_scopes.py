"""API keys over HTTP: the gate resolves every bearer to a principal, each route requires its
scope (401 for no or a bad token, 403 `forbidden` for a missing scope), `/api/keys` manages
keys, and a revoked key stops working at once. Real bridge, real sockets, a real device."""

from collections.abc import AsyncIterator

import httpx
import pytest

from backend.auth import Tokens
from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN, make_settings
from testkit.stock_device import WireDevice
from tests.helpers import wait_state

DEVICE = "a4:cf:12:34:56:78"
OTHER = "a4:cf:12:34:56:79"

# (method, path, json body, the scope that opens it)
ROUTES = [
    ("GET", "/api/devices", None, "devices:read"),
    ("GET", f"/api/devices/{DEVICE}", None, "devices:read"),
    ("GET", f"/api/devices/{DEVICE}/tools", None, "devices:read"),
    (
        "POST",
        f"/api/devices/{DEVICE}/tools/call",
        {"name": "self.get_device_status"},
        "devices:call",
    ),
    ("DELETE", f"/api/devices/{OTHER}", None, "admin"),
    ("GET", f"/api/devices/{DEVICE}/voice", None, "devices:read"),
    ("PUT", f"/api/devices/{DEVICE}/voice", {"language": "auto"}, "admin"),
    ("GET", "/api/keys", None, "admin"),
    ("POST", "/api/keys", {"name": "x", "scopes": ["chat:use"]}, "admin"),
    ("DELETE", "/api/keys/000000000000", None, "admin"),
    ("GET", "/v1/models", None, "chat:use"),
    ("GET", "/api/chat/models", None, "chat:use"),
    ("GET", "/v1/conversations", None, "chat:use"),
    ("GET", "/v1/conversations/nope", None, "chat:use"),
    ("DELETE", "/v1/conversations/nope", None, "chat:use"),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "dental-duckduckgo", "messages": [{"role": "user", "content": "floss?"}]},
        "chat:use",
    ),
    (
        "POST",
        "/v1/responses",
        {"model": "dental-duckduckgo", "input": "floss?", "store": False},
        "chat:use",
    ),
    ("GET", "/v1/responses/resp_nope_1", None, "chat:use"),
    ("POST", "/api/chat/stream", {"message": "How often should I floss?"}, "chat:use"),
    ("GET", "/metrics", None, "metrics:read"),
]
SCOPES = ["chat:use", "devices:read", "devices:call", "metrics:read", "admin"]
TOKENS = Tokens(admin=ADMIN_TOKEN, device=DEVICE_TOKEN)


@pytest.fixture
async def device(bridge: Bridge, wire_devices) -> AsyncIterator[WireDevice]:
    device = wire_devices(DEVICE)
    await device.connect()
    await wait_state(bridge, DEVICE)
    yield device


async def create_key(api: httpx.AsyncClient, *scopes: str, devices: list[str] | None = None):
    body: dict = {"name": f"key with {' '.join(scopes)}", "scopes": list(scopes)}
    if devices is not None:
        body["device_ids"] = devices
    response = await api.post("/api/keys", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def allowed(route_scope: str, key_scope: str) -> bool:
    if key_scope == "admin":
        return True
    if route_scope == "devices:read":  # reading devices is part of calling them
        return key_scope in ("devices:read", "devices:call")
    return route_scope == key_scope


@pytest.mark.parametrize("key_scope", SCOPES)
async def test_every_route_requires_its_scope(bridge, api, device, key_scope):
    key = await create_key(api, key_scope)
    headers = {"Authorization": f"Bearer {key['token']}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30) as client:
        for method, path, body, route_scope in ROUTES:
            response = await client.request(method, path, json=body)
            if allowed(route_scope, key_scope):
                assert response.status_code not in (401, 403), (method, path, response.text)
            else:
                assert response.status_code == 403, (method, path, response.text)
                error = response.json()["error"]
                assert error["code"] == "forbidden", (method, path)
                assert route_scope in error["message"] or "devices:" in error["message"]


@pytest.mark.parametrize("method, path, body, _scope", ROUTES)
async def test_no_or_bad_token_is_401_before_any_body_is_read(bridge, method, path, body, _scope):
    for headers in ({}, {"Authorization": "Bearer esk_000000000000_forged"}):
        async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as client:
            response = await client.request(method, path, json=body)
        assert response.status_code == 401, (method, path)
        code = "invalid_api_key" if path.startswith("/v1/") else "unauthorized"  # as OpenAI
        assert response.json()["error"]["code"] == code
        assert response.headers["www-authenticate"] == "Bearer"
    message = response.json()["error"]["message"]
    expected = "API key" if path.startswith(("/v1/", "/api/chat/")) else "admin token"
    assert message == f"missing or invalid {expected}"


async def test_key_lifecycle_and_immediate_revocation(bridge, api, device):
    created = await create_key(api, "devices:read")
    assert created["token"].startswith("esk_") and created["active"] is True
    headers = {"Authorization": f"Bearer {created['token']}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as client:
        assert (await client.get("/api/devices")).status_code == 200

        listed = (await api.get("/api/keys")).json()["keys"]
        assert [key["id"] for key in listed] == [created["id"]]
        assert "token" not in listed[0] and listed[0]["last_used_at"] is not None

        revoked = await api.delete(f"/api/keys/{created['id']}")
        assert revoked.status_code == 200 and revoked.json()["active"] is False
        assert (await client.get("/api/devices")).status_code == 401

    assert (await api.get("/api/keys", params={"revoked": "false"})).json()["keys"] == []
    missing = await api.delete("/api/keys/000000000000")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_key"


async def test_keys_survive_a_restart_and_last_use_is_written(tmp_path):
    settings = make_settings(tmp_path / "data")
    async with Bridge(settings, TOKENS) as first:
        created = await first.frontends.keys.create("persistent", ["devices:read"])
        headers = {"Authorization": f"Bearer {created.token}"}
        async with httpx.AsyncClient(base_url=first.api_url, headers=headers) as client:
            assert (await client.get("/api/devices")).status_code == 200

    async with Bridge(settings, TOKENS) as second:
        [key] = await second.frontends.keys.list()
        assert key.last_used_at is not None  # written on the way down
        async with httpx.AsyncClient(base_url=second.api_url, headers=headers) as client:
            assert (await client.get("/api/devices")).status_code == 200


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"name": "k", "scopes": ["chat:abuse"]}, "scopes"),
        ({"name": "k", "scopes": []}, "scopes"),
        ({"name": "   ", "scopes": ["chat:use"]}, "name"),
        ({"scopes": ["chat:use"]}, "name"),
    ],
)
async def test_bad_key_requests_are_422(api, body, fragment):
    response = await api.post("/api/keys", json=body)
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_request"
    assert fragment in response.json()["error"]["message"]


async def test_device_limited_key_sees_and_calls_only_its_devices(bridge, api, wire_devices):
    mine, other = wire_devices(DEVICE), wire_devices(OTHER)
    for device in (mine, other):
        await device.connect()
        await wait_state(bridge, device.device_id)
    key = await create_key(api, "devices:call", devices=[DEVICE])
    headers = {"Authorization": f"Bearer {key['token']}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as client:
        listing = (await client.get("/api/devices")).json()
        assert [d["device_id"] for d in listing["devices"]] == [DEVICE] and listing["total"] == 1

        call = {"name": "self.audio_speaker.set_volume", "arguments": {"volume": 33}}
        ok = await client.post(f"/api/devices/{DEVICE}/tools/call", json=call)
        assert ok.status_code == 200 and mine.volume == 33

        refused = await client.post(f"/api/devices/{OTHER}/tools/call", json=call)
        assert refused.status_code == 403
        assert "does not cover device" in refused.json()["error"]["message"]
        assert (await client.get(f"/api/devices/{OTHER}/tools")).status_code == 403
    await other.round_trip()
    assert other.volume == 50 and not other.stock.calls


async def test_a_refused_call_never_reaches_the_device(bridge, api, device):
    key = await create_key(api, "devices:read")
    headers = {"Authorization": f"Bearer {key['token']}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as client:
        response = await client.post(
            f"/api/devices/{DEVICE}/tools/call",
            json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": 1}},
        )
    assert response.status_code == 403
    assert response.json()["error"]["message"].endswith("missing scope devices:call")
    await device.round_trip()
    assert not device.stock.calls and device.volume == 50
