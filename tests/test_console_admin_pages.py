"""The console's admin pages in Chromium (tests/console_helpers.py): keys (create with the scope
picker, the token shown once, revoke with a confirm step), activations (a stock device waiting
with its code, approved by that code, a request rejected) and the audit log (filters, paging),
each at desktop and phone sizes, by keyboard, with axe, and a key without the scope seeing the
action disabled while the API refuses it. Then the API routes those pages added, with bad input.
A real bridge on loopback; real simulated devices and a stock device's OTA requests."""

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, expect

from backend.keys import Scope
from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN
from testkit.stock_device import CLIENT_ID
from tests.console_helpers import (
    DESKTOP,
    PHONE,
    SIZES,
    admin,
    assert_accessible,
    console_page,
    http,
    tab_to,
)
from tests.helpers import create_key
from tests.provisioning_helpers import MAC, StockOta

# The admin API client fixture (tests/console_helpers.py).
__all__ = ["admin"]

pytestmark = pytest.mark.timeout(180)

SET_VOLUME = "self.audio_speaker.set_volume"
REBOOT = "self.reboot"
OTHER_MAC = "a4:cf:12:34:56:99"
OTHER_CLIENT = "0f8e2c61-1b7a-4c3e-9a55-7d2e0c9b1a44"
# A day ago, as a datetime-local input takes it (the browser's own time zone).
YESTERDAY = """() => {
  const d = new Date(Date.now() - 86400000);
  const p = (n) => String(n).padStart(2, "0");
  const day = `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())}`;
  return `${day}T${p(d.getHours())}:${p(d.getMinutes())}`;
}"""


def key_row(page: Page, key_id: str) -> Any:
    return page.locator(f'tr[data-key-id="{key_id}"]')


# ---- keys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("viewport", SIZES)
async def test_keys_page_creates_a_key_that_works_then_revokes_it(
    bridge: Bridge, viewport: dict[str, int]
) -> None:
    await create_key(bridge, "chat:use")  # one already there
    async with console_page(bridge, "/keys", ADMIN_TOKEN, viewport=viewport) as console:
        page = console.page
        await expect(page.locator("#keys-status")).to_have_text("1 active, 1 in all")
        await expect(page.locator("tbody tr")).to_contain_text(["test chat:use"])
        # The picker offers the bridge's real scopes.
        for scope in Scope:
            await expect(page.get_by_role("checkbox", name=str(scope), exact=True)).to_be_visible()
        await page.get_by_label("Name").fill("reader tablet")
        await page.get_by_role("checkbox", name="devices:read", exact=True).check()
        await page.get_by_role("button", name="Create key").click()
        await expect(page.locator("#new-key-title")).to_be_focused()
        token = await page.locator("#new-key-token").input_value()
        assert token.startswith("esk_")
        await page.get_by_role("button", name="Copy", exact=True).click()
        await expect(page.locator("#copy-status")).not_to_be_empty()
        listed = [key for key in await bridge.frontends.keys.list() if key.name == "reader tablet"]
        assert len(listed) == 1 and sorted(listed[0].scopes) == ["devices:read"]
        key_id = listed[0].id
        await expect(key_row(page, key_id)).to_contain_text("devices:read")
        await expect(page.locator("#keys-status")).to_have_text("2 active, 2 in all")
        await assert_accessible(page)
        async with http(bridge, token) as client:  # the new key works, with its scope only
            assert (await client.get("/api/devices")).status_code == 200
            assert (await client.get("/api/keys")).status_code == 403

        # Revoke: a confirm step first, then the key is refused.
        await key_row(page, key_id).get_by_role("button", name="Revoke key reader tablet").click()
        confirm = key_row(page, key_id).get_by_role("button", name="Yes, revoke reader tablet")
        await expect(confirm).to_be_focused()
        await assert_accessible(page)
        await confirm.click()
        await expect(key_row(page, key_id)).to_have_count(0)  # revoked keys hidden by default
        await page.get_by_label("Show revoked keys").check()
        await expect(key_row(page, key_id)).to_contain_text("revoked")
        async with http(bridge, token) as client:
            assert (await client.get("/api/devices")).status_code == 401
        console.assert_clean()


