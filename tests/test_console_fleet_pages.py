"""The console's fleet pages in Chromium (tests/console_helpers.py): firmware (the releases per
board, an image uploaded end to end, unpublished with a confirm step, which device runs which
version) and MCP servers (a real stdio server, a broken one and a dialed-in one, their state and
tools, refreshed in place), at desktop and phone sizes, by keyboard, with axe, in Vietnamese,
and keys without the scope: the actions disabled or the page's notice, while the API refuses.
A real bridge on loopback; a stock device's real OTA checks."""

import hashlib
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Page, expect

from backend.mcp_dialin.endpoint import server_name
from backend.server import Bridge
from simulator.stock_ota import BOARD
from testkit.settings import ADMIN_TOKEN
from testkit.stock_device import CLIENT_ID
from tests.console_helpers import (
    DESKTOP,
    PHONE,
    SIZES,
    ConsolePage,
    assert_accessible,
    console_page,
    http,
    tab_to,
)
from tests.dialin_helpers import RawPipe
from tests.helpers import create_key
from tests.mcp_servers_helpers import stdio_entry, wait_ready, wait_until
from tests.provisioning_helpers import MAC, StockOta

pytestmark = pytest.mark.timeout(180)

DIALIN_DEVICE = "aa:bb:cc:dd:ee:01"


