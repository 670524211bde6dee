"""What the chat page's browser tests share: a bridge whose chat model is the loopback fake LLM,
a stock device with a risky tool, and the page actions (ask, choose a device, no sideways
scrolling on a phone)."""

from collections.abc import AsyncIterator
from typing import Any

import pytest
from playwright.async_api import Page, expect

from backend.server import Bridge
from testkit.llm_server import FakeLlm
from testkit.settings import DEVICE_TOKEN
from testkit.stock_device import STATUS_TOOL, VOLUME_TOOL, WireDevice
from tests.console_helpers import PHONE
from tests.helpers import wait_state

UPGRADE = "self.firmware.upgrade"
MAC = "a4:cf:12:34:56:78"
SCOPES = ("chat:use", "devices:read", "devices:call")


@pytest.fixture
async def llm_bridge(bridge_factory: Any, fake_llm: FakeLlm) -> Bridge:
    bridge: Bridge = await bridge_factory(
        llm_provider="openai",
        llm_base_url=fake_llm.url,
        llm_model="server-chat",
        guardrail_model="server-guard",
    )
    return bridge


async def ask(page: Page, text: str) -> None:
    """Types a message, sends it with Enter and waits until the answer is complete."""
    answers = page.locator(".message.assistant[aria-busy='false']")
    before = await answers.count()
    await page.get_by_label("Message", exact=True).fill(text)
    await page.get_by_label("Message", exact=True).press("Enter")
    await expect(answers).to_have_count(before + 1)


async def choose_device(page: Page, device_id: str) -> None:
    picker = page.get_by_label("Device", exact=True)
    await expect(picker.locator(f"option[value='{device_id}']")).to_have_count(1)
    await picker.select_option(device_id)


async def no_overflow(page: Page) -> None:
    """Nothing wider than the screen (a 375 px phone scrolls only vertically)."""
    width = await page.evaluate("() => document.documentElement.scrollWidth")
    assert width <= PHONE["width"], width


@pytest.fixture
async def risky_device(llm_bridge: Bridge) -> AsyncIterator[WireDevice]:
    url = {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}
    upgrade = {"name": UPGRADE, "description": "Upgrade the firmware.", "inputSchema": url}
    tools = [STATUS_TOOL, VOLUME_TOOL, upgrade]
    wire = WireDevice(llm_bridge.ws_url, DEVICE_TOKEN, MAC, tools=tools)
    await wire.connect()
    await wait_state(llm_bridge, MAC)
    yield wire
    await wire.close()
