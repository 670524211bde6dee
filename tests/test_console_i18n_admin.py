"""The devices, keys, activations and audit pages in Vietnamese (tests/console_helpers.py): a
browser whose language is vi-VN gets each page's Vietnamese strings (backend/console/static/text),
<html lang="vi">, no serious axe violation, and none of the English phrases of the page's text
module left in the visible text. A real bridge on loopback with real simulated devices."""

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, expect

from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN
from testkit.stock_device import CLIENT_ID
from tests.console_helpers import DESKTOP, PHONE, ConsolePage, assert_accessible, console_page
from tests.helpers import create_key
from tests.provisioning_helpers import MAC, StockOta

pytestmark = pytest.mark.timeout(180)

VI = "vi-VN"
SET_VOLUME = "self.audio_speaker.set_volume"
REBOOT = "self.reboot"
ASKED = "status of 428 (Precondition Required)"  # Chromium logs the API asking to confirm

# The English phrases (2+ words) of a text module: its `en` values, a function's text around
# the values it shows (called with a marker), less what the Vietnamese table says too (command
# lines, scope names and the like are the same in both).
_PHRASES = """async (module) => {
  const table = (await import(module)).default;
  const MARK = "\\u0001";
  const pieces = (value) => {
    if (typeof value === "string") return [value];
    if (Array.isArray(value)) return value.flatMap(pieces);
    if (typeof value === "function") {
      let text = "";
      try { text = String(value(MARK, MARK, MARK, MARK)); } catch { return []; }
      return text.split(/\\u0001|undefined|\\[object Object\\]/);
    }
    if (value && typeof value === "object") return Object.values(value).flatMap(pieces);
    return [];
  };
  const phrases = (language) => Object.values(table[language]).flatMap(pieces)
    .map((piece) => piece.replace(/^[\\s,.:;()“”"]+|[\\s,.:;()“”"]+$/g, ""))
    .filter((piece) => piece.split(/\\s+/).filter((word) => /[A-Za-z]/.test(word)).length >= 2);
  const vietnamese = new Set(phrases("vi"));
  return [...new Set(phrases("en"))].filter((phrase) => !vietnamese.has(phrase));
}"""


async def assert_vietnamese(console: ConsolePage, module: str, *, allow_errors: tuple = ()) -> None:
    """<html lang="vi">, no serious axe violation, no English phrase of `module` visible, and
    a clean page."""
    page = console.page
    assert await page.evaluate("document.documentElement.lang") == "vi"
    phrases: list[str] = await page.evaluate(_PHRASES, f"/console/text/{module}.js")
    assert len(phrases) > 5, phrases  # the scan has something to look for
    shown: str = await page.evaluate("document.body.innerText")
    left = [phrase for phrase in phrases if phrase in shown]
    assert not left, f"English left on the page: {left}"
    await assert_accessible(page)
    console.assert_clean(allow_errors=allow_errors)


def tool(page: Page, name: str) -> Any:
    return page.locator(f'article[data-tool="{name}"]')


