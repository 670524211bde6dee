"""The conversations page in Chromium (tests/console_helpers.py): listing and paging, a search that
narrows the list, renaming, deleting with a confirm step, exports as JSON and as Markdown (the
downloaded files read back), text from users and the model shown as text, by keyboard, at desktop
and phone sizes, with axe, in Vietnamese, and a key without chat:use kept out. Then the API the
page added (`q` on `GET /v1/conversations`, `PATCH /v1/conversations/{id}`), with bad input."""

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Download, Page, expect

from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN
from tests.console_helpers import (
    PHONE,
    SIZES,
    admin,
    assert_accessible,
    console_page,
    http,
    tab_to,
)
from tests.helpers import create_key

# The admin API client fixture (tests/console_helpers.py).
__all__ = ["admin"]

pytestmark = pytest.mark.timeout(180)

HOSTILE_TITLE = "<img src=x onerror=alert(1)> *bold* [link](javascript:alert(2))"
HOSTILE_ANSWER = "# Heading\n    code?\n1. item\n- bullet\n<script>alert(3)</script> &amp; `tick`"


async def stored(bridge: Bridge, conversation_id: str, user: str, assistant: str) -> None:
    """A conversation with one turn, its title made from `user` (as a real turn makes it)."""
    await bridge.frontends.memory.append_pair(conversation_id, user, assistant)


async def three(bridge: Bridge) -> None:
    await stored(bridge, "kitchen", "Turn on the kitchen light", "The kitchen light is on.")
    await stored(bridge, "garden", "Water the garden at six", "I will water it at 6:00.")
    await stored(bridge, "hostile", HOSTILE_TITLE, HOSTILE_ANSWER)


def item(page: Page, conversation_id: str) -> Any:
    return page.locator(f'li.conversation[data-id="{conversation_id}"]')


async def downloaded(page: Page, button: Any) -> tuple[str, str]:
    """Click `button`, wait for the download it starts: (file name, its text)."""
    async with page.expect_download() as started:
        await button.click()
    download: Download = await started.value
    path = await download.path()
    text = await asyncio.to_thread(Path(path).read_text, encoding="utf-8")
    return download.suggested_filename, text


# ---- the page -----------------------------------------------------------------------------------


