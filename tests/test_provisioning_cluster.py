"""Provisioning with several bridge instances on one database: devices approved, revoked or
activating through one instance are seen by the others (store refresh, read-through, lookups
by Device-Id + Client-Id), every instance derives the same tokens (`device_secret`), and a
cluster without a shared secret does not start.

The store tests run two `ProvisioningStore`s over one database on both engines (SQLite: two
connections to one file, `shared=True`); the bridge tests run two real `Bridge`s on one
PostgreSQL with stock devices over real HTTP and WebSockets on loopback."""

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from backend.config import Settings
from backend.provisioning.store import READ_THROUGH_S, REPLACED, REVOKED, ProvisioningStore
from backend.provisioning.tables import PROVISIONING_MIGRATIONS
from backend.provisioning.tokens import derive_token
from backend.server import Bridge
from backend.storage import Database
from simulator.fleet import SimulatedDevice
from testkit.postgres import postgres_available
from testkit.settings import ADMIN_TOKEN, make_settings
from testkit.stock_device import CLIENT_ID, WireDevice
from tests.helpers import wait_state
from tests.provisioning_helpers import MAC, OTHER_CLIENT, StockOta, handshake_status
from tests.storage_helpers import database_target

__all__ = ["database_target"]

SECRET = b"one secret for every instance"
DEVICE_SECRET = "a-device-secret-every-instance-shares-0123456789"


# ---- two stores on one database (both engines) -------------------------------------------------


class Lost:
    """What `on_lost` heard: (device id, reason)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, device_id: str, reason: str) -> None:
        self.calls.append((device_id, reason))


@pytest.fixture
async def stores(
    database_target: Path | str,
) -> AsyncIterator[tuple[ProvisioningStore, ProvisioningStore, Lost]]:
    """Stores `a` and `b` on one database; `b`'s lost credentials are recorded. No refresh task
    runs (refresh_s is an hour): the tests call `refresh()` themselves."""
    databases = [Database(database_target, PROVISIONING_MIGRATIONS) for _ in range(2)]
    for db in databases:
        await db.open()
    lost = Lost()
    a, b = (
        ProvisioningStore(db, SECRET, shared=True, refresh_s=3600.0, on_lost=on_lost)
        for db, on_lost in zip(databases, (Lost(), lost), strict=True)
    )
    for store in (a, b):
        await store.load()
        store.start()
    try:
        yield a, b, lost
    finally:
        for store in (a, b):
            await store.stop()
        for db in databases:
            await db.close()


async def read_throughs(store: ProvisioningStore) -> None:
    """Wait for the store's background reads (a token check that missed)."""
    await asyncio.gather(*list(store._reads))


async def test_an_approval_elsewhere_is_seen_by_a_refresh_and_by_a_token_miss(
    stores: tuple[ProvisioningStore, ProvisioningStore, Lost],
) -> None:
    a, b, _lost = stores
    device = await a.grant(MAC, CLIENT_ID, by="admin")
    token = a.token(device)
    assert b.token(device) == token  # the same secret: the same token on both
    # b never loaded it: the first check misses and reads the row in the background.
    assert b.refusal(MAC, token) == "invalid device token"
    await read_throughs(b)
    assert b.refusal(MAC, token) is None
    assert b.approved_for(MAC, CLIENT_ID) == device

    second = await a.grant("a4:cf:00:00:00:02", None, by="admin")
    await b.refresh()
    assert b.refusal(second.device_id, a.token(second)) is None


async def test_a_read_through_runs_once_a_second_per_device(
    stores: tuple[ProvisioningStore, ProvisioningStore, Lost],
) -> None:
    _a, b, _lost = stores
    reads: list[str] = []
    current = b._current

    async def counted(device_id: str) -> Any:
        reads.append(device_id)
        return await current(device_id)

    b._current = counted  # type: ignore[method-assign]
    for _ in range(50):  # a flood of bad tokens for one id, and one for another id
        assert b.refusal(MAC, "dtk_wrong") == "invalid device token"
    assert b.refusal("a4:cf:00:00:00:09", "dtk_wrong") == "invalid device token"
    await read_throughs(b)
    assert reads == [MAC, "a4:cf:00:00:00:09"]