async def assert_fits(page: Page, viewport: dict[str, int]) -> None:
    """The longer Vietnamese words fit: a phone scrolls only vertically, and the fleet table's
    headers stay whole (on a desktop with a device open beside the table)."""
    if viewport == PHONE:
        width = await page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= PHONE["width"], width
    fits = await page.evaluate(
        """() => [...document.querySelectorAll('table.fleet thead th')].map((th) =>
             [th.textContent, th.scrollWidth, th.clientWidth, th.scrollWidth <= th.clientWidth])"""
    )
    assert all(fit[-1] for fit in fits), str(fits)
    lines = await page.evaluate(
        """() => { const range = document.createRange();
           range.selectNodeContents(document.querySelector('#device-rows .device-id'));
           return range.getClientRects().length; }"""
    )
    assert lines == 1  # a device id stays on one line


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
async def test_the_devices_page_in_vietnamese(
    bridge: Bridge, simulated_devices: Callable[..., Any], viewport: dict[str, int]
) -> None:
    device = await simulated_devices(bridge)
    async with console_page(
        bridge, "/devices", ADMIN_TOKEN, locale=VI, viewport=viewport
    ) as console:
        page = console.page
        await expect(page.get_by_role("heading", level=1, name="Thiết bị")).to_be_visible()
        await expect(page.locator("#fleet-status")).to_have_text("1 thiết bị, 1 trực tuyến")
        line = page.locator(f'tr[data-device-id="{device.device_id}"]')
        await expect(line.locator(".badge")).to_have_text("sẵn sàng")
        await expect(page.locator("#stream-state")).to_have_text("trực tiếp")
        await expect(page.get_by_role("columnheader", name="Lần cuối thấy")).to_be_visible()
        assert await page.title() == "Thiết bị · esp32-mcp-bridge"

        await line.get_by_role("button", name=device.device_id).click()
        await expect(page.get_by_role("heading", level=2, name=device.device_id)).to_be_focused()
        volume = tool(page, SET_VOLUME)
        await volume.wait_for()
        await expect(volume.get_by_role("spinbutton", name="volume (bắt buộc)")).to_be_visible()
        await expect(volume.get_by_role("button", name="Gọi")).to_be_enabled()
        await expect(page.get_by_role("combobox", name="Ngôn ngữ được nghe")).to_be_visible()
        await expect(page.locator("#voice-effective")).to_have_text(
            "Hiện đang nghe bằng Tiếng Anh."
        )
        await expect(page.locator("#device-detail")).to_contain_text("Lệnh gọi gần đây")
        reboot = tool(page, REBOOT)
        await expect(reboot.get_by_role("heading")).to_contain_text("cần xác nhận")

        await volume.get_by_role("spinbutton", name="volume (bắt buộc)").fill("20")
        await volume.get_by_role("button", name="Gọi").click()
        await expect(volume.locator(".output")).to_contain_text("Kết quả sau")
        assert device.hal.get_volume() == 20
        await expect(page.locator(".audit-table")).to_contain_text("thành công")

        await reboot.get_by_role("button", name="Gọi").click()
        await expect(reboot.get_by_role("button", name=f"Xác nhận {REBOOT}")).to_be_focused()
        await expect(reboot.locator(".confirm")).to_contain_text("cần bạn xác nhận")
        await assert_fits(page, viewport)
        await assert_vietnamese(console, "devices", allow_errors=(ASKED,))
        await reboot.get_by_role("button", name="Hủy").click()
        await expect(reboot.locator(".output")).to_have_text("Chưa gọi.")
        await assert_vietnamese(console, "devices", allow_errors=(ASKED,))