async def test_keys_page_by_keyboard_only(bridge: Bridge) -> None:
    async with console_page(bridge, "/keys", ADMIN_TOKEN) as console:
        page = console.page
        await expect(page.locator("#keys-status")).to_have_text("0 active, 0 in all")
        await tab_to(page, "#key-name")
        await page.keyboard.type("keyboard key")
        await page.keyboard.press("Tab")  # the first scope: chat:use
        await expect(page.get_by_role("checkbox", name="chat:use", exact=True)).to_be_focused()
        await page.keyboard.press("Space")
        await page.keyboard.press("Shift+Tab")
        await page.keyboard.press("Enter")  # submits the form
        await expect(page.locator("#new-key-title")).to_be_focused()
        key_id = (await bridge.frontends.keys.list())[0].id
        await tab_to(page, f'tr[data-key-id="{key_id}"] button')
        await page.keyboard.press("Enter")
        await expect(page.get_by_role("button", name="Yes, revoke keyboard key")).to_be_focused()
        await page.keyboard.press("Escape")  # back out, focus back on Revoke
        await expect(key_row(page, key_id).get_by_role("button", name="Revoke")).to_be_focused()
        await page.keyboard.press("Enter")
        await page.keyboard.press("Enter")
        await expect(key_row(page, key_id)).to_have_count(0)
        assert not (await bridge.frontends.keys.list(include_revoked=False))
        console.assert_clean()


async def test_keys_page_without_admin_has_its_actions_disabled(bridge: Bridge) -> None:
    key = await create_key(bridge, "devices:read")
    async with console_page(bridge, "/keys", key, viewport=PHONE) as console:
        page = console.page
        await expect(page.locator("#keys-denied")).to_contain_text("lacks the admin scope")
        await expect(page.get_by_role("button", name="Create key")).to_be_disabled()
        await expect(page.get_by_role("checkbox", name="admin", exact=True)).to_be_disabled()
        await expect(page.get_by_role("navigation", name="Console")).not_to_contain_text("Keys")
        await assert_accessible(page)
        console.assert_clean()
    async with http(bridge, key) as client:
        created = await client.post("/api/keys", json={"name": "x", "scopes": ["admin"]})
        assert created.status_code == 403 and created.json()["error"]["code"] == "forbidden"
        assert (await client.get("/api/keys")).status_code == 403
        assert (await client.delete("/api/keys/000000000000")).status_code == 403


# ---- activations --------------------------------------------------------------------------------


@pytest.fixture
async def device_bridge(bridge_factory: Callable[..., Any]) -> Bridge:
    bridge: Bridge = await bridge_factory(device_auth="device")
    return bridge


async def waiting_device(
    bridge: Bridge, client: httpx.AsyncClient, **device: Any
) -> tuple[StockOta, str]:
    """A stock device that asked the OTA URL, and the code it shows."""
    ota = StockOta(client, bridge.provisioning.ota_url, **device)
    answer = (await ota.check()).json()
    return ota, answer["activation"]["code"]


@pytest.mark.parametrize("viewport", SIZES)
async def test_activations_page_approves_a_waiting_device_by_its_code(
    device_bridge: Bridge, viewport: dict[str, int]
) -> None:
    bridge = device_bridge
    async with httpx.AsyncClient(timeout=10) as plain:
        ota, code = await waiting_device(bridge, plain, mac=MAC, client_id=CLIENT_ID)
        async with console_page(bridge, "/activations", ADMIN_TOKEN, viewport=viewport) as console:
            page = console.page
            row = page.locator(f'tr[data-code="{code}"]')
            await expect(row).to_contain_text(MAC)
            await expect(row).to_contain_text("bread-compact-wifi")
            await expect(page.locator("#pending-status")).to_have_text("1 device waiting")
            if viewport is DESKTOP:
                await expect(row).to_contain_text(CLIENT_ID)
                await expect(row).to_contain_text("127.0.0.1")
            await assert_accessible(page)
            # Keyboard only: Tab to the code field, type what the device shows, Enter.
            await tab_to(page, "#approve-code")
            await page.keyboard.type(code)
            await page.keyboard.press("Enter")
            await expect(page.locator("#approve-result")).to_contain_text(f"Approved {MAC}")
            await expect(row).to_have_count(0)
            await expect(page.locator("#pending-status")).to_contain_text("No device is waiting")
            approved = page.locator(f'#approved-list tr[data-device-id="{MAC}"]')
            await expect(approved).to_contain_text("approved")
            # The device now gets its credentials.
            answer = (await ota.check()).json()
            assert answer["websocket"]["token"].startswith("dtk_")
            await assert_accessible(page)
            console.assert_clean()


