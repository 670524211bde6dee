"""Browser tests of the web console: the distribution's Chromium driven by Playwright.

`console_page(bridge, "/devices", key)` opens a page of a running bridge in a fresh browser
context, logged in with `key` (put in the tab's session storage as the login form would), and
watches everything the page does: console errors, uncaught exceptions, failed requests and
every request that leaves the bridge's origin. `ConsolePage.assert_clean()` checks them all.
`axe_violations(page)` runs axe-core's rules (installed from npm into tools/axe by
scripts/test) in the page; `save_screenshot` writes docs/console/<name>.png for the README.
"""

import json
import shutil
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.async_api import (
    Browser,
    ConsoleMessage,
    Page,
    Request,
    Response,
    async_playwright,
)

from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN

ROOT = Path(__file__).resolve().parent.parent
AXE_SCRIPT = ROOT / "tools" / "axe" / "node_modules" / "axe-core" / "axe.min.js"
SCREENSHOTS = ROOT / "docs" / "console"
PHONE = {"width": 375, "height": 740}
DESKTOP = {"width": 1280, "height": 860}
# axe impacts that fail a page; "moderate" and "minor" ones are reported, not failed.
SERIOUS = ("serious", "critical")
# Written by the tests into the tab before any page script runs, once per tab: a reload keeps
# the tab's session storage as a real one would, and "Log out" really logs out.
_LOGIN_SCRIPT = """
if (!sessionStorage.getItem("bridge.test-login")) {
  sessionStorage.setItem("bridge.test-login", "1");
  const key = %s;
  if (key) sessionStorage.setItem("bridge.key", key);
}
"""


def chromium_path() -> str:
    """The distribution's Chromium (scripts/test installs the `chromium` package)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("Chromium is not installed: run scripts/test, which installs it")
    return found


@dataclass
class ConsolePage:
    """A console page in Chromium and what it did."""

    page: Page
    origin: str
    errors: list[str] = field(default_factory=list)
    foreign_requests: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    responses: list[Response] = field(default_factory=list)

    def url(self, path: str) -> str:
        return self.origin + path

    async def goto(self, path: str) -> None:
        await self.page.goto(self.url(path))

    def assert_clean(self, *, allow_errors: Sequence[str] = ()) -> None:
        """No console error or page exception (but those containing one of `allow_errors`),
        no failed request, and no request that left the bridge's origin."""
        errors = [e for e in self.errors if not any(allowed in e for allowed in allow_errors)]
        assert not errors, f"console errors: {errors}"
        assert not self.failed_requests, f"failed requests: {self.failed_requests}"
        assert not self.foreign_requests, f"requests outside {self.origin}: {self.foreign_requests}"

    def _on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(f"console: {message.text} ({message.location.get('url')})")

    def _on_page_error(self, error: Exception) -> None:
        self.errors.append(f"exception: {error}")

    def _on_request(self, request: Request) -> None:
        if not _same_origin(request.url, self.origin):
            self.foreign_requests.append(request.url)

    def _on_response(self, response: Response) -> None:
        self.responses.append(response)

    def _on_request_failed(self, request: Request) -> None:
        failure = request.failure or "failed"
        # A stream the page itself closed (leaving a page, an abort) is not a failure.
        if "ERR_ABORTED" not in failure:
            self.failed_requests.append(f"{request.method} {request.url}: {failure}")


def _same_origin(url: str, origin: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme in ("data", "blob", "about"):
        return True
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return f"{scheme}://{parts.netloc}" == origin


@asynccontextmanager
async def chromium(*args: str) -> AsyncIterator[Browser]:
    """A headless Chromium with extra command-line `args` (a fake microphone, say)."""
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=chromium_path(), args=list(args), headless=True
        )
        try:
            yield browser
        finally:
            await browser.close()


@asynccontextmanager
async def console_page(
    bridge: Bridge,
    path: str,
    key: str | None,
    *,
    browser_args: Sequence[str] = (),
    viewport: dict[str, int] | None = None,
    browser: Browser | None = None,
    locale: str | None = None,
) -> AsyncIterator[ConsolePage]:
    """`path` of the bridge's console opened in a new tab, logged in with `key` (None: not);
    `locale` (say "vi-VN"): the browser's language, Chromium's default when None."""
    async with _browser(browser, browser_args) as running:
        context = await running.new_context(
            viewport=viewport or DESKTOP,  # type: ignore[arg-type]
            permissions=["microphone"] if browser_args else [],
            locale=locale,
        )
        try:
            await context.add_init_script(_LOGIN_SCRIPT % json.dumps(key))
            page = await context.new_page()
            watched = ConsolePage(page, bridge.api_url)
            page.on("console", watched._on_console)
            page.on("pageerror", watched._on_page_error)
            page.on("request", watched._on_request)
            page.on("requestfailed", watched._on_request_failed)
            page.on("response", watched._on_response)
            await page.goto(watched.url(path))
            yield watched
        finally:
            await context.close()


@asynccontextmanager
async def _browser(given: Browser | None, args: Sequence[str]) -> AsyncIterator[Browser]:
    if given is not None:
        yield given
        return
    async with chromium(*args) as started:
        yield started


async def axe_violations(page: Page, *, impacts: Sequence[str] = SERIOUS) -> list[dict[str, Any]]:
    """axe-core's violations of the page as it is now, those of `impacts` only.

    The rules go in through the DevTools protocol (as an extension would), not as a script of
    the page: the console's CSP rightly refuses inline scripts."""
    if not AXE_SCRIPT.exists():
        pytest.fail(f"{AXE_SCRIPT} missing: run scripts/test (npm ci in tools/axe)")
    await page.evaluate(AXE_SCRIPT.read_text())
    result: dict[str, Any] = await page.evaluate(
        "async () => await axe.run(document, {resultTypes: ['violations']})"
    )
    return [
        {
            "id": violation["id"],
            "impact": violation["impact"],
            "help": violation["help"],
            "nodes": [node["target"] for node in violation["nodes"]][:5],
        }
        for violation in result["violations"]
        if violation["impact"] in impacts
    ]


async def assert_accessible(page: Page) -> None:
    """No serious or critical axe violation on the page as it is now."""
    violations = await axe_violations(page)
    assert not violations, json.dumps(violations, indent=1)


async def save_screenshot(page: Page, name: str) -> Path:
    """docs/console/<name>.png, for the README (rewritten by every run)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    target = SCREENSHOTS / f"{name}.png"
    await page.screenshot(path=str(target), full_page=False)
    return target


# ---- what the console page tests share ---------------------------------------------------------

SIZES = [pytest.param(DESKTOP, id="desktop"), pytest.param(PHONE, id="phone")]


def http(bridge: Bridge, token: str | None = ADMIN_TOKEN) -> httpx.AsyncClient:
    """A client of the bridge's admin API with `token` (None: none at all)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30)


@pytest.fixture
async def admin(bridge: Bridge) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the admin API with the admin token."""
    async with http(bridge) as client:
        yield client


async def tab_to(page: Page, selector: str, limit: int = 150) -> None:
    """Press Tab until the element `selector` has the focus (keyboard only, as a person would)."""
    target = page.locator(selector)
    for _ in range(limit):
        if await target.evaluate("node => node === document.activeElement"):
            return
        await page.keyboard.press("Tab")
    raise AssertionError(f"{selector} never got the focus by Tab")
