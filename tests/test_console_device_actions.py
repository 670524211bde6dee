"""A device's name, notes, revoking and forgetting in the devices page's detail (device-actions.js)
in Chromium: saved and shown again after a reload, revoke and forget each behind a confirm step
(forget only for an offline device), disabled with the reason for a key without admin, by
keyboard, at desktop and phone sizes, with axe, and in Vietnamese."""

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, expect

from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from testkit.stock_device import CLIENT_ID, WireDevice, stock_tools
from tests.console_helpers import DESKTOP, PHONE, assert_accessible, console_page
from tests.helpers import create_key, eventually
from tests.provisioning_helpers import MAC, StockOta

pytestmark = pytest.mark.timeout(180)

SIZES = [pytest.param(DESKTOP, id="desktop"), pytest.param(PHONE, id="phone")]
OFFLINE = "a4:cf:00:00:00:99"


def row(page: Page, device_id: str) -> Any:
    return page.locator(f'tr[data-device-id="{device_id}"]')


async def open_device(page: Page, device_id: str) -> None:
    await row(page, device_id).get_by_role("button", name=device_id).click()
    await expect(page.get_by_role("heading", level=2, name=device_id)).to_be_focused()
    await page.locator("#device-actions").wait_for()


async def offline_device(bridge: Bridge, mac: str = OFFLINE) -> str:
    """A device that was seen and left: remembered, offline."""
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN, mac, tools=stock_tools())
    await device.connect()
    await bridge.registry.wait_for_state(device.device_id)
    await device.close()
    await eventually(lambda: bridge.registry.get(device.device_id) is None)
    return device.device_id


@pytest.mark.parametrize("viewport", SIZES)
async def test_name_and_notes_are_saved_and_shown_after_a_reload_then_forget(
    bridge: Bridge, simulated_devices: Callable[..., Any], viewport: dict[str, int]
) -> None:
    live = (await simulated_devices(bridge)).device_id
    gone = await offline_device(bridge)
    async with console_page(bridge, "/devices", ADMIN_TOKEN, viewport=viewport) as console:
        page = console.page
        await open_device(page, live)
        name, notes = page.get_by_label("Display name"), page.get_by_label("Notes", exact=True)
        await expect(name).to_have_value("")
        await name.fill("Kitchen <b>speaker</b>")
        await notes.fill("On the fridge.\nBatteries changed in March.")
        await page.get_by_role("button", name="Save name and notes").click()
        await expect(page.locator("#device-notes-status")).to_have_text("Name and notes saved.")
        # A live device cannot be forgotten: the button says why.
        forget = page.get_by_role("button", name="Forget device")
        await expect(forget).to_be_disabled()
        await expect(page.locator("#device-forget-reason")).to_contain_text("connected now")
        await assert_accessible(page)

        await page.reload()
        await open_device(page, live)
        await expect(page.get_by_label("Display name")).to_have_value("Kitchen <b>speaker</b>")
        await expect(page.get_by_label("Notes", exact=True)).to_have_value(
            "On the fridge.\nBatteries changed in March."
        )
        assert bridge.registry.summary(live)["name"] == "Kitchen <b>speaker</b>"
        assert await page.locator("#device-detail b").count() == 0  # text, never markup

        # Forget the offline one: a confirm step, Cancel backs out, then it leaves the list.
        await open_device(page, gone)
        forget = page.get_by_role("button", name="Forget device")
        await expect(forget).to_be_enabled()
        await forget.click()
        yes = page.get_by_role("button", name=f"Yes, forget {gone}")
        await expect(yes).to_be_focused()
        await assert_accessible(page)
        await page.get_by_role("button", name="Cancel").click()
        await expect(forget).to_be_focused()
        await forget.click()
        await yes.click()
        await expect(page.locator("#device-removal-status")).to_have_text(f"{gone} forgotten.")
        await expect(row(page, gone)).to_have_count(0)
        assert bridge.registry.record(gone) is None
        console.assert_clean()