async def test_activations_page_rejects_a_request_and_revokes_a_device(
    device_bridge: Bridge,
) -> None:
    bridge = device_bridge
    async with httpx.AsyncClient(timeout=10) as plain, http(bridge) as admin:
        _, first = await waiting_device(bridge, plain, mac=MAC, client_id=CLIENT_ID)
        second, code = await waiting_device(bridge, plain, mac=OTHER_MAC, client_id=OTHER_CLIENT)
        approved = await admin.post("/api/provisioning/approve", json={"target": first})
        assert approved.status_code == 200
        async with console_page(bridge, "/activations", ADMIN_TOKEN, viewport=PHONE) as console:
            page = console.page
            row = page.locator(f'tr[data-code="{code}"]')
            await row.get_by_role("button", name=f"Reject request {code}").click()
            yes = row.get_by_role("button", name=f"Yes, reject {code}")
            await expect(yes).to_be_focused()
            await yes.click()
            await expect(row).to_have_count(0)
            assert (await admin.get("/api/provisioning/pending")).json()["pending"] == []
            device = page.locator(f'#approved-list tr[data-device-id="{MAC}"]')
            await device.get_by_role("button", name=f"Revoke device {MAC}").click()
            await device.get_by_role("button", name=f"Yes, revoke {MAC}").click()
            await expect(device).to_contain_text("revoked")
            await expect(device.get_by_role("button")).to_have_count(0)
            console.assert_clean()
        # The rejected device polls again: a new code, waiting again.
        again = (await second.check()).json()["activation"]["code"]
        assert again != code


async def test_activations_page_without_admin_has_its_actions_disabled(
    device_bridge: Bridge,
) -> None:
    bridge = device_bridge
    key = await create_key(bridge, "devices:read", "devices:call")
    async with httpx.AsyncClient(timeout=10) as plain:
        _, code = await waiting_device(bridge, plain, mac=MAC, client_id=CLIENT_ID)
    async with console_page(bridge, "/activations", key) as console:
        page = console.page
        await expect(page.locator("#activations-denied")).to_contain_text("lacks the admin scope")
        await expect(page.get_by_role("button", name="Approve")).to_be_disabled()
        await expect(page.get_by_label("Code the device shows")).to_be_disabled()
        await expect(page.get_by_role("navigation", name="Console")).not_to_contain_text(
            "Activations"
        )
        await assert_accessible(page)
        console.assert_clean()
    async with http(bridge, key) as client:
        for response in (
            await client.get("/api/provisioning/pending"),
            await client.post("/api/provisioning/approve", json={"target": code}),
            await client.delete(f"/api/provisioning/pending/{code}"),
            await client.post(f"/api/provisioning/devices/{MAC}/revoke"),
        ):
            assert response.status_code == 403, response.text
            assert response.json()["error"]["code"] == "forbidden"
    assert [p.code for p in bridge.provisioning.store.pending()] == [code]


# ---- audit --------------------------------------------------------------------------------------


async def make_calls(bridge: Bridge, device_id: str, volumes: int, reboots: int = 0) -> None:
    """Real tool calls through the API: `volumes` ok calls, `reboots` refused ones (a risky tool
    without its confirmation)."""
    async with http(bridge) as admin:
        path = f"/api/devices/{device_id}/tools/call"
        for volume in range(volumes):
            body = {"name": SET_VOLUME, "arguments": {"volume": volume}}
            assert (await admin.post(path, json=body)).status_code == 200
        for _ in range(reboots):
            assert (await admin.post(path, json={"name": REBOOT})).status_code == 428
    await bridge.audit.flush()


def audit_rows(page: Page) -> Any:
    return page.locator("#audit-results tbody tr")


