"""The devices page in Chromium (tests/console_helpers.py): the live fleet from the event stream,
a tool form generated from its inputSchema that really calls the device, the confirmation of a
risky tool, a key that may read but not call, accessibility and the page's own requests."""

from collections.abc import Callable
from typing import Any

import pytest
from playwright.async_api import Page, expect

from backend.server import Bridge
from simulator.fleet import device_id_for
from testkit.settings import ADMIN_TOKEN
from tests.console_helpers import (
    PHONE,
    ConsolePage,
    assert_accessible,
    console_page,
    save_screenshot,
)
from tests.helpers import create_key, eventually, wait_state

pytestmark = pytest.mark.timeout(120)

SET_VOLUME = "self.audio_speaker.set_volume"
REBOOT = "self.reboot"
# Chromium logs every 4xx answer as a console error; 428 is the API asking for a confirmation.
ASKED = "status of 428 (Precondition Required)"


def row(page: Page, device_id: str) -> Any:
    return page.locator(f'tr[data-device-id="{device_id}"]')


def tool(page: Page, name: str) -> Any:
    return page.locator(f'article[data-tool="{name}"]')


async def open_device(console: ConsolePage, device_id: str, first_tool: str = SET_VOLUME) -> None:
    page = console.page
    await row(page, device_id).get_by_role("button", name=device_id).click()
    await expect(page.get_by_role("heading", level=2, name=device_id)).to_be_focused()
    await tool(page, first_tool).wait_for()


def never_polls(console: ConsolePage) -> bool:
    """The page never polls: one event stream, no listing requests."""
    urls = [response.url for response in console.responses]
    return all("/api/devices?" not in url and not url.endswith("/api/devices") for url in urls)


