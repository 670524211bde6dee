"""The console's chat and settings pages in Chromium (issue #19): a real bridge whose chat model
is the loopback fake LLM, a simulated device (the real firmware code) and a stock device with a
risky tool. The pages stream answers, show device tool events and sources, keep the
conversation over a reload, send the settings page's models, and ask before a risky tool."""

import re
from typing import Any

import pytest
from playwright.async_api import Page, expect

from backend.server import Bridge
from testkit.llm_server import FakeCall, FakeLlm, Reply
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
from tests.console_helpers import PHONE, assert_accessible, console_page, save_screenshot
from tests.helpers import create_key

# Fixtures shared with the other chat page tests (tests/console_chat_helpers.py).
__all__ = ["llm_bridge", "risky_device"]

pytestmark = pytest.mark.timeout(120)

VOLUME_LLM = "self_audio_speaker_set_volume"
# A device request and a dental question in one message: the tool runs and the knowledge base
# gives the answer its sources.
VOLUME_AND_QUESTION = "Set the volume to 30 and tell me how long I should brush my teeth"
_MS = re.compile(r"^\d+ ms$")  # a tool call's duration as the page shows it


async def test_a_turn_shows_its_tool_event_and_sources_and_survives_a_reload(
    llm_bridge: Bridge, fake_llm: FakeLlm, simulated_devices: Any
) -> None:
    sim = await simulated_devices(llm_bridge)
    key = await create_key(llm_bridge, *SCOPES)
    fake_llm.script(
        "chat",
        Reply(calls=[FakeCall(VOLUME_LLM, {"volume": 30})]),
        Reply("The volume is now 30. Brush for two minutes, twice a day."),
    )
    async with console_page(llm_bridge, "/", key) as console:
        page = console.page
        await choose_device(page, sim.device_id)
        await ask(page, VOLUME_AND_QUESTION)
        assert sim.hal.get_volume() == 30

        answer = page.locator(".message.assistant").last
        tool = answer.locator(".tool-event")
        await expect(tool).to_have_count(1)
        await expect(tool).to_contain_text("self.audio_speaker.set_volume")
        await expect(tool.locator(".arguments")).to_have_text('{"volume":30}')
        await expect(tool.locator(".result")).to_have_text("true")
        await expect(tool.locator(".duration")).to_have_text(_MS)
        await expect(answer.locator(".text")).to_have_text(
            "The volume is now 30. Brush for two minutes, twice a day."
        )
        links = answer.locator(".sources a")
        assert await links.count() >= 1
        for href in await links.evaluate_all("(links) => links.map((a) => a.href)"):
            assert href.startswith(("http://", "https://"))
        await expect(answer.locator(".language")).to_have_text("Language: English")
        await expect(answer.locator(".offline-badge")).to_have_count(0)
        await expect(page.get_by_role("log")).to_have_attribute("aria-live", "polite")
        # The device's turn asked the server's models (nothing chosen in settings).
        assert fake_llm.models_of("chat") == ["server-chat", "server-chat"]
        await assert_accessible(page)
        await save_screenshot(page, "chat")

        conversation = await page.evaluate(
            "() => sessionStorage.getItem('bridge.chat.conversation')"
        )
        assert conversation
        await page.reload()
        await expect(page.locator(".message.user .text")).to_have_text([VOLUME_AND_QUESTION])
        await expect(page.locator(".message.assistant .text")).to_have_text(
            ["The volume is now 30. Brush for two minutes, twice a day."]
        )
        await expect(page.locator(".message.assistant .sources a").first).to_be_visible()
        current = page.locator("button.conversation[aria-current='true']")
        await expect(current).to_have_attribute("data-id", conversation)
        await expect(page.get_by_label("Device", exact=True)).to_have_value(sim.device_id)
        console.assert_clean()