def image(folder: Path, size: int = 150_000) -> Path:
    path = folder / "xiaozhi.bin"
    path.write_bytes(bytes(range(256)) * (size // 256) + b"\xe9" * (size % 256))
    return path


async def stock_device_reports(bridge: Bridge, version: str = "2.4.2") -> dict[str, Any]:
    """A stock device's OTA check (board bread-compact-wifi); the bridge's answer."""
    async with httpx.AsyncClient(timeout=10) as plain:
        ota = StockOta(plain, bridge.provisioning.ota_url, mac=MAC, client_id=CLIENT_ID)
        reply = await ota.check(version=version)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


async def releases(bridge: Bridge) -> list[dict[str, Any]]:
    async with http(bridge) as client:
        reply = await client.get("/api/firmware")
    assert reply.status_code == 200, reply.text
    listed: list[dict[str, Any]] = reply.json()["releases"]
    return listed


def release_row(page: Page, board: str, version: str) -> Any:
    return page.locator(f'tr[data-release="{board}/{version}"]')


# ---- firmware -----------------------------------------------------------------------------------


@pytest.mark.parametrize("viewport", SIZES)
async def test_firmware_page_uploads_an_image_then_unpublishes_it(
    bridge: Bridge, viewport: dict[str, int], tmp_path: Path
) -> None:
    await stock_device_reports(bridge)
    file = image(tmp_path)
    async with console_page(bridge, "/firmware", ADMIN_TOKEN, viewport=viewport) as console:
        page = console.page
        await expect(page.locator("#releases-list")).to_contain_text("No firmware published yet")
        device = page.locator(f'#firmware-devices tr[data-device-id="{MAC}"]')
        await expect(device).to_contain_text(BOARD)
        await expect(device).to_contain_text("2.4.2")
        await expect(device).to_contain_text("none for this board")
        await expect(page.locator("#no-rollout")).to_contain_text("no staged rollout")
        await assert_accessible(page)

        await page.get_by_label("Board", exact=True).fill(BOARD)
        await page.get_by_label("Version", exact=True).fill("2.4.3")
        await page.get_by_label("Image file").set_input_files(file)
        await page.get_by_role("button", name="Upload and publish").click()
        await expect(page.locator("#upload-result")).to_have_text(
            f"Published {BOARD} 2.4.3 (146.5 KiB)."
        )
        row = release_row(page, BOARD, "2.4.3")
        await expect(row).to_contain_text("newest: offered")
        await expect(row).to_contain_text("146.5 KiB")
        await expect(page.locator("#releases-status")).to_contain_text("1 release for 1 board")
        # The device now sees an update, and the bridge offers it at its next OTA check.
        await expect(device).to_contain_text("2.4.3: newer, offered at its next OTA check")
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        assert [
            (r["board"], r["version"], r["size"], r["sha256"]) for r in await releases(bridge)
        ] == [(BOARD, "2.4.3", file.stat().st_size, digest)]
        if viewport is DESKTOP:
            await expect(row).to_contain_text(digest[:12])
        offered = (await stock_device_reports(bridge))["firmware"]
        assert offered["version"] == "2.4.3" and offered["sha256"] == digest
        await assert_accessible(page)

        # Unpublish: a confirm step first (Cancel keeps it), then it is gone.
        await row.get_by_role("button", name=f"Unpublish {BOARD} 2.4.3").click()
        await expect(
            row.get_by_role("button", name=f"Yes, unpublish {BOARD} 2.4.3")
        ).to_be_focused()
        await assert_accessible(page)
        await row.get_by_role("button", name="Cancel").click()
        await expect(row.get_by_role("button", name=f"Unpublish {BOARD} 2.4.3")).to_be_focused()
        assert len(await releases(bridge)) == 1
        await row.get_by_role("button", name=f"Unpublish {BOARD} 2.4.3").click()
        await row.get_by_role("button", name=f"Yes, unpublish {BOARD} 2.4.3").click()
        await expect(row).to_have_count(0)
        await expect(page.locator("#releases-title")).to_be_focused()
        await expect(page.locator("#releases-list")).to_contain_text("No firmware published yet")
        await expect(device).to_contain_text("none for this board")
        assert await releases(bridge) == []
        console.assert_clean()


async def test_firmware_upload_and_unpublish_by_keyboard_only(
    bridge: Bridge, tmp_path: Path
) -> None:
    file = image(tmp_path, 4096)
    async with console_page(bridge, "/firmware", ADMIN_TOKEN) as console:
        page = console.page
        await expect(page.locator("#releases-list")).to_contain_text("No firmware published yet")
        await tab_to(page, "#fw-board")
        await page.keyboard.type("my-board")
        await page.keyboard.press("Tab")
        await expect(page.locator("#fw-version")).to_be_focused()
        await page.keyboard.type("v1")  # not a version: said, and the focus goes back there
        await page.keyboard.press("Enter")
        await expect(page.locator("#upload-error")).to_have_text(
            "The version is 1 to 4 numbers separated by dots, e.g. 2.4.3."
        )
        await expect(page.locator("#fw-version")).to_be_focused()
        await expect(page.locator("#fw-version")).to_have_attribute("aria-invalid", "true")
        await page.keyboard.press("Control+A")
        await page.keyboard.type("1.0.2")
        await page.keyboard.press("Tab")
        await expect(page.locator("#fw-file")).to_be_focused()
        async with page.expect_file_chooser() as chooser:
            await page.keyboard.press("Space")
        await (await chooser.value).set_files(file)
        await tab_to(page, "#upload-button")
        await page.keyboard.press("Enter")
        await expect(page.locator("#upload-result")).to_have_text(
            "Published my-board 1.0.2 (4 KiB)."
        )
        assert [(r["board"], r["version"]) for r in await releases(bridge)] == [
            ("my-board", "1.0.2")
        ]

        await tab_to(page, 'tr[data-release="my-board/1.0.2"] button')
        await page.keyboard.press("Enter")
        await expect(
            page.get_by_role("button", name="Yes, unpublish my-board 1.0.2")
        ).to_be_focused()
        await page.keyboard.press("Escape")
        await expect(
            release_row(page, "my-board", "1.0.2").get_by_role(
                "button", name="Unpublish my-board 1.0.2"
            )
        ).to_be_focused()
        await page.keyboard.press("Enter")
        await page.keyboard.press("Enter")
        await expect(release_row(page, "my-board", "1.0.2")).to_have_count(0)
        assert await releases(bridge) == []
        console.assert_clean()


async def test_firmware_page_shows_the_bridges_refusal(bridge: Bridge, tmp_path: Path) -> None:
    """An upload the bridge refuses (a version published already) says why, in the page."""
    file = image(tmp_path, 2048)
    async with http(bridge) as client:
        assert (
            await client.put(f"/api/firmware/{BOARD}/3.0.0", content=b"x" * 10)
        ).status_code == 201
    async with console_page(bridge, "/firmware", ADMIN_TOKEN, viewport=PHONE) as console:
        page = console.page
        await expect(release_row(page, BOARD, "3.0.0")).to_be_visible()
        await page.get_by_label("Board", exact=True).fill(BOARD)
        await page.get_by_label("Version", exact=True).fill("3.0.0")
        await page.get_by_label("Image file").set_input_files(file)
        await page.get_by_role("button", name="Upload and publish").click()
        await expect(page.locator("#upload-error")).to_contain_text(
            "Not published: bread-compact-wifi 3.0.0 is published already"
        )
        await expect(page.get_by_role("button", name="Upload and publish")).to_be_enabled()
        await assert_accessible(page)
        console.assert_clean(allow_errors=["status of 422"])  # Chromium logs the refusal


async def test_firmware_page_without_admin_has_its_actions_disabled(bridge: Bridge) -> None:
    await stock_device_reports(bridge)
    async with http(bridge) as client:
        assert (
            await client.put(f"/api/firmware/{BOARD}/9.0.0", content=b"x" * 10)
        ).status_code == 201
    key = await create_key(bridge, "devices:read")
    async with console_page(bridge, "/firmware", key, viewport=PHONE) as console:
        page = console.page
        await expect(page.locator("#firmware-denied")).to_contain_text("lacks the admin scope")
        await expect(page.get_by_role("button", name="Upload and publish")).to_be_disabled()
        await expect(page.get_by_label("Board", exact=True)).to_be_disabled()
        await expect(page.get_by_label("Image file")).to_be_disabled()
        await expect(page.get_by_role("button", name="Refresh")).to_be_disabled()
        # The devices are still shown (devices:read), the releases are not read at all.
        await expect(page.locator(f'#firmware-devices tr[data-device-id="{MAC}"]')).to_contain_text(
            "2.4.2"
        )
        await expect(page.locator("#releases-list")).to_be_empty()
        await expect(page.get_by_role("navigation", name="Console")).not_to_contain_text("Firmware")
        await assert_accessible(page)
        assert not [r for r in console.responses if "/api/firmware" in r.url]
        console.assert_clean()
    async with http(bridge, key) as client:
        put = await client.put(f"/api/firmware/{BOARD}/9.1.0", content=b"x" * 10)
        assert put.status_code == 403 and put.json()["error"]["code"] == "forbidden"
        assert (await client.get("/api/firmware")).status_code == 403
        assert (await client.delete(f"/api/firmware/{BOARD}/9.0.0")).status_code == 403
    assert [r["version"] for r in await releases(bridge)] == ["9.0.0"]


async def test_firmware_page_in_vietnamese(bridge: Bridge, tmp_path: Path) -> None:
    await stock_device_reports(bridge)
    async with console_page(bridge, "/firmware", ADMIN_TOKEN, locale="vi-VN") as console:
        page = console.page
        await expect(page.locator("html")).to_have_attribute("lang", "vi")
        await expect(page.locator("#releases-list")).to_have_text(
            "Chưa có bản firmware nào được phát hành."
        )
        await expect(page.get_by_role("heading", name="Phát hành một bản firmware")).to_be_visible()
        device = page.locator(f'#firmware-devices tr[data-device-id="{MAC}"]')
        await expect(device).to_contain_text("chưa có bản cho bo mạch này")
        await page.get_by_label("Phiên bản", exact=True).fill("2.5")
        await page.get_by_role("button", name="Tải lên và phát hành").click()
        await expect(page.locator("#upload-error")).to_contain_text(
            "Tên bo mạch gồm 1 đến 64 chữ cái"
        )
        await page.get_by_label("Bo mạch", exact=True).fill(BOARD)
        await page.get_by_label("Tệp firmware").set_input_files(image(tmp_path, 1000))
        await page.get_by_role("button", name="Tải lên và phát hành").click()
        await expect(page.locator("#upload-result")).to_have_text(
            f"Đã phát hành {BOARD} 2.5 (1.000 B)."
        )
        row = release_row(page, BOARD, "2.5")
        await expect(row).to_contain_text("mới nhất: đang cung cấp")
        await expect(device).to_contain_text("2.5: mới hơn")
        await row.get_by_role("button", name=f"Gỡ {BOARD} 2.5").click()
        await expect(row.get_by_role("button", name=f"Đồng ý, gỡ {BOARD} 2.5")).to_be_focused()
        await assert_accessible(page)
        shown = await page.locator("main").inner_text()
        for english in ("Published releases", "Devices and their firmware", "Upload", "newest"):
            assert english not in shown
        console.assert_clean()


# ---- MCP servers --------------------------------------------------------------------------------


@pytest.fixture
async def mcp_bridge(bridge_factory: Callable[..., Any]) -> Bridge:
    """A bridge with the fake stdio server and one whose command does not exist."""
    broken = {"name": "broken", "command": "/nonexistent/mcp-server-missing"}
    bridge: Bridge = await bridge_factory(mcp_servers=[stdio_entry("fake"), broken])
    await wait_ready(bridge, "fake")
    return bridge


@pytest.fixture
async def dialin(mcp_bridge: Bridge) -> AsyncIterator[str]:
    """A server dialed in to the bridge for one device; yields its name."""
    token = await create_key(mcp_bridge, "mcp:endpoint", devices=[DIALIN_DEVICE])
    url = f"ws://127.0.0.1:{mcp_bridge.http_port}/v1/mcp-endpoint/?token={token}"
    pipe = await RawPipe(url).start()
    name = server_name(token.split("_")[1])
    server = None

    def ready() -> bool:
        nonlocal server
        server = mcp_bridge.mcp_servers.get(name)
        return server is not None and server.state.value == "ready"

    await wait_until(ready)
    yield name
    await pipe.close()


def server_card(page: Page, name: str) -> Any:
    return page.locator(f'section.server[data-server="{name}"]')


async def next_refresh(console: ConsolePage) -> None:
    """Wait for the page's next read of the servers."""
    async with console.page.expect_response(
        lambda r: r.url.endswith("/api/mcp/servers"), timeout=15_000
    ):
        pass


@pytest.mark.parametrize("viewport", SIZES)
async def test_mcp_servers_page_lists_servers_and_their_tools(
    mcp_bridge: Bridge, dialin: str, viewport: dict[str, int]
) -> None:
    bridge = mcp_bridge
    await wait_until(lambda: bridge.mcp_servers.get("broken").last_error is not None)  # type: ignore[union-attr]
    key = await create_key(bridge, "devices:read")
    async with console_page(bridge, "/mcp-servers", key, viewport=viewport) as console:
        page = console.page
        fake = server_card(page, "fake")
        await expect(fake.locator(".badge.state")).to_have_text("ready")
        await expect(fake).to_contain_text("stdio (a command)")
        await expect(fake).to_contain_text("every device")
        broken = server_card(page, "broken")
        await expect(broken.locator('dd[data-fact="last-error"]')).to_contain_text("mcp-server")
        await expect(broken.locator(".badge.state")).to_have_text(
            re.compile("backing off|connecting")
        )
        dialed = page.locator("#dialin-servers").locator(f'section.server[data-server="{dialin}"]')
        await expect(dialed).to_contain_text("dial-in")
        await expect(dialed).to_contain_text(DIALIN_DEVICE)
        await expect(dialed.locator("summary")).to_have_text("1 tool")
        await expect(page.locator("#configured-servers section.server")).to_have_count(2)
        await expect(page.locator("#servers-status")).to_contain_text("3 servers, 2 ready")
        tools = len(bridge.mcp_servers.get("fake").tools)  # type: ignore[union-attr]
        await expect(fake.locator("summary")).to_have_text(f"{tools} tools")
        await expect(fake.locator('tr[data-tool="echo"]')).to_be_hidden()
        await assert_accessible(page)

        await fake.locator("summary").click()
        echo = fake.locator('tr[data-tool="echo"]')
        await expect(echo).to_contain_text("Echo the text back.")
        await expect(echo).to_contain_text("not needed")
        await expect(fake.locator('tr[data-tool="erase"]')).to_contain_text("risky")
        await assert_accessible(page)

        # A call shows at the next refresh; the open tool list and the focus stay.
        await fake.locator("summary").focus()
        await bridge.mcp_servers.get("fake").call("echo", {"text": "hi"})  # type: ignore[union-attr]
        await expect(fake.locator('dd[data-fact="calls"]')).to_have_text("1", timeout=10_000)
        await next_refresh(console)
        await expect(fake.locator("summary")).to_be_focused()
        await expect(fake.locator("details")).to_have_attribute("open", "")
        await expect(echo).to_be_visible()
        console.assert_clean()


async def test_mcp_servers_page_by_keyboard_only(mcp_bridge: Bridge) -> None:
    async with console_page(mcp_bridge, "/mcp-servers", ADMIN_TOKEN) as console:
        page = console.page
        fake = server_card(page, "fake")
        await expect(fake.locator(".badge.state")).to_have_text("ready")
        await tab_to(page, 'section.server[data-server="fake"] summary')
        await page.keyboard.press("Enter")
        await expect(fake.locator("details")).to_have_attribute("open", "")
        await expect(fake.locator('tr[data-tool="erase"]')).to_contain_text("risky")
        await next_refresh(console)
        await expect(fake.locator("summary")).to_be_focused()
        await page.keyboard.press("Space")  # closes it again
        await expect(fake.locator('tr[data-tool="erase"]')).to_be_hidden()
        console.assert_clean()


async def test_mcp_servers_page_without_devices_read_says_so(mcp_bridge: Bridge) -> None:
    key = await create_key(mcp_bridge, "chat:use")
    async with console_page(mcp_bridge, "/mcp-servers", key, viewport=PHONE) as console:
        page = console.page
        await expect(page.locator("main .notice")).to_contain_text("lacks the devices:read scope")
        await expect(page.locator("section.server")).to_have_count(0)
        await expect(page.get_by_role("navigation", name="Console")).not_to_contain_text(
            "MCP servers"
        )
        await assert_accessible(page)
        console.assert_clean()
    async with http(mcp_bridge, key) as client:
        refused = await client.get("/api/mcp/servers")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"


async def test_mcp_servers_page_in_vietnamese(mcp_bridge: Bridge) -> None:
    async with console_page(mcp_bridge, "/mcp-servers", ADMIN_TOKEN, locale="vi-VN") as console:
        page = console.page
        await expect(page.get_by_role("heading", name="Máy chủ MCP", exact=True)).to_be_visible()
        fake = server_card(page, "fake")
        await expect(fake.locator(".badge.state")).to_have_text("sẵn sàng")
        await expect(fake).to_contain_text("stdio (một lệnh)")
        await expect(fake).to_contain_text("mọi thiết bị")
        await expect(page.locator("#dialin-servers")).to_be_empty()
        await expect(page.get_by_text("Không có máy chủ nào tự kết nối vào.")).to_be_visible()
        tools = len(mcp_bridge.mcp_servers.get("fake").tools)  # type: ignore[union-attr]
        await fake.locator("summary").click()
        await expect(fake.locator("summary")).to_have_text(f"{tools} công cụ")
        await expect(fake.locator('tr[data-tool="erase"]')).to_contain_text("rủi ro")
        await expect(page.locator("#servers-status")).to_contain_text("2 máy chủ, 1 sẵn sàng")
        await assert_accessible(page)
        shown = await page.locator("main").inner_text()
        for english in ("Configured", "Dialed in", "Last error", "every device", "not needed"):
            assert english not in shown
        console.assert_clean()