@pytest.mark.parametrize("viewport", SIZES)
async def test_search_rename_export_and_delete(
    bridge: Bridge, admin: httpx.AsyncClient, viewport: dict[str, int]
) -> None:
    await three(bridge)
    key = await create_key(bridge, "chat:use")
    async with console_page(bridge, "/conversations", key, viewport=viewport) as console:
        page = console.page
        status = page.locator("#conversations-status")
        await expect(status).to_have_text("1–3 of 3 conversations")
        await expect(page.get_by_role("link", name="Conversations")).to_have_attribute(
            "aria-current", "page"
        )
        # Text from users and the model is text: the hostile title shows as typed, runs nothing.
        await expect(item(page, "hostile").locator("h2")).to_have_text(HOSTILE_TITLE)
        assert await page.locator("#conversation-list img, #conversation-list a").count() == 0
        await expect(item(page, "garden")).to_contain_text("2 messages")
        await assert_accessible(page)
        if viewport is PHONE:
            width = await page.evaluate("() => document.documentElement.scrollWidth")
            assert width <= PHONE["width"]

        # Search narrows: by title, then by a message's text (the answer), case ignored.
        search = page.get_by_label("Search titles and messages")
        await search.fill("GARDEN")
        await expect(page.locator("li.conversation")).to_have_count(1)
        await expect(status).to_have_text("1–1 of 1 conversations matching “GARDEN”")
        await search.fill("light is on")
        await expect(item(page, "kitchen")).to_have_count(1)
        await expect(page.locator("li.conversation")).to_have_count(1)
        await search.fill("nothing like this")
        await expect(status).to_have_text("No conversation matches “nothing like this”.")
        await page.get_by_role("button", name="Clear the search").click()
        await expect(page.locator("li.conversation")).to_have_count(3)

        # Rename: the new title shows, the server has it, the focus is back on Rename.
        garden = item(page, "garden")
        await garden.get_by_role("button", name="Rename “Water the garden at six”").click()
        field = garden.get_by_label("New title")
        await expect(field).to_be_focused()
        await field.fill("  Garden   watering ")
        await field.press("Enter")
        await expect(garden.locator("h2")).to_have_text("Garden watering")
        await expect(garden.get_by_role("button", name="Rename “Garden watering”")).to_be_focused()
        assert (await admin.get("/v1/conversations/garden")).json()["title"] == "Garden watering"

        # Export JSON: the conversation as the API gives it.
        name, text = await downloaded(
            page, garden.get_by_role("button", name="Export JSON of “Garden watering”")
        )
        assert name == "conversation-garden.json"
        assert json.loads(text) == (await admin.get("/v1/conversations/garden")).json()
        await expect(garden.get_by_role("status")).to_have_text(
            "Downloaded conversation-garden.json."
        )
        # Export Markdown: the hostile text escaped, so it renders as typed.
        name, text = await downloaded(
            page, item(page, "hostile").get_by_role("button", name="Export Markdown")
        )
        assert name == "conversation-hostile.md"
        lines = text.splitlines()
        assert lines[0] == (
            r"# \<img src=x onerror=alert\(1\)\> \*bold\* \[link\]\(javascript:alert\(2\)\)"
        )
        assert "## User · " in text and "## Assistant · " in text
        # Each line escaped, its line break a hard break (a backslash at its end).
        assert "\\# Heading\\" in lines
        assert "\u00a0" * 4 + "code?\\" in lines  # no indented code block
        assert "1\\. item\\" in lines and "\\- bullet\\" in lines
        assert r"\<script\>alert\(3\)\</script\> \&amp; \`tick\`" in lines
        assert re.search(r"(?<!\\)[<>]", text) is None  # every angle bracket escaped

        # Delete: a confirm step first (Cancel backs out), then it is gone here and on the server.
        kitchen = item(page, "kitchen")
        await kitchen.get_by_role("button", name="Delete “Turn on the kitchen light”").click()
        yes = kitchen.get_by_role("button", name="Yes, delete “Turn on the kitchen light”")
        await expect(yes).to_be_focused()
        await expect(kitchen).to_contain_text("and its 2 messages? This cannot be undone.")
        await assert_accessible(page)
        await kitchen.get_by_role("button", name="Cancel").click()
        delete = kitchen.get_by_role("button", name="Delete “Turn on the kitchen light”")
        await expect(delete).to_be_focused()
        await delete.click()
        await yes.click()
        await expect(kitchen).to_have_count(0)
        await expect(status).to_have_text("1–2 of 2 conversations")
        await expect(page.locator("#conversations-title")).to_be_focused()
        assert (await admin.get("/v1/conversations/kitchen")).status_code == 404
        console.assert_clean()