async def test_the_settings_page_chooses_the_models_of_the_next_request(
    llm_bridge: Bridge, fake_llm: FakeLlm
) -> None:
    fake_llm.models = ["alpha-guard", "beta-chat:7b"]
    key = await create_key(llm_bridge, "chat:use")
    async with console_page(llm_bridge, "/settings", key) as console:
        page = console.page
        chat = page.get_by_label("Chat model")
        guard = page.get_by_label("Guardrail model")
        await expect(chat.locator("option")).to_have_text(
            ["Server default (server-chat)", "alpha-guard", "beta-chat:7b"]
        )
        await expect(page.get_by_text("Server default: server-guard.")).to_be_visible()
        await chat.select_option("beta-chat:7b")
        await guard.select_option("alpha-guard")
        await page.get_by_role("button", name="Save").click()
        await expect(page.get_by_role("status").filter(has_text="Saved")).to_contain_text(
            "chat model beta-chat:7b"
        )
        stored = await page.evaluate("() => JSON.parse(localStorage.getItem('bridge.settings'))")
        assert stored == {"chat_model": "beta-chat:7b", "guardrail_model": "alpha-guard"}
        await assert_accessible(page)
        await save_screenshot(page, "settings")

        await console.goto("/")
        await ask(page, "Chewing gum brands")  # not clearly dental: the guardrail model is asked
        assert fake_llm.models_of("guardrail") == ["alpha-guard"]
        assert fake_llm.models_of("chat") == ["beta-chat:7b"]

        # Back to the server's defaults: the next request names no model.
        await console.goto("/settings")
        await page.get_by_role("button", name="Use the server's defaults").click()
        await expect(page.get_by_role("status").filter(has_text="Saved")).to_be_visible()
        await console.goto("/")
        await ask(page, "How long should I brush my teeth?")
        assert fake_llm.models_of("chat")[-1] == "server-chat"
        console.assert_clean()


async def test_a_failed_listing_is_shown_and_a_saved_model_stays(
    bridge_factory: Any, fake_llm: FakeLlm
) -> None:
    fake_llm.models_status = 503
    bridge = await bridge_factory(llm_provider="ollama", llm_base_url=fake_llm.url)
    key = await create_key(bridge, "chat:use")
    async with console_page(bridge, "/settings", key) as console:
        page = console.page
        await page.evaluate(
            "() => localStorage.setItem('bridge.settings', "
            "JSON.stringify({chat_model: 'kept:1b', guardrail_model: null}))"
        )
        await page.reload()
        await expect(page.get_by_text("The provider listed no models")).to_contain_text("503")
        await expect(page.get_by_label("Chat model")).to_have_value("kept:1b")
        await expect(page.get_by_label("Guardrail model")).to_have_value("")
        console.assert_clean()


async def test_a_risky_tool_runs_after_the_confirm_button_and_not_after_cancel(
    llm_bridge: Bridge, fake_llm: FakeLlm, risky_device: WireDevice
) -> None:
    key = await create_key(llm_bridge, *SCOPES)
    upgrade = FakeCall("self_firmware_upgrade", {"url": "http://x/f.bin"})
    fake_llm.script("chat", Reply("Let me upgrade it.", calls=[upgrade]))
    async with console_page(llm_bridge, "/", key) as console:
        page = console.page
        await choose_device(page, MAC)
        await ask(page, "Upgrade your firmware from http://x/f.bin")
        box = page.get_by_role("group", name="Confirmation")
        await expect(box).to_contain_text(UPGRADE)
        await expect(box.locator("code")).to_have_text([UPGRADE, "http://x/f.bin"])
        await expect(box).to_contain_text("url http://x/f.bin")
        assert risky_device.stock.calls == []
        await assert_accessible(page)
        await box.get_by_role("button", name="Confirm").click()
        await expect(page.locator(".message.user .text").last).to_have_text("yes")
        done = page.locator(".message.assistant").last.locator(".tool-event.completed")
        await expect(done).to_contain_text(UPGRADE)
        await expect(done.locator(".duration")).to_have_text(_MS)
        assert [name for name, _ in risky_device.stock.calls] == [UPGRADE]
        await expect(box).to_have_count(0)  # answered: the buttons are gone

        fake_llm.script("chat", Reply("Let me upgrade it.", calls=[upgrade]))
        await ask(page, "Upgrade your firmware from http://x/f.bin")
        await (
            page.get_by_role("group", name="Confirmation")
            .get_by_role("button", name="Cancel")
            .click()
        )
        await expect(page.locator(".message.assistant .text").last).to_have_text(
            f"OK, I did not run {UPGRADE}."
        )
        assert len(risky_device.stock.calls) == 1
        console.assert_clean()


async def test_offline_mode_is_badged_on_a_phone(bridge: Bridge) -> None:
    key = await create_key(bridge, "chat:use")
    async with console_page(bridge, "/", key, viewport=PHONE) as console:
        page = console.page
        await ask(page, "How long should I brush my teeth?")
        answer = page.locator(".message.assistant").last
        await expect(answer.locator(".offline-badge")).to_have_text("Offline mode")
        await expect(answer.locator(".sources a").first).to_be_visible()
        await no_overflow(page)
        await assert_accessible(page)
        # Without devices:read the device picker is there, disabled, and says why.
        await expect(page.get_by_label("Device", exact=True)).to_be_disabled()
        console.assert_clean()


