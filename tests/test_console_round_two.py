"""The console, round two (chat and devices pages) in Chromium: a risky tool waits for the user
in plain words with its buttons in view, answers are Markdown built safely, a streamed answer
can be stopped, a devices-only key lands on Devices, and the devices page marks risky tools,
starts its forms from the device's status and keeps its table readable."""

from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Locator, Page, expect

from backend.server import Bridge
from simulator.fleet import SimulatedDevice
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from testkit.stock_device import WireDevice
from tests.console_chat_helpers import (
    MAC,
    SCOPES,
    UPGRADE,
    ask,
    choose_device,
    llm_bridge,
    no_overflow,
    risky_device,
)
from tests.console_helpers import DESKTOP, PHONE, assert_accessible, console_page
from tests.helpers import create_key

# The chat tests' bridge with the fake LLM, and their device with a risky tool.
__all__ = ["llm_bridge", "risky_device"]

pytestmark = pytest.mark.timeout(120)

REBOOT = "self.reboot"
SET_VOLUME = "self.audio_speaker.set_volume"
LONG_ANSWER = "\n\n".join(f"Paragraph {n}: brush gently along the gum line." for n in range(12))


async def visible_rect(page: Page, locator: Locator) -> dict[str, float]:
    """The part of an element on screen: its box clipped by the viewport."""
    box = await locator.bounding_box()
    assert box is not None
    size = page.viewport_size
    assert size is not None
    return {
        "top": max(box["y"], 0),
        "bottom": min(box["y"] + box["height"], size["height"]),
        "left": max(box["x"], 0),
        "right": min(box["x"] + box["width"], size["width"]),
    }


async def assert_within(page: Page, inner: Locator, outer: Locator) -> None:
    """`inner` is wholly inside the visible part of `outer` (and so on screen)."""
    area = await visible_rect(page, outer)
    box = await inner.bounding_box()
    assert box is not None
    assert area["top"] - 1 <= box["y"], (box, area)
    assert box["y"] + box["height"] <= area["bottom"] + 1, (box, area)
    assert area["left"] - 1 <= box["x"] and box["x"] + box["width"] <= area["right"] + 1


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
async def test_a_risky_tool_waits_for_the_user_in_view(
    llm_bridge: Bridge,
    fake_llm: FakeLlm,
    risky_device: WireDevice,
    viewport: dict[str, int],
) -> None:
    key = await create_key(llm_bridge, *SCOPES)
    upgrade = FakeCall("self_firmware_upgrade", {"url": "http://x/f.bin"})
    fake_llm.script("chat", Reply(LONG_ANSWER), Reply("Let me upgrade it.", calls=[upgrade]))
    async with console_page(llm_bridge, "/", key, viewport=viewport) as console:
        page = console.page
        log = page.get_by_role("log")
        await choose_device(page, MAC)
        await ask(page, "How should I brush my teeth?")
        # A finished answer's last line is in the visible part of the log, not clipped.
        last = page.locator(".message.assistant").last
        await assert_within(page, last.locator(".text p").last, log)
        await assert_within(page, last.locator(".meta .badge").last, log)

        await ask(page, "Upgrade your firmware from http://x/f.bin")
        answer = page.locator(".message.assistant").last
        tool = answer.locator(".tool-event")
        await expect(tool.locator(".badge")).to_have_text("waiting for you")
        await expect(tool).to_have_attribute("data-status", "waiting")
        await expect(tool).not_to_contain_text("failed")
        await expect(tool).not_to_contain_text("not run yet")
        # The question is asked once, by the box, in plain words.
        await expect(answer.locator(".text")).to_have_text("Let me upgrade it.")
        box = page.get_by_role("group", name="Confirmation")
        await expect(box).to_contain_text("waiting for you")
        await expect(box).to_contain_text("Press Confirm to run it")
        text = await box.inner_text()
        assert "rule" not in text and "This needs your confirmation" not in text
        assert "self.firmware.*" not in text and "*upgrade*" not in text
        confirm = box.get_by_role("button", name="Confirm")
        cancel = box.get_by_role("button", name="Cancel")
        await assert_within(page, confirm, log)
        await assert_within(page, cancel, log)
        if viewport == PHONE:
            await no_overflow(page)
        await assert_accessible(page)
        # The keyboard reaches the buttons: the box has the focus, Tab goes to Confirm.
        await expect(box).to_be_focused()
        await page.keyboard.press("Tab")
        await expect(confirm).to_be_focused()
        await page.keyboard.press("Enter")
        done = page.locator(".message.assistant").last.locator(".tool-event.completed")
        await expect(done).to_contain_text(UPGRADE)
        assert [name for name, _ in risky_device.stock.calls] == [UPGRADE]
        console.assert_clean()