async def test_the_page_by_keyboard_only_with_paging(bridge: Bridge) -> None:
    for number in range(25):
        await stored(bridge, f"c{number:02d}", f"Question number {number}", "An answer.")
    async with console_page(bridge, "/conversations", ADMIN_TOKEN) as console:
        page = console.page
        status = page.locator("#conversations-status")
        await expect(status).to_have_text("1–20 of 25 conversations")
        await expect(page.locator(".pager")).to_contain_text("Page 1 of 2")
        await tab_to(page, 'button[data-go="next"]')
        await page.keyboard.press("Enter")
        await expect(status).to_have_text("21–25 of 25 conversations")
        await expect(page.locator(".pager")).to_contain_text("Page 2 of 2")
        await expect(page.locator('button[data-go="next"]')).to_be_disabled()

        await tab_to(page, "#conversation-search")
        await page.keyboard.type("number 7")
        await page.keyboard.press("Enter")
        await expect(status).to_have_text("1–1 of 1 conversations matching “number 7”")
        await expect(page.locator(".pager")).to_be_empty()
        target = item(page, "c07")
        # Rename by keyboard; Escape backs out of it first.
        await tab_to(page, 'li[data-id="c07"] button[data-action="rename"]')
        await page.keyboard.press("Enter")
        await page.keyboard.press("Escape")
        rename = target.locator('button[data-action="rename"]')
        await expect(rename).to_be_focused()
        await page.keyboard.press("Enter")
        await page.keyboard.press("Control+a")
        await page.keyboard.type("Seventh")
        await page.keyboard.press("Enter")
        await expect(target.locator("h2")).to_have_text("Seventh")
        # Delete by keyboard: Escape backs out, Enter twice deletes.
        await tab_to(page, 'li[data-id="c07"] button[data-action="delete"]')
        await page.keyboard.press("Enter")
        await expect(target.get_by_role("button", name="Yes, delete “Seventh”")).to_be_focused()
        await page.keyboard.press("Escape")
        await expect(target.locator('button[data-action="delete"]')).to_be_focused()
        await page.keyboard.press("Enter")
        await page.keyboard.press("Enter")
        await expect(target).to_have_count(0)
        await expect(status).to_have_text("No conversation matches “number 7”.")
        await assert_accessible(page)
        console.assert_clean()
    assert (await bridge.frontends.memory.list_conversations()).total == 24


async def test_a_key_without_chat_use_is_kept_out(bridge: Bridge) -> None:
    await three(bridge)
    key = await create_key(bridge, "devices:read")
    async with console_page(bridge, "/conversations", key, viewport=PHONE) as console:
        page = console.page
        await expect(
            page.get_by_role("status").filter(has_text="lacks the chat:use")
        ).to_be_visible()
        await expect(page.get_by_role("navigation", name="Console")).not_to_contain_text(
            "Conversations"
        )
        assert await page.locator("li.conversation").count() == 0
        await assert_accessible(page)
        console.assert_clean()
    async with http(bridge, key) as client:
        for response in (
            await client.get("/v1/conversations?q=garden"),
            await client.get("/v1/conversations/garden"),
            await client.patch("/v1/conversations/garden", json={"title": "mine"}),
            await client.delete("/v1/conversations/garden"),
        ):
            assert response.status_code == 403, response.text
    assert (await bridge.frontends.memory.get("garden")).title == "Water the garden at six"


async def test_the_page_in_vietnamese(bridge: Bridge) -> None:
    await three(bridge)
    async with console_page(
        bridge, "/conversations", ADMIN_TOKEN, locale="vi-VN", viewport=PHONE
    ) as console:
        page = console.page
        status = page.locator("#conversations-status")
        await expect(status).to_have_text("1–3 trên 3 hội thoại")
        assert await page.get_attribute("html", "lang") == "vi"
        await expect(page).to_have_title("Hội thoại · esp32-mcp-bridge")
        await expect(page.get_by_role("heading", level=1)).to_have_text("Hội thoại")
        await expect(item(page, "garden")).to_contain_text("2 tin nhắn")
        await page.get_by_label("Tìm trong tiêu đề và tin nhắn").fill("garden")
        await expect(status).to_have_text("1–1 trên 1 hội thoại khớp với “garden”")
        garden = item(page, "garden")
        await garden.get_by_role("button", name="Đổi tên “Water the garden at six”").click()
        await garden.get_by_label("Tiêu đề mới").fill("Tưới vườn lúc sáu giờ")
        await garden.get_by_role("button", name="Lưu").click()
        await expect(garden.locator("h2")).to_have_text("Tưới vườn lúc sáu giờ")
        name, text = await downloaded(page, garden.get_by_role("button", name="Xuất Markdown"))
        assert name == "conversation-garden.md"
        assert text.startswith("# Tưới vườn lúc sáu giờ\n")
        assert "## Người dùng · " in text and "## Trợ lý · " in text
        await garden.get_by_role("button", name="Xóa “Tưới vườn lúc sáu giờ”").click()
        await expect(garden).to_contain_text("Không thể hoàn tác")
        await assert_accessible(page)
        shown = await page.locator("main").inner_text()
        for english in ("Search", "Rename", "Export", "Delete", "messages", "conversations"):
            assert english not in shown, english
        await garden.get_by_role("button", name="Có, xóa “Tưới vườn lúc sáu giờ”").click()
        await expect(garden).to_have_count(0)
        await expect(status).to_have_text("Không có hội thoại nào khớp với “garden”.")
        console.assert_clean()


