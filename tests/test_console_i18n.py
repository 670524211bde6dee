"""The console in English and Vietnamese (backend/console/static/i18n.js): every text module
(`static/text/*.js`) has the same keys, of the same kind, in both languages, and a Vietnamese
value for each; a browser whose language is Vietnamese gets the pages in Vietnamese, with no
English sentence left over; the header's switch changes the language, and the choice sticks."""

import json
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import cache
from typing import Any

import pytest
from playwright.async_api import Page, expect

from backend.console.routes import STATIC_DIR
from backend.server import Bridge
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN
from tests.console_helpers import (
    PHONE,
    ConsolePage,
    assert_accessible,
    console_page,
)
from tests.helpers import create_key

pytestmark = pytest.mark.timeout(120)

TEXT_DIR = STATIC_DIR / "text"
TEXT_FILES = sorted(path.name for path in TEXT_DIR.glob("*.js"))
# Vietnamese values that may equal the English ones: names and technical words a Vietnamese
# interface keeps as they are. `{0}` stands for the first value a function shows.
SAME_IN_BOTH = {
    "MCP",
    "API",
    "ID",
    "HTTP",
    "WebSocket",
    "MQTT",
    "websocket",
    "mqtt",
    "SHA-256",
    "SHA-256 {0}",
    "Firmware",
    "Bridge",
    "{0} ms",
    "admin, key:<id>, chat:…, device:<id>",
}

# Imports every text module (as a data: URL: no package.json makes them ES modules for Node),
# calls each function with the markers {0}, {1}... (a function of a flag or a count shows one of
# its forms) and reports what each language renders.
_NODE_CHECK = r"""
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";

const dir = process.env.TEXT_DIR;
const marker = (index) => `{${index}}`;
const report = {};
for (const name of readdirSync(dir).filter((file) => file.endsWith(".js")).sort()) {
  const entry = { problems: [], en: {}, vi: {} };
  report[name] = entry;
  const source = readFileSync(join(dir, name), "utf8");
  let table;
  try {
    const url = "data:text/javascript;base64," + Buffer.from(source).toString("base64");
    table = (await import(url)).default;
  } catch (error) {
    entry.problems.push(`does not load: ${error.message}`);
    continue;
  }
  if (!table || typeof table.en !== "object" || typeof table.vi !== "object") {
    entry.problems.push("no `export default { en: {...}, vi: {...} }`");
    continue;
  }
  compare(entry, "", table.en, table.vi);
}

// A value is text, a function of the values it shows, or a table (an object or a list) of
// them, the same in both languages: walked as `key.inner` paths.
function compare(entry, path, en, vi) {
  const keys = new Set([...Object.keys(en), ...Object.keys(vi)]);
  for (const key of keys) {
    const at = path ? `${path}.${key}` : key;
    const values = { en: en[key], vi: vi[key] };
    if (!(key in en) || !(key in vi)) {
      entry.problems.push(`${at}: only in ${key in en ? "en" : "vi"}`);
      continue;
    }
    const kinds = Object.values(values).map(kindOf);
    if (kinds[0] !== kinds[1] || kinds[0] === "other") {
      entry.problems.push(`${at}: en is ${kinds[0]}, vi ${kinds[1]}`);
      continue;
    }
    if (kinds[0] === "table") {
      compare(entry, at, values.en, values.vi);
      continue;
    }
    if (kinds[0] === "function" && values.en.length !== values.vi.length) {
      entry.problems.push(`${at}: en takes ${values.en.length} values, vi ${values.vi.length}`);
    }
    for (const [language, value] of Object.entries(values)) {
      let shown = value;
      if (typeof value === "function") {
        const markers = Array.from({ length: value.length }, (_, index) => marker(index));
        try {
          const result = value(...markers);
          shown = Array.isArray(result) ? result.flat(Infinity).join("") : result;
        } catch (error) {
          entry.problems.push(`${at} (${language}): fails with sample values: ${error.message}`);
          continue;
        }
        if (typeof shown !== "string") {
          entry.problems.push(`${at} (${language}): gives ${typeof shown}, not text`);
          continue;
        }
      }
      // An empty value (a select's "any" option) only where English is empty too.
      const english = language === "en" ? shown : entry.en[at] || "";
      if (!shown.trim() && english.trim()) entry.problems.push(`${at} (${language}): empty`);
      entry[language][at] = shown;
    }
  }
}

function kindOf(value) {
  if (typeof value === "string") return "text";
  if (typeof value === "function") return "function";
  if (value && typeof value === "object") return "table";
  return "other";
}

console.log(JSON.stringify(report));
"""