async def test_a_device_appears_and_goes_offline_without_a_reload(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    async with console_page(bridge, "/devices", ADMIN_TOKEN) as console:
        page = console.page
        await expect(page.locator("#fleet-status")).to_have_text("0 devices, 0 online")
        device = await simulated_devices(bridge)
        line = row(page, device.device_id)
        await expect(line.locator(".badge")).to_have_text("ready")
        await expect(line).to_contain_text("websocket")
        live = bridge.registry.get(device.device_id)
        assert live is not None
        await expect(line.locator("td.num")).to_have_text(str(len(live.tools)))
        await device.stop()
        await expect(line.locator(".badge")).to_have_text("offline")
        await expect(page.locator("#fleet-status")).to_have_text("1 device, 0 online")
        bridge.registry.forget(device.device_id)
        await expect(line).to_have_count(0)
        navigations = [r for r in console.responses if r.request.resource_type == "document"]
        assert len(navigations) == 1  # never reloaded
        assert never_polls(console)
        console.assert_clean()


async def test_search_and_state_filter(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    first = await simulated_devices(bridge, 1)
    second = await simulated_devices(bridge, 2)
    await second.stop()
    async with console_page(bridge, "/devices", ADMIN_TOKEN, viewport=PHONE) as console:
        page = console.page
        await expect(page.locator("#fleet-status")).to_have_text("2 devices, 1 online")
        await page.get_by_label("State").select_option("offline")
        await expect(page.locator("tbody tr[data-device-id]")).to_have_count(1)
        await expect(row(page, second.device_id)).to_have_count(1)
        await page.get_by_label("State").select_option("all")
        await page.get_by_label("Search").fill(first.device_id[-5:])
        await expect(page.locator("tbody tr[data-device-id]")).to_have_count(1)
        await expect(row(page, first.device_id)).to_have_count(1)
        await page.get_by_label("Search").fill("no such device")
        await expect(page.locator("tbody")).to_contain_text("No device matches.")
        await expect(page.locator("#fleet-status")).to_have_text(
            "0 of 2 devices match (1 online in all)"
        )
        await page.get_by_label("Search").fill("")
        await open_device(console, first.device_id)  # on a phone: the detail under the list
        await assert_accessible(page)
        await page.keyboard.press("Escape")  # closes the detail, focus back on the row
        await expect(row(page, first.device_id).get_by_role("button")).to_be_focused()
        await expect(page.locator("#device-detail")).to_be_hidden()
        console.assert_clean()


async def test_set_volume_from_the_generated_form_changes_the_device(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    device = await simulated_devices(bridge)
    async with console_page(bridge, "/devices", ADMIN_TOKEN) as console:
        page = console.page
        await open_device(console, device.device_id)
        form = tool(page, SET_VOLUME)
        volume = form.get_by_role("spinbutton", name="volume (required)")
        # The schema's integer range became a number input's bounds.
        assert await volume.get_attribute("type") == "number"
        assert await volume.get_attribute("min") == "0"
        assert await volume.get_attribute("max") == "100"
        await volume.fill("37")
        await form.get_by_role("button", name="Call").click()
        await expect(form.locator(".output")).to_contain_text("Result in")
        await expect(form.locator(".output pre")).to_have_text("true")
        assert device.hal.get_volume() == 37
        await expect(page.locator(".audit-table")).to_contain_text(SET_VOLUME)
        await page.evaluate("window.scrollTo(0, 0)")
        await save_screenshot(page, "devices")
        # An out-of-range value is stopped in the page (the browser's own validation).
        await volume.fill("250")
        await form.get_by_role("button", name="Call").click()
        assert await volume.evaluate("input => input.validity.rangeOverflow")
        assert device.hal.get_volume() == 37
        # The call is in the device's recent audit rows.
        await expect(page.locator(".audit-table")).to_contain_text(SET_VOLUME)
        await expect(page.locator(".audit-table")).to_contain_text("admin")
        await assert_accessible(page)
        assert never_polls(console)
        console.assert_clean()


async def test_a_risky_tool_needs_the_confirmation_click(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    device = await simulated_devices(bridge)
    async with console_page(bridge, "/devices", ADMIN_TOKEN) as console:
        page = console.page
        await open_device(console, device.device_id)
        form = tool(page, REBOOT)
        await form.get_by_role("button", name="Call").click()
        confirm = form.get_by_role("button", name=f"Confirm {REBOOT}")
        await expect(confirm).to_be_focused()
        await expect(form.locator(".confirm")).to_contain_text("needs your confirmation")
        entries = await bridge.audit.entries(device_id=device.device_id, tool=REBOOT)
        assert [entry.outcome for entry in entries] == ["refused"]
        assert not entries[0].confirmed
        await assert_accessible(page)
        await confirm.click()
        await expect(form.locator(".output")).to_contain_text("Result in")

        async def confirmed() -> bool:
            found = await bridge.audit.entries(device_id=device.device_id, tool=REBOOT)
            return any(entry.confirmed and entry.outcome == "ok" for entry in found)

        assert await confirmed()
        console.assert_clean(allow_errors=[ASKED])


async def test_cancel_leaves_a_risky_tool_uncalled(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    device = await simulated_devices(bridge)
    async with console_page(bridge, "/devices", ADMIN_TOKEN) as console:
        page = console.page
        await open_device(console, device.device_id)
        form = tool(page, REBOOT)
        await form.get_by_role("button", name="Call").click()
        await form.get_by_role("button", name="Cancel").click()
        await expect(form.locator(".output")).to_have_text("Not called.")
        entries = await bridge.audit.entries(device_id=device.device_id, tool=REBOOT)
        assert [entry.confirmed for entry in entries] == [False]
        console.assert_clean(allow_errors=[ASKED])


async def test_a_key_without_devices_call_sees_tools_but_cannot_call(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    device = await simulated_devices(bridge)
    key = await create_key(bridge, "devices:read")
    async with console_page(bridge, "/devices", key) as console:
        page = console.page
        await open_device(console, device.device_id)
        form = tool(page, SET_VOLUME)
        await expect(form.get_by_role("button", name="Call")).to_be_disabled()
        await expect(page.locator("#call-denied")).to_contain_text("lacks the devices:call scope")
        await expect(form).to_contain_text("Set the speaker volume")
        # Even a form sent by hand (Enter in the field) calls nothing.
        await form.get_by_role("spinbutton", name="volume (required)").fill("5")
        await form.get_by_role("spinbutton", name="volume (required)").press("Enter")
        calls = [r for r in console.responses if r.url.endswith("/tools/call")]
        assert calls == []
        await assert_accessible(page)
        console.assert_clean()


async def test_a_key_limited_to_one_device_sees_and_calls_only_it(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    mine = await simulated_devices(bridge, 1)
    await simulated_devices(bridge, 2)
    key = await create_key(bridge, "devices:call", devices=[mine.device_id])
    async with console_page(bridge, "/devices", key) as console:
        page = console.page
        await expect(page.locator("#fleet-status")).to_have_text("1 device, 1 online")
        await expect(row(page, device_id_for(2))).to_have_count(0)
        await open_device(console, mine.device_id)
        form = tool(page, SET_VOLUME)
        await form.get_by_role("spinbutton", name="volume (required)").fill("11")
        await form.get_by_role("button", name="Call").click()
        await expect(form.locator(".output")).to_contain_text("Result in")
        await eventually(lambda: mine.hal.get_volume() == 11)
        console.assert_clean()


async def test_a_key_without_devices_read_is_told_why(bridge: Bridge) -> None:
    key = await create_key(bridge, "chat:use")
    async with console_page(bridge, "/devices", key) as console:
        await expect(console.page.get_by_role("status").first).to_contain_text("devices:read")
        calls = [r.url for r in console.responses if "/api/devices" in r.url]
        assert calls == []
        console.assert_clean()


# Every kind of field a schema can ask for, and text a hostile device could send as markup.
SETUP = {
    "name": "self.panel.setup",
    "description": "<b>Set up</b> the panel <script>window.pwned = 1</script>",
    "inputSchema": {
        "type": "object",
        "properties": {
            "mode": {"type": "string", "enum": ["eco", "turbo"], "description": "<i>how</i>"},
            "level": {"type": "integer", "minimum": 1, "maximum": 5},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "enabled": {"type": "boolean"},
            "label": {"type": "string"},
            "options": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "steps": {"type": "array", "items": {"type": "integer"}},
            "__proto__": {"type": "string"},
        },
        "required": ["mode", "level"],
    },
}


async def test_the_form_follows_the_schema_and_shows_markup_as_text(
    bridge: Bridge, wire_devices: Callable[..., Any]
) -> None:
    device = wire_devices("a4:cf:00:00:00:01", tools=[SETUP])
    await device.connect()
    await wait_state(bridge, device.device_id)
    async with console_page(bridge, "/devices", ADMIN_TOKEN) as console:
        page = console.page
        await open_device(console, device.device_id, SETUP["name"])
        form = tool(page, SETUP["name"])
        await expect(form).to_contain_text("<script>window.pwned = 1</script>")
        await expect(form).to_contain_text("<i>how</i>")
        assert await form.locator("script, b, i").count() == 0
        mode = form.get_by_role("combobox", name="mode (required)")
        assert await mode.locator("option").all_inner_texts() == ["eco", "turbo"]
        await mode.select_option(label="turbo")
        level = form.get_by_role("spinbutton", name="level (required)")
        assert [await level.get_attribute(a) for a in ("min", "max", "step")] == ["1", "5", "1"]
        await level.fill("4")
        await form.get_by_role("spinbutton", name="ratio").fill("0.25")
        await form.get_by_role("checkbox", name="enabled").check()
        await form.get_by_role("textbox", name="label", exact=True).fill("<b>x</b>")
        options = form.get_by_role("textbox", name="options")
        steps = form.get_by_role("textbox", name="steps")
        assert await options.evaluate("node => node.tagName") == "TEXTAREA"
        await options.fill('{"a": ')  # not JSON: refused in the page, nothing sent
        await form.get_by_role("button", name="Call").click()
        await expect(form.get_by_role("alert")).to_have_text("options: not valid JSON")
        assert device.stock.calls == []
        await options.fill('{"a": 2}')
        await steps.fill("[3, 1]")
        await form.get_by_role("textbox", name="__proto__").fill("p")
        await form.get_by_role("button", name="Call").click()
        await expect(form.locator(".output")).to_contain_text("Result in")
        assert device.stock.calls == [
            (
                SETUP["name"],
                {
                    "mode": "turbo",
                    "level": 4,
                    "ratio": 0.25,
                    "enabled": True,
                    "label": "<b>x</b>",
                    "options": {"a": 2},
                    "steps": [3, 1],
                    "__proto__": "p",
                },
            )
        ]
        assert await page.evaluate("() => window.pwned === undefined")
        await assert_accessible(page)
        console.assert_clean()


async def test_the_voice_language_is_chosen_per_device_and_only_by_an_admin(
    bridge: Bridge, simulated_devices: Callable[..., Any]
) -> None:
    device = await simulated_devices(bridge)
    vietnamese = "vi" in bridge.frontends.languages_available
    chosen, heard = ("vi", "Vietnamese") if vietnamese else ("en", "English")
    async with console_page(bridge, "/devices", ADMIN_TOKEN) as console:
        page = console.page
        await open_device(console, device.device_id)
        language = page.get_by_role("combobox", name="Language it is heard in")
        effective = page.locator("#voice-effective")
        await expect(language).to_have_value("auto")
        await expect(effective).to_have_text("Heard in English now.")
        await expect(language.locator('option[value="vi"]')).to_be_enabled(enabled=vietnamese)
        await language.select_option(chosen)
        await expect(effective).to_have_text(f"Heard in {heard} now.")
        await eventually(lambda: bridge.frontends.languages.setting(device.device_id) == chosen)
        # Saved on the bridge, not only in the page: a fresh look at the device shows it.
        await page.get_by_role("button", name="Close").click()
        await open_device(console, device.device_id)
        await expect(language).to_have_value(chosen)
        await assert_accessible(page)
        console.assert_clean()
    reader = await create_key(bridge, "devices:call")
    async with console_page(bridge, "/devices", reader) as console:
        page = console.page
        await open_device(console, device.device_id)
        language = page.get_by_role("combobox", name="Language it is heard in")
        await expect(page.locator("#voice-effective")).to_contain_text("needs the admin scope")
        await expect(language).to_have_value(chosen)
        await expect(language).to_be_disabled()
        puts = [r for r in console.responses if r.request.method == "PUT"]
        assert puts == []
        console.assert_clean()