# ---- the API it uses ----------------------------------------------------------------------------


async def test_search_matches_text_literally_and_pages(
    bridge: Bridge, admin: httpx.AsyncClient
) -> None:
    await three(bridge)
    await stored(bridge, "percent", "100% sure_thing", "Yes.")

    async def ids(**params: Any) -> list[str]:
        answer = await admin.get("/v1/conversations", params=params)
        assert answer.status_code == 200, answer.text
        return [row["id"] for row in answer.json()["data"]]

    assert await ids(q="KITCHEN") == ["kitchen"]
    assert await ids(q="water it at 6") == ["garden"]  # an answer's text
    assert await ids(q="%") == ["percent"]  # a wildcard is a character
    assert await ids(q="e_t") == ["percent"]
    assert await ids(q="!") == []
    assert await ids(q="  ") == await ids()  # only spaces: no filter
    assert len(await ids()) == 4
    page = (await admin.get("/v1/conversations", params={"q": "the", "limit": 1})).json()
    assert page["total"] == 2 and len(page["data"]) == 1 and page["next_offset"] == 1


async def test_rename_and_search_refuse_bad_input(bridge: Bridge, admin: httpx.AsyncClient) -> None:
    await three(bridge)
    path = "/v1/conversations/garden"
    for body, why in (
        ({"title": 5}, "title"),
        ({"title": None}, "title"),
        ({}, "title"),
        ({"title": ""}, "title"),
        ({"title": "   "}, "title"),
        ({"title": "x" * 201}, "title"),
        ({"title": "bell\x07"}, "title"),
        ({"title": "two\nlines"}, "title"),
        ({"title": "ok", "device_id": "x"}, "device_id"),
    ):
        answer = await admin.patch(path, json=body)
        assert answer.status_code == 400, (body, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "invalid_request" and why in error["message"], (body, error)
    not_json = await admin.patch(path, content=b"{", headers={"Content-Type": "application/json"})
    assert not_json.status_code == 400
    surrogate = await admin.patch(
        path, content=b'{"title": "\\udc00"}', headers={"Content-Type": "application/json"}
    )
    assert surrogate.status_code == 400 and surrogate.json()["error"]["code"] == "invalid_text"
    unknown = await admin.patch("/v1/conversations/nope", json={"title": "x"})
    assert unknown.status_code == 404, unknown.text
    assert "nope" in unknown.json()["error"]["message"]
    bad_id = await admin.patch("/v1/conversations/bad%20id", json={"title": "x"})
    assert bad_id.status_code == 400
    too_long = await admin.get("/v1/conversations", params={"q": "x" * 201})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "q"
    # Nothing changed; a good rename keeps the order (updated_at) and trims the title.
    assert (await admin.get(path)).json()["title"] == "Water the garden at six"
    before = (await admin.get(path)).json()["updated_at"]
    renamed = await admin.patch(path, json={"title": " Tưới   vườn 🌱 "})
    assert renamed.status_code == 200
    assert renamed.json()["title"] == "Tưới vườn 🌱" and renamed.json()["updated_at"] == before
    assert (await admin.get("/v1/conversations", params={"q": "vườn"})).json()["total"] == 1
    async with http(bridge, None) as anonymous:
        assert (await anonymous.patch(path, json={"title": "x"})).status_code == 401