@pytest.mark.parametrize("viewport", SIZES)
async def test_audit_page_filters_and_pages(
    bridge: Bridge, simulated_devices: Callable[..., Any], viewport: dict[str, int]
) -> None:
    first = await simulated_devices(bridge, 1)
    second = await simulated_devices(bridge, 2)
    await make_calls(bridge, first.device_id, 30, reboots=2)
    await make_calls(bridge, second.device_id, 3)
    async with console_page(bridge, "/audit", ADMIN_TOKEN, viewport=viewport) as console:
        page = console.page
        status = page.locator("#audit-status")
        await expect(status).to_have_text("Page 1: rows 1–35 (the last page)")
        await expect(audit_rows(page)).to_have_count(35)
        await expect(audit_rows(page).first).to_contain_text(SET_VOLUME)  # newest first
        # 25 rows a page: Older moves on, Newer back.
        await page.get_by_label("Rows per page").select_option("25")
        await page.get_by_role("button", name="Show").click()
        await expect(status).to_have_text("Page 1: rows 1–25")
        newest = await audit_rows(page).first.get_attribute("data-id")
        await page.get_by_role("button", name="Older").click()
        await expect(status).to_have_text("Page 2: rows 26–35 (the last page)")
        await expect(audit_rows(page)).to_have_count(10)
        await expect(page.get_by_role("button", name="Older")).to_be_disabled()
        await page.get_by_role("button", name="Newer").click()
        await expect(status).to_have_text("Page 1: rows 1–25")
        await expect(audit_rows(page).first).to_have_attribute("data-id", newest or "")
        await assert_accessible(page)
        # By device: only its rows.
        await page.get_by_label("Device id").fill(second.device_id)
        await page.get_by_role("button", name="Show").click()
        await expect(status).to_have_text("Page 1: rows 1–3 (the last page)")
        assert set(
            await audit_rows(page).evaluate_all("rows => rows.map(r => r.dataset.deviceId)")
        ) == {second.device_id}
        # By outcome: the refused reboots of the first device.
        await page.get_by_label("Device id").fill("")
        await page.get_by_label("Outcome").select_option("refused")
        await page.get_by_role("button", name="Show").click()
        await expect(audit_rows(page)).to_have_count(2)
        await expect(audit_rows(page).first).to_contain_text(REBOOT)
        await expect(audit_rows(page).first).to_contain_text(first.device_id)
        assert "outcome=refused" in page.url  # the filtered view can be linked
        # By time: nothing until yesterday, everything from yesterday on.
        yesterday = await page.evaluate(YESTERDAY)
        await page.get_by_label("Outcome").select_option("")
        await page.get_by_label("Until").fill(yesterday)
        await page.get_by_role("button", name="Show").click()
        await expect(status).to_have_text("No row matches these filters.")
        await page.get_by_label("Until").fill("")
        await page.get_by_label("From").fill(yesterday)
        await page.get_by_role("button", name="Show").click()
        await expect(status).to_have_text("Page 1: rows 1–25")
        await assert_accessible(page)
        console.assert_clean()