async def test_a_revocation_or_reapproval_elsewhere_is_reported_as_lost(
    stores: tuple[ProvisioningStore, ProvisioningStore, Lost],
) -> None:
    a, b, lost = stores
    first = await a.grant(MAC, CLIENT_ID, by="admin")
    other = await a.grant("a4:cf:00:00:00:02", None, by="admin")
    await b.refresh()
    assert lost.calls == []  # new approvals are nothing lost

    again = await a.grant(MAC, CLIENT_ID, by="admin")  # a new generation: the old token dies
    await a.revoke(other.device_id, by="admin")
    await b.refresh()
    assert sorted(lost.calls) == [(other.device_id, REVOKED), (MAC, REPLACED)]
    assert b.refusal(MAC, a.token(first)) is not None
    assert b.refusal(MAC, a.token(again)) is None
    assert b.refusal(other.device_id, a.token(other)) is not None
    await b.refresh()
    assert len(lost.calls) == 2  # reported once


async def test_an_operator_action_on_a_stale_instance_reads_the_row_first(
    stores: tuple[ProvisioningStore, ProvisioningStore, Lost],
) -> None:
    a, b, _lost = stores
    await a.grant(MAC, CLIENT_ID, by="admin")
    revoked = await b.revoke(MAC, by="operator on b")  # b never refreshed
    assert revoked.status == "revoked" and revoked.generation == 1
    regranted = await a.grant(MAC, CLIENT_ID, by="admin")
    assert regranted.generation == 2  # a read b's revocation before it approved again
    assert a.refusal(MAC, derive_token(SECRET, MAC, 2)) is None


async def test_pending_requests_are_the_same_on_both_and_approved_on_either(
    stores: tuple[ProvisioningStore, ProvisioningStore, Lost],
) -> None:
    a, b, _lost = stores
    asked: dict[str, Any] = {"serial_number": None, "remote": "192.0.2.1", "info": {}}
    first = await a.request_activation(MAC, CLIENT_ID, **asked)
    # b never refreshed: it finds the request by Device-Id + Client-Id, same code.
    again = await b.request_activation(MAC, CLIENT_ID, **asked)
    assert again.code == first.code
    assert (await b.find_pending(MAC, CLIENT_ID)) is not None
    stranger = await b.request_activation(MAC, OTHER_CLIENT, **asked)
    assert stranger.code != first.code

    await a.refresh()
    assert {p.code for p in a.pending()} == {first.code, stranger.code}
    device = await b.approve(first.code, by="operator on b")
    assert device.client_id == CLIENT_ID
    await a.refresh()
    assert a.pending() == [] and a.approved_for(MAC, CLIENT_ID) == device
    assert await a.find_pending(MAC, OTHER_CLIENT) is None  # an approval ends every candidate


async def test_a_request_seen_elsewhere_is_approved_on_a_stale_instance(
    stores: tuple[ProvisioningStore, ProvisioningStore, Lost],
) -> None:
    a, b, _lost = stores
    request = await a.request_activation(
        MAC, CLIENT_ID, serial_number=None, remote="192.0.2.1", info={}
    )
    device = await b.approve(request.code, by="operator on b")
    assert device.device_id == MAC
    assert await a.lookup_approved(MAC, CLIENT_ID) == device  # a's miss reads the row


async def test_a_refresh_keeps_local_requests_not_written_yet_and_drops_deleted_ones(
    stores: tuple[ProvisioningStore, ProvisioningStore, Lost],
) -> None:
    a, b, _lost = stores
    asked: dict[str, Any] = {"serial_number": None, "remote": "192.0.2.1", "info": {}}
    written = await a.request_activation(MAC, CLIENT_ID, **asked)
    await b.refresh()
    assert [p.code for p in b.pending()] == [written.code]
    # a local request that is not written yet (a's write-behind) survives b's refresh
    local = b._pending.request(
        "a4:cf:00:00:00:03", CLIENT_ID, serial_number=None, remote="192.0.2.2", info={}
    )
    b._mark(local.code)
    # a's request goes elsewhere (approved on a), b's refresh drops it
    await a.approve(written.code, by="admin")
    await b.refresh()
    assert [p.code for p in b.pending()] == [local.code]
    await b.flush()
    await a.refresh()
    assert [p.code for p in a.pending()] == [local.code]


async def test_an_enrollment_code_from_one_instance_is_used_up_across_both(
    stores: tuple[ProvisioningStore, ProvisioningStore, Lost],
) -> None:
    a, b, _lost = stores
    _enrollment, code = await a.create_enrollment("fleet", uses=2)
    on_b = await b.lookup_enrollment(code)  # b reads the code it never loaded
    on_a = a.enrollment(code)
    assert on_a is not None and on_b is not None
    assert await a.use_enrollment(on_a)
    assert await b.use_enrollment(on_b)  # b's memory says 2 uses left; the database says 1
    assert not await a.use_enrollment(on_a)
    assert a.enrollment(code) is None
    await b.refresh()
    assert b.enrollment(code) is None