MARKDOWN = """Here is **how** to *brush*, with `fluoride`:

- two minutes
- twice a day

1. wet the brush
2. brush each tooth

```
rinse && spit <b>
```

See [the guide](https://example.org/brush) or https://example.org/floss.
Danger: <img src=x onerror="window.pwned=1"> and [click](javascript:window.pwned=2) \
and <a href="javascript:window.pwned=3">a</a> and [data](data:text/html,hi)."""


async def test_answers_are_markdown_built_safely(llm_bridge: Bridge, fake_llm: FakeLlm) -> None:
    key = await create_key(llm_bridge, "chat:use")
    fake_llm.script("chat", Reply(MARKDOWN))
    async with console_page(llm_bridge, "/", key) as console:
        page = console.page
        await ask(page, "How should I brush my teeth?")
        text = page.locator(".message.assistant").last.locator(".text")
        await expect(text.locator("strong")).to_have_text("how")
        await expect(text.locator("em")).to_have_text("brush")
        await expect(text.locator("p code")).to_have_text("fluoride")
        await expect(text.locator("ul > li")).to_have_text(["two minutes", "twice a day"])
        await expect(text.locator("ol > li")).to_have_text(["wet the brush", "brush each tooth"])
        await expect(text.locator("pre code")).to_have_text("rinse && spit <b>")
        links = text.locator("a")
        await expect(links).to_have_text(["the guide", "https://example.org/floss"])
        for at, href in enumerate(("https://example.org/brush", "https://example.org/floss")):
            await expect(links.nth(at)).to_have_attribute("href", href)
            await expect(links.nth(at)).to_have_attribute("target", "_blank")
            await expect(links.nth(at)).to_have_attribute("rel", "noopener noreferrer")
        # Hostile markup is text, shown as written; no javascript: or data: link is made.
        await expect(text).to_contain_text('<img src=x onerror="window.pwned=1">')
        await expect(text).to_contain_text("[click](javascript:window.pwned=2)")
        await expect(text).to_contain_text('<a href="javascript:window.pwned=3">a</a>')
        await expect(text).to_contain_text("[data](data:text/html,hi)")
        assert await page.locator(".message img, .message b, .message script").count() == 0
        await links.first.evaluate("(a) => a.addEventListener('click', (e) => e.preventDefault())")
        assert await page.evaluate("() => window.pwned === undefined")
        await assert_accessible(page)

        # The stored answer, read back on a reload, is built the same way.
        await page.reload()
        stored = page.locator(".message.assistant .text")
        await expect(stored.locator("ul > li")).to_have_count(2)
        await expect(stored.locator("a")).to_have_count(2)
        assert await page.locator(".message img").count() == 0
        assert await page.evaluate("() => window.pwned === undefined")
        console.assert_clean()


async def test_a_streamed_answer_can_be_stopped_and_the_box_stays_usable(
    llm_bridge: Bridge, fake_llm: FakeLlm
) -> None:
    key = await create_key(llm_bridge, "chat:use")
    fake_llm.script("chat", Reply(fault="endless"), Reply("Floss once a day."))
    async with console_page(llm_bridge, "/", key) as console:
        page = console.page
        message = page.get_by_label("Message", exact=True)
        await message.fill("How should I brush my teeth?")
        await message.press("Enter")
        answer = page.locator(".message.assistant").last
        await expect(answer.locator(".text")).to_contain_text("and and")
        stop = page.get_by_role("button", name="Stop")
        await expect(stop).to_be_visible()
        # The message box is not locked: the next question can be written meanwhile.
        await expect(message).to_be_enabled()
        await message.fill("How often should I floss?")
        await message.press("Enter")  # sends nothing while the answer runs
        await expect(page.locator(".message.user")).to_have_count(1)
        await stop.click()
        await expect(answer).to_have_attribute("aria-busy", "false")
        await expect(answer.locator(".stopped")).to_contain_text("Stopped")
        await expect(stop).to_be_hidden()
        await expect(message).to_have_value("How often should I floss?")
        await expect(page.get_by_role("button", name="Send")).to_be_enabled()
        await ask(page, "How often should I floss?")
        await expect(page.locator(".message.assistant .text").last).to_have_text(
            "Floss once a day."
        )
        await assert_accessible(page)
        console.assert_clean()


async def test_a_devices_only_key_lands_on_devices(bridge: Bridge) -> None:
    key = await create_key(bridge, "devices:read", "devices:call")
    async with console_page(bridge, "/", key) as console:
        page = console.page
        await page.wait_for_url(console.url("/devices"))
        await expect(page.get_by_role("heading", level=1, name="Devices")).to_be_visible()
        await expect(page.get_by_label("Message", exact=True)).to_have_count(0)
        console.assert_clean()


def row(page: Page, device_id: str) -> Locator:
    return page.locator(f'tr[data-device-id="{device_id}"]')