async def test_audit_page_by_keyboard_only(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    first = await simulated_devices(bridge, 1)
    second = await simulated_devices(bridge, 2)
    await make_calls(bridge, first.device_id, 2)
    await make_calls(bridge, second.device_id, 1)
    async with console_page(bridge, "/audit", ADMIN_TOKEN) as console:
        page = console.page
        await expect(audit_rows(page)).to_have_count(3)
        await tab_to(page, "#filter-device")
        await page.keyboard.type(first.device_id)
        await page.keyboard.press("Enter")
        await expect(page.locator("#audit-status")).to_have_text("Page 1: rows 1–2 (the last page)")
        await expect(audit_rows(page)).to_have_count(2)
        console.assert_clean()


async def test_audit_page_scopes(bridge: Bridge, simulated_devices: Callable[..., Any]) -> None:
    device = await simulated_devices(bridge, 1)
    await make_calls(bridge, device.device_id, 2)
    chat_key = await create_key(bridge, "chat:use")
    async with console_page(bridge, "/audit", chat_key) as console:
        page = console.page
        await expect(page.locator("#audit-denied")).to_contain_text("cannot read the audit log")
        await expect(page.get_by_role("button", name="Show")).to_be_disabled()
        await assert_accessible(page)
        console.assert_clean()
    async with http(bridge, chat_key) as client:
        refused = await client.get("/api/audit")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
        assert (
            await client.get("/api/audit", params={"device_id": device.device_id})
        ).status_code == 403
    # A devices:read key reads one device it covers at a time; the whole log stays admin's.
    reader = await create_key(bridge, "devices:read")
    async with console_page(bridge, "/audit", reader, viewport=PHONE) as console:
        page = console.page
        await expect(page.locator("#audit-device-only")).to_be_visible()
        await expect(audit_rows(page)).to_have_count(0)  # nothing asked without a device
        await page.get_by_label("Device id").fill(device.device_id)
        await page.get_by_role("button", name="Show").click()
        await expect(audit_rows(page)).to_have_count(2)
        console.assert_clean()
    async with http(bridge, reader) as client:
        assert (await client.get("/api/audit")).status_code == 403
        assert (
            await client.get("/api/audit", params={"device_id": device.device_id})
        ).status_code == 200


# ---- the API routes the pages added -----------------------------------------------------------


async def test_key_scopes_route_lists_every_scope(bridge: Bridge, admin: httpx.AsyncClient) -> None:
    listed = (await admin.get("/api/scopes")).json()
    assert [scope["name"] for scope in listed["scopes"]] == [str(scope) for scope in Scope]
    assert all(scope["description"] for scope in listed["scopes"])
    chat_key = await create_key(bridge, "chat:use")  # any key may read the names
    async with http(bridge, chat_key) as client:
        assert (await client.get("/api/scopes")).status_code == 200
    async with http(bridge, None) as client:
        assert (await client.get("/api/scopes")).status_code == 401


@pytest.mark.parametrize(
    "params, param",
    [
        ({"outcome": "fine"}, "outcome"),
        ({"since": "yesterday"}, "since"),
        ({"until": 12.5e99}, "until"),
        ({"until": 0.5}, "until"),  # not Unix seconds
        ({"since": "2026-11-29"}, "since"),  # a date without its time
        ({"since": "2026-11-29T15:30:00"}, "since"),  # no zone
        ({"limit": 0}, "limit"),
        ({"limit": "many"}, "limit"),
        ({"before": "x"}, "before"),
        ({"device_id": ""}, "device_id"),
    ],
)
async def test_audit_bad_query_is_422_naming_the_parameter(
    admin: httpx.AsyncClient, params: dict[str, Any], param: str
) -> None:
    response = await admin.get("/api/audit", params=params)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"]


async def test_audit_time_range_and_outcome(
    bridge: Bridge, admin: httpx.AsyncClient, simulated_devices: Callable[..., Any]
) -> None:
    device = await simulated_devices(bridge, 1)
    await make_calls(bridge, device.device_id, 3, reboots=1)
    entries = (await admin.get("/api/audit")).json()["entries"]
    assert len(entries) == 4
    oldest = datetime.fromisoformat(entries[-1]["at"])
    newest = datetime.fromisoformat(entries[0]["at"])
    second = timedelta(seconds=1)

    async def between(**bounds: datetime) -> list[int]:
        query = {name: moment.isoformat() for name, moment in bounds.items()}
        return [e["id"] for e in (await admin.get("/api/audit", params=query)).json()["entries"]]

    everything = [e["id"] for e in entries]
    assert await between(since=oldest - second) == everything
    assert await between(since=newest + second) == []
    assert await between(until=oldest - second) == []
    assert await between(since=oldest - second, until=newest + second) == everything
    refused = (await admin.get("/api/audit", params={"outcome": "refused"})).json()
    assert [e["tool"] for e in refused["entries"]] == [REBOOT] and refused["next_before"] is None
    paged = (await admin.get("/api/audit", params={"limit": 3})).json()
    assert len(paged["entries"]) == 3 and paged["next_before"] == paged["entries"][-1]["id"]
    rest = (
        await admin.get("/api/audit", params={"limit": 3, "before": paged["next_before"]})
    ).json()
    assert [e["id"] for e in rest["entries"]] == [entries[-1]["id"]]
    backwards = await admin.get(
        "/api/audit", params={"since": newest.isoformat(), "until": oldest.isoformat()}
    )
    assert backwards.status_code == 200 and backwards.json()["entries"] == []  # an empty range
    zoned = await admin.get("/api/audit", params={"until": "2000-01-01T00:00:00+02:00"})
    assert zoned.status_code == 200 and zoned.json()["entries"] == []


async def test_reject_pending_errors(device_bridge: Bridge) -> None:
    async with http(device_bridge) as admin:
        unknown = await admin.delete("/api/provisioning/pending/123456")
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "unknown_activation"
        assert "123456" in unknown.json()["error"]["message"]
        malformed = await admin.delete("/api/provisioning/pending/abc")
        assert malformed.status_code == 422 and malformed.json()["error"]["param"] == "code"
        async with httpx.AsyncClient(timeout=10) as plain:
            _, code = await waiting_device(device_bridge, plain, mac=MAC, client_id=CLIENT_ID)
        rejected = await admin.delete(f"/api/provisioning/pending/{code}")
        assert rejected.status_code == 200 and rejected.json()["device_id"] == MAC
        assert (await admin.delete(f"/api/provisioning/pending/{code}")).status_code == 404
        approve = await admin.post("/api/provisioning/approve", json={"target": code})
        assert approve.status_code == 404


@pytest.mark.parametrize(
    "body, param",
    [
        ({"name": 5, "scopes": ["chat:use"]}, "name"),
        ({"name": "x", "scopes": "chat:use"}, "scopes"),
        ({"name": "x", "scopes": ["root"]}, "scopes"),
        ({"name": "x", "scopes": []}, "scopes"),
        ({"name": "x", "scopes": ["chat:use"], "device_ids": "a4:cf"}, "device_ids"),
    ],
)
async def test_key_creation_bad_body_is_422_naming_the_field(
    admin: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    response = await admin.post("/api/keys", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == param


async def test_revoking_an_unknown_key_is_404(admin: httpx.AsyncClient) -> None:
    response = await admin.delete("/api/keys/000000000000")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_key"