async def test_revoke_by_keyboard_with_a_confirm_step(bridge_factory: Callable[..., Any]) -> None:
    bridge: Bridge = await bridge_factory(device_auth="device")
    async with httpx.AsyncClient(timeout=10) as plain:
        ota = StockOta(plain, bridge.provisioning.ota_url, mac=MAC, client_id=CLIENT_ID)
        code = (await ota.check()).json()["activation"]["code"]
    async with httpx.AsyncClient(
        base_url=bridge.api_url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
    ) as admin:
        approved = await admin.post("/api/provisioning/approve", json={"target": code})
        assert approved.status_code == 200, approved.text
    async with console_page(bridge, "/devices", ADMIN_TOKEN) as console:
        page = console.page
        await open_device(page, MAC)
        revoke = page.locator('button[data-action="revoke"]')
        await revoke.focus()
        await page.keyboard.press("Enter")
        yes = page.get_by_role("button", name=f"Yes, revoke {MAC}")
        await expect(yes).to_be_focused()
        await expect(page.locator("#device-actions .confirm")).to_contain_text(
            "cannot reconnect until it is activated again"
        )
        await page.keyboard.press("Escape")
        await expect(revoke).to_be_focused()
        await page.keyboard.press("Enter")
        await page.keyboard.press("Enter")
        await expect(page.locator("#device-removal-status")).to_have_text(
            f"Credentials of {MAC} revoked."
        )
        await expect(revoke).to_be_focused()
        # By keyboard too: the name field, typed, saved with Enter.
        await page.get_by_label("Display name").focus()
        await page.keyboard.type("Hall")
        await page.keyboard.press("Enter")
        await expect(page.locator("#device-notes-status")).to_have_text("Name and notes saved.")
        await assert_accessible(page)
        console.assert_clean()
    listed = {d.device_id: d for d in bridge.provisioning.store.devices()}
    assert listed[MAC].status == "revoked"
    assert bridge.registry.summary(MAC)["name"] == "Hall"


async def test_a_key_without_admin_sees_the_actions_disabled(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    live = (await simulated_devices(bridge)).device_id
    bridge.registry.annotate(live, name="Porch", notes="Under the roof.")
    key = await create_key(bridge, "devices:read", "devices:call")
    async with console_page(bridge, "/devices", key, viewport=PHONE) as console:
        page = console.page
        await open_device(page, live)
        await expect(page.locator("#device-actions-denied")).to_contain_text("need the admin scope")
        await expect(page.get_by_label("Display name")).to_have_value("Porch")
        await expect(page.get_by_label("Display name")).to_be_disabled()
        await expect(page.get_by_label("Notes", exact=True)).to_be_disabled()
        for name in ("Save name and notes", "Revoke credentials", "Forget device"):
            await expect(page.get_by_role("button", name=name)).to_be_disabled()
        await assert_accessible(page)
        console.assert_clean()
    async with httpx.AsyncClient(
        base_url=bridge.api_url, headers={"Authorization": f"Bearer {key}"}, timeout=10
    ) as client:
        refused = await client.put(f"/api/devices/{live}/notes", json={"name": "x"})
        assert refused.status_code == 403
    assert bridge.registry.summary(live)["name"] == "Porch"


async def test_the_actions_in_vietnamese(bridge: Bridge) -> None:
    gone = await offline_device(bridge)
    async with console_page(bridge, "/devices", ADMIN_TOKEN, locale="vi-VN") as console:
        page = console.page
        await open_device(page, gone)
        section = page.locator("#device-actions")
        await expect(section.get_by_role("heading", name="Tên và ghi chú")).to_be_visible()
        await page.get_by_label("Tên hiển thị").fill("Loa phòng khách")
        await page.get_by_label("Ghi chú", exact=True).fill("Đặt cạnh ti vi.")
        await page.get_by_role("button", name="Lưu tên và ghi chú").click()
        await expect(page.locator("#device-notes-status")).to_have_text("Đã lưu tên và ghi chú.")
        await page.get_by_role("button", name="Xóa thiết bị khỏi danh sách").click()
        await expect(page.get_by_role("button", name=f"Có, xóa {gone}")).to_be_focused()
        shown = await section.inner_text()
        for english in ("Display name", "Notes", "Revoke", "Forget", "Cancel", "Save"):
            assert english not in shown, english
        await assert_accessible(page)
        console.assert_clean()
    assert bridge.registry.summary(gone)["name"] == "Loa phòng khách"