@cache
def rendered_texts() -> dict[str, Any]:
    """{file: {problems, en: {key: text}, vi: {key: text}}} of every text module."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed")
    done = subprocess.run(
        [node, "--input-type=module", "-e", _NODE_CHECK],
        capture_output=True,
        text=True,
        timeout=60,
        env={"TEXT_DIR": str(TEXT_DIR), "PATH": ""},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


@pytest.mark.parametrize("name", TEXT_FILES)
def test_every_text_module_has_the_same_strings_in_both_languages(name: str) -> None:
    entry = rendered_texts()[name]
    assert not entry["problems"], entry["problems"]
    untranslated = [
        key
        for key, english in entry["en"].items()
        if entry["vi"].get(key) == english and english not in SAME_IN_BOTH and words(english)
    ]
    assert not untranslated, f"{name}: Vietnamese equals English for {untranslated}"


def words(text: str) -> bool:
    """Whether `text` says something besides the values it shows (a lookup `{0}` does not)."""
    return bool(re.search(r"[^\W\d_]", re.sub(r"\{\d+\}", "", text)))


def test_the_pages_of_this_change_have_text_modules() -> None:
    assert {"common.js", "chat.js", "settings.js", "talk.js"} <= set(TEXT_FILES)


def english_sentences(*modules: str) -> list[str]:
    """The English parts of 2+ words of the modules' strings (a function's text around the
    values it shows) that Vietnamese says otherwise: none of them may show on a Vietnamese page."""
    found = set()
    for name in modules:
        entry = rendered_texts()[name]
        for key, english in entry["en"].items():
            if entry["vi"].get(key) == english:
                continue
            for part in re.split(r"\{\d+\}", english):
                part = part.strip(" .,:;()·")
                if len(re.findall(r"[A-Za-z]{2,}", part)) >= 2:
                    found.add(part)
    return sorted(found)


async def shown_text(page: Page) -> str:
    """What the page shows and says: its visible text, title, labels and tooltips."""
    return str(
        await page.evaluate(
            """() => [
              document.title,
              document.body.innerText,
              ...[...document.querySelectorAll("[aria-label], [title], [placeholder]")].flatMap(
                (node) => ["aria-label", "title", "placeholder"].map(
                  (name) => node.getAttribute(name) || "",
                ),
              ),
            ].join("\\n")"""
        )
    )


async def english_shown(page: Page, *modules: str) -> list[str]:
    text = await shown_text(page)
    return [sentence for sentence in english_sentences(*modules) if sentence in text]


async def assert_no_english(page: Page, *modules: str) -> None:
    left = await english_shown(page, *modules)
    assert not left, f"English on a Vietnamese page: {left}"


@asynccontextmanager
async def localized_page(
    bridge: Bridge,
    path: str,
    key: str | None,
    *,
    locale: str = "vi-VN",
    viewport: dict[str, int] | None = None,
) -> AsyncIterator[ConsolePage]:
    """console_page in a browser whose language is `locale`."""
    async with console_page(bridge, path, key, viewport=viewport, locale=locale) as console:
        yield console


async def test_a_vietnamese_browser_gets_the_login_form_in_vietnamese(bridge: Bridge) -> None:
    async with localized_page(bridge, "/settings", None, viewport=PHONE) as console:
        page = console.page
        key_field = page.get_by_label("Khóa API hoặc token quản trị")
        await key_field.wait_for()
        assert await page.get_attribute("html", "lang") == "vi"
        await expect(page.get_by_role("heading", name="Cài đặt: đăng nhập")).to_be_visible()
        await expect(page).to_have_title("Cài đặt · esp32-mcp-bridge")
        await expect(page.get_by_label("Ngôn ngữ")).to_have_value("vi")
        await assert_no_english(page, "common.js", "settings.js")
        await assert_accessible(page)
        width = await page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= PHONE["width"]
        await key_field.fill("esk_not-a-key")
        await page.get_by_role("button", name="Đăng nhập").click()
        await page.get_by_role("alert").filter(has_text="bị từ chối").wait_for()
        await key_field.fill(ADMIN_TOKEN)
        await page.get_by_role("button", name="Đăng nhập").click()
        nav = page.get_by_role("navigation", name="Bảng điều khiển")
        await expect(nav.get_by_role("link", name="Thiết bị")).to_be_visible()
        await expect(page.get_by_role("button", name="Đăng xuất")).to_be_visible()
        await expect(page.get_by_text("token quản trị", exact=True)).to_be_visible()
        console.assert_clean(allow_errors=["401"])


async def test_the_chat_page_in_vietnamese(
    bridge_factory: Any, fake_llm: FakeLlm, simulated_devices: Any
) -> None:
    bridge: Bridge = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    sim = await simulated_devices(bridge)
    key = await create_key(bridge, "chat:use", "devices:read", "devices:call")
    fake_llm.script(
        "chat",
        Reply(calls=[FakeCall("self_audio_speaker_set_volume", {"volume": 30})]),
        Reply("The volume is now 30. Brush for two minutes, twice a day."),
    )
    async with localized_page(bridge, "/", key) as console:
        page = console.page
        message = page.get_by_label("Tin nhắn", exact=True)
        await expect(message).to_be_enabled()
        assert await page.get_attribute("html", "lang") == "vi"
        await expect(page).to_have_title("Trò chuyện · esp32-mcp-bridge")
        await expect(page.get_by_role("heading", name="Hội thoại mới")).to_be_visible()
        await expect(page.get_by_text("Chưa có hội thoại nào.")).to_be_visible()
        await assert_no_english(page, "common.js", "chat.js")
        await assert_accessible(page)

        picker = page.get_by_label("Thiết bị", exact=True)
        await expect(picker.locator(f"option[value='{sim.device_id}']")).to_have_count(1)
        await picker.select_option(sim.device_id)
        await message.fill("Set the volume to 30 and tell me how long I should brush my teeth")
        await page.get_by_role("button", name="Gửi").click()
        answer = page.locator(".message.assistant[aria-busy='false']")
        await expect(answer).to_have_count(1)
        await expect(answer.locator(".tool-event .badge")).to_have_text("xong")
        await expect(answer.locator(".language")).to_have_text("Ngôn ngữ: Tiếng Anh")
        await expect(page.locator("button.conversation .hint")).to_contain_text("2 tin nhắn")
        await assert_no_english(page, "common.js", "chat.js")
        await assert_accessible(page)
        console.assert_clean()


async def test_the_settings_and_talk_pages_in_vietnamese(bridge: Bridge) -> None:
    async with localized_page(bridge, "/settings", ADMIN_TOKEN) as console:
        page = console.page
        await expect(page.get_by_role("button", name="Lưu")).to_be_visible()
        assert await page.get_attribute("html", "lang") == "vi"
        await expect(page.get_by_role("heading", level=1)).to_have_text("Cài đặt")
        await expect(page.get_by_label("Mô hình trò chuyện")).to_be_visible()
        await page.get_by_role("button", name="Lưu").click()
        await expect(page.get_by_role("status").filter(has_text="Đã lưu")).to_contain_text(
            "mặc định của máy chủ"
        )
        await assert_no_english(page, "common.js", "settings.js")
        await assert_accessible(page)
        console.assert_clean()

        await console.goto("/talk")
        await expect(page.get_by_role("button", name="Kết nối")).to_be_visible()
        assert await page.get_attribute("html", "lang") == "vi"
        await expect(page.get_by_role("heading", name="Nói chuyện với trợ lý")).to_be_visible()
        await expect(page.get_by_role("button", name="Giữ để nói")).to_be_visible()
        await expect(page.locator("#talk-status")).to_have_text("Chưa kết nối.")
        await assert_no_english(page, "common.js", "talk.js")
        await assert_accessible(page)
        console.assert_clean(allow_errors=["microphone", "NotFoundError"])


async def test_the_switch_changes_the_language_and_the_choice_sticks(bridge: Bridge) -> None:
    async with console_page(bridge, "/settings", ADMIN_TOKEN) as console:
        page = console.page
        switch = page.get_by_label("Language")
        await expect(switch).to_have_value("en")
        assert await page.get_attribute("html", "lang") == "en"
        await expect(page.get_by_role("heading", level=1)).to_have_text("Settings")
        await expect(page.get_by_label("Chat model")).to_be_visible()
        # The scan of the Vietnamese pages sees these sentences when they are there.
        shown = await english_shown(page, "common.js", "settings.js")
        assert {"Chat model", "Guardrail model", "Log out"} <= set(shown), shown
        # By keyboard: focus the switch, choose the next language.
        await switch.focus()
        await page.keyboard.press("ArrowDown")
        await expect(page.get_by_role("heading", level=1)).to_have_text("Cài đặt")
        assert await page.get_attribute("html", "lang") == "vi"
        await page.reload()
        await expect(page.get_by_role("heading", level=1)).to_have_text("Cài đặt")
        await expect(page.get_by_label("Ngôn ngữ")).to_have_value("vi")
        await console.goto("/")
        await expect(page.get_by_label("Tin nhắn", exact=True)).to_be_visible()
        await page.get_by_label("Ngôn ngữ").select_option("en")
        await expect(page.get_by_label("Message", exact=True)).to_be_visible()
        assert await page.get_attribute("html", "lang") == "en"
        console.assert_clean()


async def test_a_vietnamese_browser_may_choose_english(bridge: Bridge) -> None:
    async with localized_page(bridge, "/", None) as console:
        page = console.page
        await page.get_by_label("Ngôn ngữ").select_option("en")
        await expect(page.get_by_label("API key or admin token")).to_be_visible()
        assert await page.get_attribute("html", "lang") == "en"
        await page.reload()
        await expect(page.get_by_role("button", name="Log in")).to_be_visible()
        console.assert_clean()


async def test_an_english_browser_gets_english(bridge: Bridge) -> None:
    async with localized_page(bridge, "/", None, locale="en-US") as console:
        page = console.page
        await expect(page.get_by_label("API key or admin token")).to_be_visible()
        assert await page.get_attribute("html", "lang") == "en"
        await expect(page.get_by_role("heading", name="Chat: log in")).to_be_visible()
        console.assert_clean()