def tool(page: Page, name: str) -> Locator:
    return page.locator(f'article[data-tool="{name}"]')


# Every state badge text of the fleet table, as it changes (a new device must not say offline).
_WATCH_BADGES = """() => {
  window.badges = [];
  new MutationObserver(() => {
    for (const badge of document.querySelectorAll("#device-rows .badge")) {
      window.badges.push(badge.textContent);
    }
  }).observe(document.getElementById("device-rows"), {subtree: true, childList: true,
    characterData: true});
}"""


@pytest.fixture
async def ota_device(bridge: Bridge) -> AsyncIterator[SimulatedDevice]:
    """A simulated device that, as a real one, asks the OTA endpoint first (its catalogue row,
    offline, exists a moment before it connects); not started."""
    url = bridge.provisioning.ota_url
    device = SimulatedDevice("", DEVICE_TOKEN, index=3, ota_url=url, ota_poll_s=0.2)
    yield device
    await device.stop()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
async def test_the_devices_page_marks_risky_tools_and_starts_from_the_status(
    bridge: Bridge, ota_device: SimulatedDevice, viewport: dict[str, int]
) -> None:
    async with console_page(bridge, "/devices", ADMIN_TOKEN, viewport=viewport) as console:
        page = console.page
        await expect(page.locator("#fleet-status")).to_have_text("0 devices, 0 online")
        await page.evaluate(_WATCH_BADGES)
        device = ota_device
        device.start()
        device.hal.set_volume(42)
        device.hal.set_brightness(65)
        device.hal.set_theme("dark")
        line = row(page, device.device_id)
        await expect(line.locator(".badge")).to_have_text("ready")
        seen = await page.evaluate("() => window.badges")
        assert "offline" not in seen and "ready" in seen, seen

        await line.get_by_role("button", name=device.device_id).click()
        await tool(page, SET_VOLUME).wait_for()
        # The forms start from what the status tool says the device has now.
        volume = tool(page, SET_VOLUME).get_by_role("spinbutton", name="volume (required)")
        await expect(volume).to_have_value("42")
        brightness = tool(page, "self.screen.set_brightness").get_by_role("spinbutton")
        await expect(brightness).to_have_value("65")
        theme = tool(page, "self.screen.set_theme").get_by_role("textbox", name="theme")
        await expect(theme).to_have_value("dark")
        await expect(tool(page, SET_VOLUME).locator(".prefilled")).to_contain_text("Now 42")
        # The LED's brightness is not the screen's: its form keeps the schema's default.
        led = tool(page, "self.led.set").get_by_role("spinbutton", name="brightness")
        await expect(led).to_have_value("100")

        # A risky tool says so before it is called; a harmless one does not.
        reboot = tool(page, REBOOT)
        await expect(reboot.get_by_role("heading")).to_contain_text("asks to confirm")
        await expect(tool(page, SET_VOLUME).locator(".risky-badge")).to_have_count(0)
        await assert_accessible(page)
        await reboot.get_by_role("button", name="Call").click()
        confirm = reboot.locator(".confirm")
        await expect(confirm).to_contain_text(f"Press “Confirm {REBOOT}”")
        text = await confirm.inner_text()
        assert "(API)" not in text and "--confirm" not in text and '"confirm"' not in text
        await expect(reboot.get_by_role("button", name=f"Confirm {REBOOT}")).to_be_focused()
        await assert_accessible(page)

        if viewport == DESKTOP:
            # With a device open beside it, the table's headers and transport stay whole.
            fits = await page.evaluate(
                """() => [...document.querySelectorAll('table.fleet thead th')].map(
                     (th) => th.scrollWidth <= th.clientWidth)"""
            )
            assert all(fits), fits
            cell = line.locator("td.transport")
            await expect(cell).to_have_text("websocket")
            lines = await cell.evaluate(
                """(td) => { const range = document.createRange();
                   range.selectNodeContents(td); return range.getClientRects().length; }"""
            )
            assert lines == 1
            scroll = await cell.evaluate("(td) => td.scrollWidth <= td.clientWidth")
            assert scroll
        else:
            await no_overflow(page)
        console.assert_clean(allow_errors=["status of 428 (Precondition Required)"])


async def test_a_device_that_stays_offline_is_still_shown(bridge: Bridge) -> None:
    """The grace a new offline device gets is short: one that never connects appears."""
    async with console_page(bridge, "/devices", ADMIN_TOKEN) as console:
        page = console.page
        await expect(page.locator("#fleet-status")).to_have_text("0 devices, 0 online")
        device = SimulatedDevice("", DEVICE_TOKEN, index=4)
        await device.provision(bridge.provisioning.ota_url)  # OTA only: never connects
        await expect(row(page, device.device_id).locator(".badge")).to_have_text("offline")
        await expect(page.locator("#fleet-status")).to_have_text("1 device, 0 online")
        console.assert_clean()