async def test_stored_text_and_links_are_shown_never_run(bridge: Bridge) -> None:
    """A stored answer is data: markup stays text, and only http(s) sources become links."""
    memory = bridge.frontends.memory
    await memory.get_or_create("hostile")
    evil = (
        "<img src=x onerror=\"document.title='pwned'\">\n\nSources:\n"
        "1. Evil - javascript:document.title='pwned'\n"
        "2. Data - data:text/html,hi\n"
        "3. Good - https://example.org/teeth"
    )
    links = ["javascript:document.title='pwned'", "data:text/html,hi", "https://example.org/teeth"]
    await memory.append_pair("hostile", "<b>hi</b>", evil, metadata={"sources": links})
    key = await create_key(bridge, "chat:use")
    async with console_page(bridge, "/", key) as console:
        page = console.page
        await page.locator("button.conversation[data-id='hostile']").click()
        await expect(page.locator(".message.user .text")).to_have_text(["<b>hi</b>"])
        answer = page.locator(".message.assistant")
        await expect(answer.locator(".text")).to_have_text(
            "<img src=x onerror=\"document.title='pwned'\">"
        )
        await expect(answer.locator("img")).to_have_count(0)
        await expect(answer.locator(".sources a")).to_have_count(1)
        await expect(answer.locator(".sources a")).to_have_attribute(
            "href", "https://example.org/teeth"
        )
        await expect(answer.locator(".sources li")).to_have_text(["Evil", "Data", "Good"])
        assert "pwned" not in await page.title()
        console.assert_clean()


async def test_a_key_without_chat_use_is_told_what_it_lacks(bridge: Bridge) -> None:
    key = await create_key(bridge, "console:talk")
    for path in ("/settings",):
        async with console_page(bridge, path, key) as console:
            notice = console.page.get_by_role("status").filter(has_text="chat:use")
            await expect(notice).to_be_visible()
            await expect(console.page.get_by_label("Message", exact=True)).to_have_count(0)
            console.assert_clean()
    # A key with no page at all is told on the chat page too (a devices-only key lands on
    # Devices: tests/test_console_round_two.py).
    nothing = await create_key(bridge, "mcp:endpoint")
    async with console_page(bridge, "/", nothing) as console:
        notice = console.page.get_by_role("status").filter(has_text="chat:use")
        await expect(notice).to_be_visible()
        console.assert_clean()


async def test_a_conversation_deleted_elsewhere_starts_afresh(bridge: Bridge) -> None:
    key = await create_key(bridge, "chat:use")
    async with console_page(bridge, "/", key) as console:
        page: Page = console.page
        await ask(page, "How long should I brush my teeth?")
        conversation = await page.evaluate(
            "() => sessionStorage.getItem('bridge.chat.conversation')"
        )
        assert await bridge.frontends.memory.delete(conversation)
        await page.reload()
        await expect(page.get_by_role("heading", name="New conversation")).to_be_visible()
        await expect(page.get_by_label("Message", exact=True)).to_be_enabled()
        assert (
            await page.evaluate("() => sessionStorage.getItem('bridge.chat.conversation')") is None
        )
        # The 404 of the deleted conversation is the page's own check, not an error.
        console.assert_clean(allow_errors=["404"])


async def test_a_new_conversation_with_a_device_is_not_the_devices_own(
    llm_bridge: Bridge, simulated_devices: Any
) -> None:
    sim = await simulated_devices(llm_bridge)
    key = await create_key(llm_bridge, *SCOPES)
    stored = "() => sessionStorage.getItem('bridge.chat.conversation')"
    async with console_page(llm_bridge, "/", key) as console:
        page = console.page
        await choose_device(page, sim.device_id)
        await ask(page, "How long should I brush my teeth?")
        first = await page.evaluate(stored)
        await page.get_by_role("button", name="New conversation").click()
        await expect(page.locator(".message")).to_have_count(0)
        await ask(page, "How often should I floss?")
        second = await page.evaluate(stored)
        assert first != second and first.startswith("web-") and second.startswith("web-")
        await expect(page.locator(".message.user .text")).to_have_text(
            ["How often should I floss?"]
        )
        await expect(page.locator("button.conversation")).to_have_count(2)
        device_turns = await llm_bridge.frontends.memory.list_conversations(
            limit=10, offset=0, device_id=sim.device_id
        )
        assert {item.id for item in device_turns.items} == {first, second}
        console.assert_clean()