async def test_the_devices_page_tells_a_reader_why_in_vietnamese(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    device = await simulated_devices(bridge)
    key = await create_key(bridge, "devices:read")
    async with console_page(bridge, "/devices", key, locale=VI) as console:
        page = console.page
        await page.get_by_role("button", name=device.device_id).click()
        await tool(page, SET_VOLUME).wait_for()
        await expect(page.locator("#call-denied")).to_contain_text("thiếu quyền devices:call")
        await expect(page.locator("#voice-effective")).to_contain_text("Cần quyền admin")
        await assert_vietnamese(console, "devices")


async def test_the_keys_page_in_vietnamese(bridge: Bridge) -> None:
    await create_key(bridge, "chat:use")
    async with console_page(bridge, "/keys", ADMIN_TOKEN, locale=VI) as console:
        page = console.page
        await expect(page.get_by_role("heading", level=1, name="Khóa API")).to_be_visible()
        await expect(page.locator("#keys-status")).to_have_text("1 đang dùng, tổng cộng 1")
        await expect(page.get_by_role("columnheader", name="Lần dùng cuối")).to_be_attached()
        await expect(page.locator("#scope-0-help")).not_to_have_text("")
        await expect(page.get_by_text("liệt kê thiết bị, công cụ")).to_be_visible()
        await page.get_by_label("Tên").fill("máy tính bảng")
        await page.get_by_role("checkbox", name="devices:read", exact=True).check()
        await page.get_by_role("button", name="Tạo khóa").click()
        await expect(page.locator("#new-key-title")).to_have_text(
            "Đã tạo khóa “máy tính bảng”: hãy sao chép ngay"
        )
        await expect(page.locator("#new-key-title")).to_be_focused()
        await expect(page.locator("#keys-status")).to_have_text("2 đang dùng, tổng cộng 2")
        await assert_vietnamese(console, "keys")
        key_id = next(k.id for k in await bridge.frontends.keys.list() if k.name == "máy tính bảng")
        row = page.locator(f'tr[data-key-id="{key_id}"]')
        await row.get_by_role("button", name="Thu hồi khóa máy tính bảng").click()
        yes = row.get_by_role("button", name="Đồng ý, thu hồi máy tính bảng")
        await expect(yes).to_be_focused()
        await expect(row).to_contain_text("không thể hoàn tác")
        await assert_vietnamese(console, "keys")
        await yes.click()
        await page.get_by_label("Hiện các khóa đã thu hồi").check()
        await expect(row).to_contain_text("đã thu hồi")
        await assert_vietnamese(console, "keys")


@pytest.fixture
async def device_bridge(bridge_factory: Callable[..., Any]) -> Bridge:
    bridge: Bridge = await bridge_factory(device_auth="device")
    return bridge


async def test_the_activations_page_in_vietnamese(device_bridge: Bridge) -> None:
    bridge = device_bridge
    async with httpx.AsyncClient(timeout=10) as plain:
        ota = StockOta(plain, bridge.provisioning.ota_url, mac=MAC, client_id=CLIENT_ID)
        code = (await ota.check()).json()["activation"]["code"]
        async with console_page(bridge, "/activations", ADMIN_TOKEN, locale=VI) as console:
            page = console.page
            await expect(page.get_by_role("heading", level=1, name="Kích hoạt")).to_be_visible()
            await expect(page.locator("#pending-status")).to_have_text("1 thiết bị đang chờ")
            row = page.locator(f'tr[data-code="{code}"]')
            await expect(row.get_by_role("button", name=f"Từ chối yêu cầu {code}")).to_be_visible()
            await page.get_by_role("button", name="Phê duyệt", exact=True).click()  # no code typed
            await expect(page.locator("#approve-result")).to_have_text(
                "Mã gồm 6 chữ số mà thiết bị hiển thị."
            )
            await assert_vietnamese(console, "activations")
            await page.get_by_label("Mã thiết bị hiển thị").fill(code)
            await page.get_by_role("button", name="Phê duyệt", exact=True).click()
            await expect(page.locator("#approve-result")).to_contain_text(f"Đã phê duyệt {MAC}")
            await expect(page.locator("#pending-status")).to_contain_text("Không có thiết bị nào")
            approved = page.locator(f'#approved-list tr[data-device-id="{MAC}"]')
            await expect(approved).to_contain_text("đã phê duyệt")
            await approved.get_by_role("button", name=f"Thu hồi thiết bị {MAC}").click()
            await expect(
                approved.get_by_role("button", name=f"Đồng ý, thu hồi {MAC}")
            ).to_be_focused()
            await assert_vietnamese(console, "activations")


async def test_the_audit_page_in_vietnamese(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    device = await simulated_devices(bridge)
    async with httpx.AsyncClient(
        base_url=bridge.api_url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    ) as admin:
        path = f"/api/devices/{device.device_id}/tools/call"
        body = {"name": SET_VOLUME, "arguments": {"volume": 30}}
        assert (await admin.post(path, json=body)).status_code == 200
        assert (await admin.post(path, json={"name": REBOOT})).status_code == 428
    await bridge.audit.flush()
    async with console_page(bridge, "/audit", ADMIN_TOKEN, locale=VI) as console:
        page = console.page
        await expect(page.get_by_role("heading", level=1, name="Nhật ký kiểm tra")).to_be_visible()
        status = page.locator("#audit-status")
        await expect(status).to_have_text("Trang 1: dòng 1–2 (trang cuối)")
        rows = page.locator("#audit-results tbody tr")
        await expect(rows.filter(has_text=REBOOT)).to_contain_text("bị từ chối")
        await expect(rows.filter(has_text=SET_VOLUME)).to_contain_text("thành công")
        await expect(page.get_by_role("columnheader", name="Người gọi")).to_be_visible()
        await assert_vietnamese(console, "audit")
        await page.get_by_label("Số dòng mỗi trang").select_option("25")
        await page.get_by_label("Kết quả").select_option("error")
        await page.get_by_role("button", name="Hiển thị").click()
        await expect(status).to_have_text("Không có dòng nào khớp với các bộ lọc này.")
        await assert_vietnamese(console, "audit")