async def test_serial_keys_from_one_instance_are_seen_by_the_other(
    stores: tuple[ProvisioningStore, ProvisioningStore, Lost],
) -> None:
    a, b, _lost = stores
    await a.set_serial_key("SN1", bytes(32))
    await b.refresh()
    assert b.serial_numbers() == ["SN1"]
    await b.remove_serial_key("SN1")
    await a.refresh()
    assert a.serial_numbers() == []


# ---- two bridges on one PostgreSQL ---------------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


def admin_of(bridge: Bridge) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=10)


@pytest.fixture
async def pair(
    bridge_factory: Callable[..., Any], request: pytest.FixtureRequest
) -> tuple[Bridge, Bridge]:
    """Bridges `a` and `b` on one PostgreSQL with per-device auth and one device secret; `a`
    sends devices to `b`'s WebSocket (as a balancer might)."""
    if not postgres_available():
        pytest.skip("PostgreSQL is not installed (scripts/test installs it)")
    postgres_url: str = request.getfixturevalue("postgres_url")
    shared = {"device_auth": "device", "database_url": postgres_url, "device_secret": DEVICE_SECRET}
    b: Bridge = await bridge_factory(**shared)
    a: Bridge = await bridge_factory(ota_websocket_url=b.ws_url, **shared)
    return a, b


async def test_a_device_approved_through_one_instance_connects_to_the_other(
    pair: tuple[Bridge, Bridge],
) -> None:
    a, b = pair
    device = SimulatedDevice("", None, index=7, ota_url=a.provisioning.ota_url, ota_poll_s=0.2)
    device.start()
    try:
        async with admin_of(a) as admin:
            code: list[str] = []

            async def pending_code() -> None:
                listed = (await admin.get("/api/provisioning/pending")).json()["pending"]
                code.extend(p["code"] for p in listed if p["device_id"] == device.device_id)

            async with asyncio.timeout(10):
                while not code:
                    await pending_code()
                    await asyncio.sleep(0.05)
            approved = await admin.post("/api/provisioning/approve", json={"target": code[0]})
            assert approved.status_code == 200
        ready = await wait_state(b, device.device_id, timeout_s=10)
        assert ready.transport == "websocket"
        assert a.registry.get(device.device_id) is None  # it is b's (no cluster: b's alone)
    finally:
        await device.stop()


async def test_a_device_revoked_through_one_instance_is_closed_and_refused_by_the_other(
    pair: tuple[Bridge, Bridge], http: httpx.AsyncClient
) -> None:
    a, b = pair
    ota = StockOta(http, a.provisioning.ota_url, mac=MAC, client_id=CLIENT_ID)
    code = (await ota.check()).json()["activation"]["code"]
    async with admin_of(a) as admin:
        assert (await admin.post("/api/provisioning/approve", json={"target": code})).is_success
        token = (await ota.check()).json()["websocket"]["token"]
        wire = WireDevice(b.ws_url, token, MAC)
        await eventually_admitted(b, token)
        await wire.connect()
        try:
            await wait_state(b, MAC)
            link = wire.ws
            assert link is not None
            revoked = await admin.post(f"/api/provisioning/devices/{MAC}/revoke")
            assert revoked.status_code == 200
            refresh_s = b.provisioning.store.refresh_s
            assert refresh_s is not None
            async with asyncio.timeout(refresh_s + 3):  # b's next refresh sees it
                await link.wait_closed()
            assert link.close_code == 1008 and link.close_reason == REVOKED
        finally:
            await wire.close()
    assert b.registry.get(MAC) is None
    assert await handshake_status(b.ws_url, token, MAC) == 401


