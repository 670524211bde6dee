"""The console's frame: pages served by the bridge, their headers, the login with a key, the
navigation that follows the key's scopes (Chromium, tests/console_helpers.py)."""

import re

import httpx
import pytest

from backend.console import PAGES
from backend.console.routes import STATIC_DIR, page_html
from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN
from tests.console_helpers import PHONE, assert_accessible, console_page
from tests.helpers import create_key

pytestmark = pytest.mark.timeout(90)


async def test_pages_and_assets_load_without_a_key_with_a_strict_policy(bridge: Bridge) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url) as client:
        for path, page in PAGES.items():
            served = await client.get(path)
            assert served.status_code == 200, path
            assert served.headers["content-type"].startswith("text/html")
            assert served.text == page_html(page)
            policy = served.headers["content-security-policy"]
            assert "default-src 'self'" in policy and "script-src 'self'" in policy
            assert "'unsafe-inline'" not in policy and "frame-ancestors 'none'" in policy
            assert served.headers["x-content-type-options"] == "nosniff"
            # Revalidated on every load: the same shell is a 304 without a body.
            again = await client.get(path, headers={"If-None-Match": served.headers["etag"]})
            assert again.status_code == 304 and again.content == b""
            # Every script and style the shell names is shipped (no external URL, none missing).
            for ref in re.findall(r'(?:href|src)="(/console/[^"]+)"', served.text):
                asset = await client.get(ref)
                assert asset.status_code == 200, (path, ref)
                assert "content-security-policy" in asset.headers


async def test_the_data_behind_the_pages_still_needs_the_key(bridge: Bridge) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url) as client:
        assert (await client.get("/api/devices")).status_code == 401
        assert (await client.get("/api/whoami")).status_code == 401


@pytest.mark.parametrize(
    "path",
    [
        "/console/../server.py",
        "/console/%2e%2e/server.py",
        "/console/..%2fserver.py",
        "/console/static/../../config.py",
        "/console/",
        "/console/nothing.js",
        "/console/routes.py",
        "/console//etc/passwd",
    ],
)
async def test_no_file_outside_the_static_folder_is_served(bridge: Bridge, path: str) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url) as client:
        response = await client.get(path)
    assert response.status_code in (401, 404), (path, response.status_code)
    assert "import " not in response.text and "root:" not in response.text


async def test_the_static_folder_holds_no_external_reference() -> None:
    for file in STATIC_DIR.rglob("*"):
        if file.is_dir():
            continue  # text/: the pages' strings, checked file by file
        text = file.read_text()
        for marker in ("http://", "https://", "//cdn", "fonts.googleapis", "innerHTML", "eval("):
            # Links the user follows (sources) are built from data, never written here.
            assert marker not in text, (file.name, marker)


async def test_a_refused_key_shows_an_error_and_a_good_one_logs_in(bridge: Bridge) -> None:
    async with console_page(bridge, "/devices", None, viewport=PHONE) as console:
        page = console.page
        await page.get_by_label("API key or admin token").fill("esk_not-a-key")
        await page.get_by_role("button", name="Log in").click()
        await page.get_by_role("alert").filter(has_text="refused").wait_for()
        await assert_accessible(page)
        await page.get_by_label("API key or admin token").fill(ADMIN_TOKEN)
        await page.get_by_role("button", name="Log in").click()
        nav = page.get_by_role("navigation", name="Console")
        await nav.wait_for()
        links = await nav.get_by_role("link").all_inner_texts()
        assert links == [
            "Chat", "Conversations", "Settings", "Devices", "Talk",
            "MCP servers", "Firmware", "Activations", "Keys", "Audit",
        ]  # fmt: skip
        # The key is in the tab's session storage, never in the address or local storage.
        assert ADMIN_TOKEN not in page.url
        stored = await page.evaluate(
            "() => [sessionStorage.getItem('bridge.key'), localStorage.length]"
        )
        assert stored == [ADMIN_TOKEN, 0]
        console.assert_clean(allow_errors=["401"])


async def test_the_navigation_follows_the_scopes_of_the_key(bridge: Bridge) -> None:
    key = await create_key(bridge, "chat:use")
    async with console_page(bridge, "/", key) as console:
        nav = console.page.get_by_role("navigation", name="Console")
        await nav.wait_for()
        links = await nav.get_by_role("link").all_inner_texts()
        assert links == ["Chat", "Conversations", "Settings"]
        await console.page.get_by_role("button", name="Log out").click()
        await console.page.get_by_label("API key or admin token").wait_for()
        assert await console.page.evaluate("() => sessionStorage.getItem('bridge.key')") is None
        console.assert_clean()


async def test_a_key_revoked_while_the_page_is_open_brings_the_login_back(bridge: Bridge) -> None:
    key = await create_key(bridge, "chat:use", "devices:read")
    async with console_page(bridge, "/devices", key) as console:
        await console.page.get_by_role("navigation", name="Console").wait_for()
        await bridge.frontends.keys.revoke(key.split("_")[1])  # esk_<key id>_<secret>
        await console.page.reload()
        await console.page.get_by_role("alert").filter(has_text="refused").wait_for()
        console.assert_clean(allow_errors=["401"])


@pytest.mark.parametrize("path", list(PAGES))
async def test_every_page_fits_a_phone_and_is_accessible_there(bridge: Bridge, path: str) -> None:
    async with console_page(bridge, path, ADMIN_TOKEN, viewport=PHONE) as console:
        page = console.page
        await page.get_by_role("navigation", name="Console").wait_for()
        await page.locator("#main > *").first.wait_for()
        width = await page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= PHONE["width"], f"{path} is {width} px wide on a {PHONE['width']} px screen"
        await assert_accessible(page)
        console.assert_clean(allow_errors=["microphone", "NotFoundError"])


async def test_the_keyboard_reaches_the_login_form_then_the_navigation(bridge: Bridge) -> None:
    async with console_page(bridge, "/", None) as console:
        page = console.page
        key_field = page.get_by_label("API key or admin token")
        await key_field.wait_for()
        # The form takes the focus at once: a key can be pasted and sent with Enter.
        assert await key_field.evaluate("(input) => input === document.activeElement")
        await page.keyboard.type(ADMIN_TOKEN)
        await page.keyboard.press("Enter")
        await page.get_by_role("navigation", name="Console").wait_for()
        # A fresh load of a page (the key is now in the tab): focus starts at the top.
        await console.goto("/devices")
        await page.get_by_role("navigation", name="Console").wait_for()
        await page.keyboard.press("Tab")
        focused = await page.evaluate("() => document.activeElement.textContent")
        assert focused == "Skip to content"
        await page.keyboard.press("Tab")
        focused = await page.evaluate("() => document.activeElement.textContent")
        assert focused == "Chat"
        await page.keyboard.press("Enter")
        await page.wait_for_url(console.url("/"))
        console.assert_clean()
