"""The OTA/activation endpoint as stock firmware uses it (protocol reference §5), per-device
credentials, revocation, enrollment codes, serial keys and the abuse limits: a real bridge with
its device-facing HTTP listener, the admin API and real WebSockets on loopback."""

import asyncio
import hashlib
import hmac
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidMessage

from backend.cli.runs import auth_warnings
from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN, make_settings
from testkit.stock_device import CLIENT_ID, WireDevice
from tests.helpers import ManualClock, can_bind, eventually, run_cli, wait_state
from tests.provisioning_helpers import (
    MAC,
    OTHER_CLIENT,
    Reply,
    StockOta,
    handshake_reply,
    handshake_status,
    http_reply,
    stock_headers,
    system_info,
)

# Another address of this machine, for limits per IP (Linux routes all of 127.0.0.0/8 to lo).
OTHER_ADDRESS = "127.0.0.2"


HAVE_OTHER_ADDRESS = can_bind(OTHER_ADDRESS)


@pytest.fixture
async def device_bridge(bridge_factory: Callable[..., Any]) -> Bridge:
    bridge: Bridge = await bridge_factory(device_auth="device")
    return bridge


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


@pytest.fixture
async def admin(device_bridge: Bridge) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=device_bridge.api_url, headers=headers) as client:
        yield client


async def approved_token(
    bridge: Bridge, http: httpx.AsyncClient, admin: httpx.AsyncClient, **device: Any
) -> str:
    ota = StockOta(http, bridge.provisioning.ota_url, **device)
    code = (await ota.check()).json()["activation"]["code"]
    assert (await admin.post("/api/provisioning/approve", json={"target": code})).status_code == 200
    token: str = (await ota.check()).json()["websocket"]["token"]
    return token


# ---- the stock exchange -----------------------------------------------------------------------