async def eventually_admitted(bridge: Bridge, token: str) -> None:
    """The bridge admits the token (a first miss reads the row in the background)."""
    async with asyncio.timeout(5):
        while await handshake_status(bridge.ws_url, token, MAC) != 101:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_both_instances_give_the_same_code_and_either_approves_it(
    pair: tuple[Bridge, Bridge], http: httpx.AsyncClient
) -> None:
    a, b = pair
    on_a = StockOta(http, a.provisioning.ota_url, mac=MAC, client_id=CLIENT_ID)
    on_b = StockOta(http, b.provisioning.ota_url, mac=MAC, client_id=CLIENT_ID)
    code = (await on_a.check()).json()["activation"]["code"]
    assert (await on_b.check()).json()["activation"]["code"] == code
    polled = await on_b.activate()
    assert polled.status_code == 202 and polled.json()["code"] == code
    async with admin_of(b) as admin:
        approved = await admin.post("/api/provisioning/approve", json={"target": code})
    assert approved.status_code == 200 and approved.json()["device_id"] == MAC
    # a's next poll past the read-through bound (1 s a device) reads the device's row
    async with asyncio.timeout(READ_THROUGH_S + 3):
        while (await on_a.activate()).status_code != 200:  # noqa: ASYNC110 - polled over HTTP
            await asyncio.sleep(0.1)
    token_a = (await on_a.check()).json()["websocket"]["token"]
    token_b = (await on_b.check()).json()["websocket"]["token"]
    assert token_a == token_b  # one device secret: OTA checks on either never flip the token
    stored = b.provisioning.store.device(MAC)
    assert stored is not None and stored.generation == 1
    await eventually_admitted(a, token_a)
    assert await handshake_status(b.ws_url, token_a, MAC) == 101


async def test_b_lists_a_request_first_seen_on_a(
    pair: tuple[Bridge, Bridge], http: httpx.AsyncClient
) -> None:
    a, b = pair
    code = (await StockOta(http, a.provisioning.ota_url, mac=MAC).check()).json()["activation"]
    async with admin_of(b) as admin:

        async def listed() -> list[str]:
            pending = (await admin.get("/api/provisioning/pending")).json()["pending"]
            return [p["code"] for p in pending]

        refresh_s = b.provisioning.store.refresh_s
        assert refresh_s is not None
        async with asyncio.timeout(refresh_s + 3):
            while await listed() != [code["code"]]:  # noqa: ASYNC110 - polled over HTTP
                await asyncio.sleep(0.05)


# ---- configuration -------------------------------------------------------------------------------


CLUSTER = {
    "cluster_url": "mqtt://a:pw@127.0.0.1:1883",
    "database_url": "postgresql://bridge@127.0.0.1/bridge",
}


def test_a_cluster_with_device_auth_needs_a_device_secret(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"needs device_secret .* same device tokens"):
        make_settings(tmp_path, device_auth="device", **CLUSTER)
    with pytest.raises(ValidationError, match="needs device_secret"):
        make_settings(tmp_path, device_auth="device", device_secret=" ", **CLUSTER)
    settings = make_settings(tmp_path, device_auth="device", device_secret="s3cret", **CLUSTER)
    assert settings.device_secret is not None
    assert "s3cret" not in repr(settings)
    make_settings(tmp_path, device_auth="shared", **CLUSTER)  # shared mode: no derived tokens
    make_settings(tmp_path, device_auth="device")  # one instance: the data dir's file


def test_a_cluster_with_mqtt_needs_an_mqtt_secret_when_passwords_are_derived(
    tmp_path: Path,
) -> None:
    mqtt = {"mqtt_url": "mqtt://127.0.0.1:1883", **CLUSTER}
    with pytest.raises(ValidationError, match=r"needs mqtt_secret .* broker passwords"):
        make_settings(tmp_path, device_auth="shared", **mqtt)
    make_settings(tmp_path, device_auth="shared", mqtt_secret="m", **mqtt)
    # per-device auth: the broker password is the device's token (device_secret)
    make_settings(tmp_path, device_auth="device", device_secret="s", **mqtt)


def test_the_device_secret_replaces_the_data_dir_file(tmp_path: Path) -> None:
    from backend.provisioning.service import credential_secret
    from backend.provisioning.tokens import SECRET_FILE

    created: list[Path] = []
    settings = make_settings(tmp_path, device_secret=DEVICE_SECRET)
    assert credential_secret(settings, created) == DEVICE_SECRET
    assert created == [] and not (tmp_path / SECRET_FILE).exists()
    from_file = credential_secret(make_settings(tmp_path), created)
    assert created == [tmp_path / SECRET_FILE] and from_file != DEVICE_SECRET


def test_the_environment_sets_the_device_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BRIDGE_DEVICE_SECRET", DEVICE_SECRET)
    settings = Settings(data_dir=tmp_path)
    assert settings.device_secret is not None
    assert settings.device_secret.get_secret_value() == DEVICE_SECRET