async def test_stock_device_activates_is_approved_and_connects_with_its_own_token(
    device_bridge: Bridge, http: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    bridge = device_bridge
    ota = StockOta(http, bridge.provisioning.ota_url, mac=MAC, client_id=CLIENT_ID)

    first = await ota.check()
    assert first.status_code == 200
    answer = first.json()
    assert set(answer) == {"server_time", "firmware", "activation"}  # no credentials
    assert isinstance(answer["server_time"]["timestamp"], int)
    assert answer["server_time"]["timestamp"] > 1_700_000_000_000  # milliseconds
    offset = answer["server_time"]["timezone_offset"]  # minutes (§5.2); the bridge's own zone
    assert type(offset) is int and offset == time.localtime().tm_gmtoff // 60
    assert answer["firmware"] == {"version": "2.4.2", "url": ""}  # nothing published
    code = answer["activation"]["code"]
    assert re.fullmatch(r"\d{6}", code) and code in answer["activation"]["message"]
    assert re.fullmatch(r"[0-9a-f]{32}", answer["activation"]["challenge"])
    # The same device polling again keeps its code (the one on its screen).
    assert (await ota.check()).json()["activation"]["code"] == code
    assert (await ota.activate()).status_code == 202
    assert await handshake_status(bridge.ws_url, None) == 401

    pending = (await admin.get("/api/provisioning/pending")).json()["pending"]
    assert [(p["code"], p["device_id"], p["client_id"], p["board"]) for p in pending] == [
        (code, MAC, CLIENT_ID, "bread-compact-wifi")
    ]
    approved = await admin.post("/api/provisioning/approve", json={"target": code})
    assert approved.status_code == 200 and approved.json()["approved_by"] == "admin"

    assert (await ota.activate()).status_code == 200
    second = (await ota.check()).json()
    assert set(second) == {"server_time", "firmware", "websocket"}  # no activation, no mqtt
    websocket = second["websocket"]
    assert websocket["url"] == bridge.ws_url and websocket["version"] == 1
    assert websocket["token"].startswith("dtk_") and " " not in websocket["token"]
    # Every boot asks again: the same token (it is stored only as a hash).
    assert (await ota.check()).json()["websocket"]["token"] == websocket["token"]
    assert websocket["token"] not in (bridge.database.path.read_bytes().decode("latin-1"))

    device = WireDevice(websocket["url"], websocket["token"], MAC)
    await device.connect()
    try:
        await wait_state(bridge, MAC)
        listed = (await admin.get(f"/api/devices/{MAC}")).json()
        assert listed["state"] == "ready"
        reported = listed["ota"]
        assert reported["board_type"] == "bread-compact-wifi" and reported["chip"] == "esp32s3"
        assert reported["firmware_version"] == "2.4.2"
        assert reported["minimum_free_heap_size"] == 158595  # a string on the wire
        assert reported["network"] == {
            "type": "wifi",
            "ssid": "home",
            "rssi": -52,
            "channel": 6,
            "ip": "192.168.1.23",
        }
        record = bridge.registry.record(MAC)
        assert record is not None and record.ota is not None
        assert record.ota["system_info"]["future_field"] == {"kept": True}  # unknown: kept
    finally:
        await device.close()


async def test_a_stranger_never_receives_a_token(
    device_bridge: Bridge, http: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    bridge = device_bridge
    token = await approved_token(bridge, http, admin, mac=MAC, client_id=CLIENT_ID)
    url = bridge.provisioning.ota_url
    # The approved MAC with another Client-Id (a spoofer, or the device after an NVS erase):
    # an activation code of its own, never the device's token.
    spoofer = StockOta(http, url, mac=MAC, client_id=OTHER_CLIENT)
    answer = (await spoofer.check()).json()
    assert "activation" in answer and "websocket" not in answer and "mqtt" not in answer
    assert token not in str(answer)
    assert (await spoofer.activate()).status_code == 202
    # No Client-Id at all: refused.
    missing = await http.post(url, json=system_info(), headers=stock_headers(client_id=None))
    assert missing.status_code == 400 and "Client-Id" in missing.json()["error"]
    # A device nobody approved: a code, no credentials, however often it asks.
    stranger = StockOta(http, url, mac="a4:cf:00:00:00:99", client_id=OTHER_CLIENT)
    for _ in range(3):
        reply = (await stranger.check()).json()
        assert "activation" in reply and "websocket" not in reply
    assert (await stranger.activate()).status_code == 202
    # The real device still gets its own token.
    assert (await StockOta(http, url, mac=MAC, client_id=CLIENT_ID).check()).json()["websocket"][
        "token"
    ] == token


async def test_a_device_cannot_use_another_devices_token(
    device_bridge: Bridge, http: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    bridge = device_bridge
    token_a = await approved_token(bridge, http, admin, mac=MAC, client_id=CLIENT_ID)
    token_b = await approved_token(
        bridge, http, admin, mac="a4:cf:00:00:00:02", client_id=OTHER_CLIENT
    )
    assert token_a != token_b
    assert await handshake_status(bridge.ws_url, token_b, MAC) == 401
    assert await handshake_status(bridge.ws_url, token_a, "a4:cf:00:00:00:02") == 401
    assert await handshake_status(bridge.ws_url, DEVICE_TOKEN, MAC) == 401  # no shared token
    assert await handshake_status(bridge.ws_url, token_a, MAC) == 101
    assert await handshake_status(bridge.ws_url, token_b, "a4:cf:00:00:00:02") == 101


async def test_revocation_closes_the_live_link_and_refuses_the_next_handshake(
    device_bridge: Bridge, http: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    bridge = device_bridge
    token = await approved_token(bridge, http, admin, mac=MAC, client_id=CLIENT_ID)
    device = WireDevice(bridge.ws_url, token, MAC)
    await device.connect()
    try:
        await wait_state(bridge, MAC)
        link = device.ws
        assert link is not None
        loop = asyncio.get_running_loop()

        async def closed_at() -> float:
            await link.wait_closed()
            return loop.time()

        closing = asyncio.create_task(closed_at())
        sent_at = loop.time()  # the brief: closed within a second of the revocation request
        revoked = await admin.post(f"/api/provisioning/devices/{MAC}/revoke")
        async with asyncio.timeout_at(sent_at + 1.0):
            closed = await closing
        assert closed - sent_at <= 1.0  # also when the answer came late and the link was closed
        assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
        assert link.close_code == 1008 and link.close_reason == "device credentials revoked"
    finally:
        await device.close()
    assert bridge.registry.get(MAC) is None
    assert await handshake_status(bridge.ws_url, token, MAC) == 401
    # Its next OTA check starts an activation again instead of handing the old token back.
    answer = (await StockOta(http, bridge.provisioning.ota_url, mac=MAC).check()).json()
    assert "activation" in answer and "websocket" not in answer
    listed = (await admin.get("/api/provisioning/devices")).json()["devices"]
    assert [(d["device_id"], d["status"]) for d in listed] == [(MAC, "revoked")]


async def test_approval_and_revocation_through_the_cli(
    device_bridge: Bridge, http: httpx.AsyncClient
) -> None:
    bridge = device_bridge
    url = bridge.provisioning.ota_url
    server = ["--server", bridge.api_url, "--token", ADMIN_TOKEN]
    first = StockOta(http, url, mac=MAC, client_id=CLIENT_ID)
    code = (await first.check()).json()["activation"]["code"]
    second = StockOta(http, url, mac="a4:cf:00:00:00:02", client_id=OTHER_CLIENT)
    await second.check()

    status, out, err = await run_cli("devices", "pending", *server)
    assert status == 0 and code in out and MAC in out and "a4:cf:00:00:00:02" in out, err
    status, out, err = await run_cli("devices", "approve", code, *server)
    assert status == 0 and f"approved {MAC}" in out, err
    status, out, err = await run_cli("devices", "approve", "A4:CF:00:00:00:02", *server)
    assert status == 0 and "approved a4:cf:00:00:00:02" in out, err
    status, _out, err = await run_cli("devices", "approve", "999999", *server)
    assert status == 1 and "no pending activation" in err
    assert "websocket" in (await first.check()).json()
    token = (await second.check()).json()["websocket"]["token"]
    status, out, _err = await run_cli("devices", "pending", *server)
    assert "no pending activations" in out

    device = WireDevice(bridge.ws_url, token, "a4:cf:00:00:00:02")
    await device.connect()
    try:
        await wait_state(bridge, "a4:cf:00:00:00:02")
        assert device.ws is not None
        status, out, err = await run_cli("devices", "revoke", "a4:cf:00:00:00:02", *server)
        assert status == 0 and "revoked a4:cf:00:00:00:02" in out, err
        async with asyncio.timeout(5):
            await device.ws.wait_closed()
        assert device.ws.close_code == 1008
    finally:
        await device.close()
    assert await handshake_status(bridge.ws_url, token, "a4:cf:00:00:00:02") == 401
    assert "activation" in (await second.check()).json()
    assert "websocket" in (await first.check()).json()  # the other device is untouched


async def test_two_pending_requests_for_one_mac_are_approved_by_code_only(
    device_bridge: Bridge, http: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    url = device_bridge.provisioning.ota_url
    real = StockOta(http, url, mac=MAC, client_id=CLIENT_ID)
    spoof = StockOta(http, url, mac=MAC, client_id=OTHER_CLIENT)
    code = (await real.check()).json()["activation"]["code"]
    await spoof.check()
    ambiguous = await admin.post("/api/provisioning/approve", json={"target": MAC})
    error = ambiguous.json()["error"]
    assert ambiguous.status_code == 409 and error["code"] == "ambiguous_activation"
    assert "2 pending activations claim" in error["message"]
    assert "approve by code" in error["message"]
    assert (await admin.post("/api/provisioning/approve", json={"target": code})).status_code == 200
    assert "websocket" in (await real.check()).json()
    assert "websocket" not in (await spoof.check()).json()


# ---- serial numbers and the HMAC challenge (§5.3) ---------------------------------------------


async def test_a_device_with_a_serial_number_must_answer_the_challenge_with_its_key(
    device_bridge: Bridge, http: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    serial = "SN-0001"
    key = bytes(range(32))
    put = await admin.put(f"/api/provisioning/serial-keys/{serial}", json={"key": key.hex()})
    assert put.status_code == 204
    ota = StockOta(http, device_bridge.provisioning.ota_url, mac=MAC, serial=serial)
    activation = (await ota.check()).json()["activation"]
    code, challenge = activation["code"], activation["challenge"]

    refused = await admin.post("/api/provisioning/approve", json={"target": code})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_verified"
    wrong = hmac.new(b"x" * 32, challenge.encode(), hashlib.sha256).hexdigest()
    body = {"algorithm": "hmac-sha256", "serial_number": serial, "challenge": challenge}
    assert (await ota.activate({**body, "hmac": wrong})).status_code == 403
    stale = hmac.new(key, b"another challenge", hashlib.sha256).hexdigest()
    assert (
        await ota.activate({**body, "challenge": "another challenge", "hmac": stale})
    ).status_code == 403
    right = hmac.new(key, challenge.encode(), hashlib.sha256).hexdigest()
    assert (await ota.activate({**body, "hmac": right})).status_code == 202
    pending = (await admin.get("/api/provisioning/pending")).json()["pending"]
    assert pending[0]["serial_check"] == "verified"

    assert (await admin.post("/api/provisioning/approve", json={"target": code})).status_code == 200
    assert (await ota.activate({**body, "hmac": right})).status_code == 200
    assert "websocket" in (await ota.check()).json()
    keys = (await admin.get("/api/provisioning/serial-keys")).json()
    assert keys == {"serial_numbers": [serial]}  # never the key itself


# ---- policies for fleets ------------------------------------------------------------------------


async def test_an_enrollment_code_approves_as_many_devices_as_it_allows(
    device_bridge: Bridge, http: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    created = await admin.post(
        "/api/provisioning/enrollment-codes", json={"name": "shelf 3", "uses": 2}
    )
    assert created.status_code == 201
    url = created.json()["ota_url"]
    assert url.startswith(device_bridge.provisioning.ota_url + "enroll/enr-")
    macs = ["a4:cf:00:00:01:01", "a4:cf:00:00:01:02", "a4:cf:00:00:01:03"]
    answers = [
        (await StockOta(http, url, mac=mac, client_id=f"{i}-{CLIENT_ID[2:]}").check()).json()
        for i, mac in enumerate(macs)
    ]
    assert ["websocket" in answer for answer in answers] == [True, True, False]
    assert "activation" in answers[2]  # used up: the normal activation
    for mac, answer in zip(macs[:2], answers[:2], strict=True):
        assert (
            await handshake_status(device_bridge.ws_url, answer["websocket"]["token"], mac) == 101
        )
    # The enrolled device keeps its OTA URL (with the used code) and keeps its credentials.
    again = await StockOta(http, url, mac=macs[0], client_id=f"0-{CLIENT_ID[2:]}").check()
    assert again.json()["websocket"] == answers[0]["websocket"]
    # A wrong code is no code.
    bogus = device_bridge.provisioning.enrollment_url("enr-not-a-real-code")
    assert "activation" in (await StockOta(http, bogus, mac="a4:cf:00:00:01:09").check()).json()
    listed = (await admin.get("/api/provisioning/devices")).json()["devices"]
    assert {d["approved_by"] for d in listed} == {f"auto:enrollment:{created.json()['id']}"}


async def test_a_mac_prefix_policy_approves_new_devices_only(
    bridge_factory: Callable[..., Any], http: httpx.AsyncClient
) -> None:
    bridge: Bridge = await bridge_factory(
        device_auth="device", activation_auto_approve_macs=["02:00:00"]
    )
    url = bridge.provisioning.ota_url
    fleet = await StockOta(http, url, mac="02:00:00:00:00:07", client_id=CLIENT_ID).check()
    assert "websocket" in fleet.json()
    other = await StockOta(http, url, mac=MAC, client_id=CLIENT_ID).check()
    assert "activation" in other.json()
    # An approved fleet device asked for by another Client-Id is not re-approved by MAC.
    spoof = await StockOta(http, url, mac="02:00:00:00:00:07", client_id=OTHER_CLIENT).check()
    assert "activation" in spoof.json()


async def test_the_ota_answer_tells_the_configured_timezone_offset_in_minutes(
    bridge_factory: Callable[..., Any], http: httpx.AsyncClient
) -> None:
    bridge: Bridge = await bridge_factory(
        device_auth="device", ota_timezone_offset_min=-210, activation_auto_approve_macs=["02:00"]
    )
    url = bridge.provisioning.ota_url
    stranger = (await StockOta(http, url, mac=MAC).check()).json()
    approved = (await StockOta(http, url, mac="02:00:00:00:00:07").check()).json()
    assert "activation" in stranger and "websocket" in approved
    for answer in (stranger, approved):
        offset = answer["server_time"]["timezone_offset"]
        assert type(offset) is int and offset == -210  # UTC-3:30 in minutes, not hours


# ---- what `serve` says about weak device auth ---------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "warned"),
    [
        ("shared", 'device_auth = "shared" (development mode)'),
        ("off", 'device_auth = "off"'),
        (False, 'device_auth = "off"'),  # the old boolean spelling
        ("device", None),
    ],
)
def test_serve_warns_about_shared_and_off_device_auth_only(
    tmp_path: Path, mode: str | bool, warned: str | None
) -> None:
    warnings = auth_warnings(make_settings(tmp_path, device_auth=mode))
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(warned)


# ---- abuse limits --------------------------------------------------------------------------------


async def test_a_full_pending_table_replaces_its_least_recently_seen_request(
    bridge_factory: Callable[..., Any], http: httpx.AsyncClient
) -> None:
    # Loopback is exempt from the per-address shares: only the table's own cap applies, and a
    # newcomer is never refused for it (the oldest request of the largest prefix makes room).
    bridge: Bridge = await bridge_factory(device_auth="device", max_pending_activations=3)
    url = bridge.provisioning.ota_url
    answers = [await StockOta(http, url, mac=f"a4:cf:00:00:02:{i:02x}").check() for i in range(4)]
    assert [answer.status_code for answer in answers] == [200, 200, 200, 200]
    store = bridge.provisioning.store
    assert store.pending_count == 3
    pending = {p.device_id for p in store.pending()}
    assert pending == {f"a4:cf:00:00:02:{i:02x}" for i in (1, 2, 3)}  # the first one went
    # A device already pending keeps polling with its code.
    again = await StockOta(http, url, mac="a4:cf:00:00:02:03").check()
    assert again.json()["activation"]["code"] == answers[3].json()["activation"]["code"]


async def test_ota_activation_and_handshake_rate_limits_trigger_and_recover(
    bridge_factory: Callable[..., Any], http: httpx.AsyncClient
) -> None:
    # The limits' clock moves only when the test says: exact on a loaded machine too.
    clock, limit = ManualClock(), {"per_s": 2.0, "burst": 2}
    bridge: Bridge = await bridge_factory(
        clock=clock,
        device_auth="device",
        rate_limit_exempt=[],
        rate_limits={"ota_ip": limit, "activate_device": limit, "handshake_device": limit},
    )
    url = bridge.provisioning.ota_url
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as admin:
        token = await approved_token(bridge, http, admin, mac=MAC, client_id=CLIENT_ID)
    clock.advance(1.0)  # the OTA bucket (2 at 2/s) refills after approved_token spent it
    statuses = [
        (await StockOta(http, url, mac=f"a4:cf:00:00:03:{i:02x}").check()).status_code
        for i in range(3)
    ]
    assert statuses == [200, 200, 429]
    ota = StockOta(http, url, mac="a4:cf:00:00:03:00")
    clock.advance(0.25)
    assert (await ota.check()).status_code == 429  # half a token is not one
    clock.advance(0.25)
    assert (await ota.check()).status_code == 200  # the bucket refilled one

    polls = [(await ota.activate()).status_code for _ in range(3)]
    assert polls == [202, 202, 429]
    strangers = [await handshake_status(bridge.ws_url, "x", MAC) for _ in range(3)]
    assert strangers == [401, 401, 401]  # a wrong token never spends the device's budget
    handshakes = [await handshake_status(bridge.ws_url, token, MAC) for _ in range(3)]
    assert handshakes == [101, 101, 429]
    clock.advance(0.5)
    assert await handshake_status(bridge.ws_url, token, MAC) == 101
    clock.advance(0.5)
    assert (await ota.activate()).status_code == 202
    counts = bridge.provisioning.limits.refused()
    assert counts == {
        "ota_ip": 2,
        "activate_device": 1,
        "handshake_device": 1,
        **{name: 0 for name in ("ota_device", "activate_ip", "handshake_ip")},
    }


async def eventually_async(check: Callable[[], Any], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - a token bucket refills with time only
            await asyncio.sleep(0.1)  # not faster: 20 refusals in 10 s close the penalty box


# The other three buckets, one request kind each: `ask(other)` makes the request again, with
# `other` from another address (per-IP buckets) or for another device (per-device buckets).
Ask = Callable[[bool], Awaitable[Reply]]


async def ask_handshake(bridge: Bridge, http: httpx.AsyncClient, _elsewhere: Any) -> Ask:
    """An approved device's WebSocket handshake with its own token."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as admin:
        token = await approved_token(bridge, http, admin, mac=MAC, client_id=CLIENT_ID)

    async def ask(other: bool) -> Reply:
        source = OTHER_ADDRESS if other else None
        return await handshake_reply(bridge.ws_url, token, MAC, source=source)

    return ask


async def ask_ota(bridge: Bridge, http: httpx.AsyncClient, _elsewhere: Any) -> Ask:
    """A stranger's OTA check (an activation code)."""
    url = bridge.provisioning.ota_url
    device = StockOta(http, url, mac="a4:cf:00:00:05:01")
    another = StockOta(http, url, mac="a4:cf:00:00:05:02", client_id=OTHER_CLIENT)

    async def ask(other: bool) -> Reply:
        return http_reply(await (another if other else device).check())

    return ask


async def ask_activate(bridge: Bridge, http: httpx.AsyncClient, elsewhere: Any) -> Ask:
    """A pending device's activation poll (202)."""
    url = bridge.provisioning.ota_url
    here = StockOta(http, url, mac="a4:cf:00:00:05:03")
    there = StockOta(elsewhere, url, mac="a4:cf:00:00:05:03")
    assert "activation" in (await here.check()).json()

    async def ask(other: bool) -> Reply:
        return http_reply(await (there if other else here).activate())

    return ask


@pytest.mark.parametrize(
    ("limit", "asking", "allowed", "refused"),
    [
        pytest.param(
            "handshake_ip",
            ask_handshake,
            101,
            Reply(429, "too many handshake requests from this address; slow down"),
            id="handshake-per-ip",
        ),
        pytest.param(
            "ota_device",
            ask_ota,
            200,
            Reply(429, "too many ota requests for this device; slow down", "10"),
            id="ota-per-device",
        ),
        pytest.param(
            "activate_ip",
            ask_activate,
            202,
            Reply(429, "too many activate requests from this address; slow down", "10"),
            id="activate-per-ip",
        ),
    ],
)
async def test_every_other_abuse_bucket_triggers_and_recovers(
    bridge_factory: Callable[..., Any],
    http: httpx.AsyncClient,
    limit: str,
    asking: Callable[..., Awaitable[Ask]],
    allowed: int,
    refused: Reply,
) -> None:
    # A burst of 2, then one request every half second of the limits' clock, which moves
    # only when the test says: exact on a loaded machine too.
    clock = ManualClock()
    bridge: Bridge = await bridge_factory(
        clock=clock,
        device_auth="device",
        rate_limit_exempt=[],
        rate_limits={limit: {"per_s": 2.0, "burst": 2}},
    )
    transport = httpx.AsyncHTTPTransport(local_address=OTHER_ADDRESS)
    async with httpx.AsyncClient(timeout=10, transport=transport) as elsewhere:
        ask = await asking(bridge, http, elsewhere)
        clock.advance(1.0)  # whatever `asking` spent comes back
        assert [await ask(False) for _ in range(3)] == [Reply(allowed), Reply(allowed), refused]
        if limit.endswith("_device") or HAVE_OTHER_ADDRESS:
            assert await ask(True) == Reply(allowed)  # a bucket of its own
        counts = bridge.provisioning.limits.refused()
        assert {name: count for name, count in counts.items() if count} == {limit: 1}
        clock.advance(0.5)  # refilled one: the same request is allowed again
        assert await ask(False) == Reply(allowed)
    health = await http.get(bridge.api_url + "/healthz")
    assert health.status_code == 200


async def answer_before_close(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sent before it closed the connection (reset: nothing)."""
    try:
        async with asyncio.timeout(5):
            return await reader.read()
    except ConnectionResetError:
        return b""


async def test_handshakes_in_progress_are_capped_and_a_device_gets_in_once_they_go(
    bridge_factory: Callable[..., Any], http: httpx.AsyncClient
) -> None:
    bridge: Bridge = await bridge_factory(device_auth="device", max_pending_handshakes=2)
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as admin:
        token = await approved_token(bridge, http, admin, mac=MAC, client_id=CLIENT_ID)
        other = "a4:cf:00:00:00:02"
        other_token = await approved_token(bridge, http, admin, mac=other, client_id=OTHER_CLIENT)
    connected = WireDevice(bridge.ws_url, token, MAC)
    await connected.connect()
    late = WireDevice(bridge.ws_url, other_token, other)
    guard = bridge.websocket.handshakes
    try:
        await wait_state(bridge, MAC)
        # Two connections that never finish their handshake: a silent one and a slow one.
        held = [await asyncio.open_connection("127.0.0.1", bridge.websocket.port) for _ in "ab"]
        held[1][1].write(b"GET /xiaozhi/v1/ HTTP/1.1\r\nHost: bridge\r\n")
        await eventually(lambda: len(guard.pending) == 2)
        try:
            # Past the cap a connection is dropped at accept, without a byte of answer...
            reader, writer = await asyncio.open_connection("127.0.0.1", bridge.websocket.port)
            assert await answer_before_close(reader) == b""
            writer.close()
            # ...a legitimate device's too: no HTTP answer (not even a 4xx) while they wait.
            with pytest.raises((InvalidMessage, OSError)):
                await late.connect()
            assert guard.refused == 2
        finally:
            for _reader, held_writer in held:
                held_writer.close()
        await eventually(lambda: not guard.pending)
        await late.connect()
        await wait_state(bridge, other)
        # The device that was connected all along kept its link.
        assert bridge.registry.get(MAC) is not None and connected.ws is not None
        assert connected.ws.close_code is None
        health = await http.get(bridge.api_url + "/healthz")
        assert health.status_code == 200 and health.json()["devices"] == 2
    finally:
        await late.close()
        await connected.close()


async def test_connections_to_the_ota_listener_are_capped_and_it_recovers(
    bridge_factory: Callable[..., Any], http: httpx.AsyncClient
) -> None:
    bridge: Bridge = await bridge_factory(device_auth="device", device_http_max_connections=3)
    ota = StockOta(http, bridge.provisioning.ota_url, mac=MAC, client_id=CLIENT_ID)
    port = bridge.provisioning.http_port
    # One idle connection: below the cap, a device is served.
    held = [await asyncio.open_connection("127.0.0.1", port)]
    try:
        assert (await ota.check()).status_code == 200
        # As many idle connections as the cap (they never send a request): the next is 503.
        # (uvicorn counts the asking connection too: with cap - 1 held it already is 503.)
        held += [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        refused = await ota.check()
        assert refused.status_code == 503 and refused.text == "Service Unavailable"
        assert refused.headers["connection"] == "close"
    finally:
        for _reader, writer in held:
            writer.close()

    async def served() -> bool:
        return (await ota.check()).status_code == 200

    await eventually_async(served)  # the held connections are gone: served again
    assert "activation" in (await ota.check()).json()
    health = await http.get(bridge.api_url + "/healthz")
    assert health.status_code == 200


async def test_silent_and_slow_connections_to_the_ota_listener_are_closed(
    bridge_factory: Callable[..., Any], http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvicorn alone never closes a socket that sends nothing: a few of them would hold every
    connection slot. Each request's head has a deadline."""
    from backend.provisioning import service

    monkeypatch.setattr(service, "REQUEST_HEAD_S", 0.3)
    bridge: Bridge = await bridge_factory(device_auth="device", device_http_max_connections=3)
    port = bridge.provisioning.http_port
    silent = await asyncio.open_connection("127.0.0.1", port)
    slow = await asyncio.open_connection("127.0.0.1", port)
    slow[1].write(b"POST /xiaozhi/ota/ HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    try:
        for reader, _writer in (silent, slow):
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the bridge
        # A keep-alive client that answers in time is served twice on one connection.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):
            writer.write(b"GET /xiaozhi/ota/ HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200")
            length = re.search(rb"content-length: (\d+)", head.lower())
            assert length is not None
            await reader.readexactly(int(length.group(1)))
        assert await asyncio.wait_for(reader.read(), 10) == b""  # then idle: closed too
        writer.close()
    finally:
        for _reader, writer in (silent, slow):
            writer.close()
    ota = StockOta(http, bridge.provisioning.ota_url, mac=MAC, client_id=CLIENT_ID)
    assert (await ota.check()).status_code == 200


async def test_bad_requests_are_refused_before_anything_is_stored(
    device_bridge: Bridge, http: httpx.AsyncClient
) -> None:
    url = device_bridge.provisioning.ota_url
    headers = stock_headers()
    assert (await http.post(url, content=b"[1, 2]", headers=headers)).status_code == 400
    assert (await http.post(url, content=b"{nope", headers=headers)).status_code == 400
    deep = b"[" * 100_000 + b"]" * 100_000
    assert (await http.post(url, content=deep, headers=headers)).status_code == 413
    big = b'{"x": "' + b"a" * 20_000 + b'"}'
    assert (await http.post(url, content=big, headers=headers)).status_code == 413
    bad_id = {**headers, "Device-Id": "not a mac!"}
    assert (await http.post(url, json={}, headers=bad_id)).status_code == 400
    assert device_bridge.provisioning.store.pending_count == 0
    health = await http.get(url)
    assert health.status_code == 200 and "OTA" in health.text


async def test_credentials_and_pending_codes_survive_a_restart(
    bridge_factory: Callable[..., Any], tmp_path: Any, http: httpx.AsyncClient
) -> None:
    from backend.auth import Tokens

    settings = make_settings(tmp_path / "kept", device_auth="device")
    async with Bridge(settings, Tokens(ADMIN_TOKEN)) as bridge:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as admin:
            token = await approved_token(bridge, http, admin, mac=MAC, client_id=CLIENT_ID)
        waiting = StockOta(http, bridge.provisioning.ota_url, mac="a4:cf:00:00:04:01")
        code = (await waiting.check()).json()["activation"]["code"]
    async with Bridge(settings, Tokens(ADMIN_TOKEN)) as bridge:
        assert await handshake_status(bridge.ws_url, token, MAC) == 101
        url = bridge.provisioning.ota_url
        again = await StockOta(http, url, mac="a4:cf:00:00:04:01").check()
        assert again.json()["activation"]["code"] == code  # what the device still shows
        assert (await StockOta(http, url, mac=MAC).check()).json()["websocket"]["token"] == token


async def test_the_database_with_keys_and_token_hashes_is_readable_by_its_owner_only(
    device_bridge: Bridge,
) -> None:
    import stat

    path = device_bridge.database.path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.with_name(path.name + "-wal").stat().st_mode) == 0o600
