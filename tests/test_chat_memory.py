"""Conversation memory on the bridge's database (SQLite and PostgreSQL)."""

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backend.chat import CHAT_MIGRATIONS, ConversationNotFound, SqliteMemoryStore
from backend.chat.errors import InvalidConversationId
from backend.storage import Database
from tests.chat_crash_child import QUESTIONS
from tests.storage_helpers import database_target

__all__ = ["database_target"]  # the fixture: the store tests run on SQLite and PostgreSQL

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
async def db(database_target: Path | str) -> AsyncIterator[Database]:
    database = Database(database_target, CHAT_MIGRATIONS)
    await database.open()
    yield database
    await database.close()


async def test_pairs_history_and_summary(db: Database) -> None:
    store = SqliteMemoryStore(db)
    conversation = await store.get_or_create("chat_123", device_id=None)
    assert conversation.id == "chat_123" and conversation.message_count == 0
    assert (await store.get_or_create("chat_123")).created_at == conversation.created_at
    for index in range(5):
        await store.append_pair("chat_123", f"q{index}", f"a{index}", metadata={"n": index})
    recent = await store.recent("chat_123", 6)
    assert [m.content for m in recent] == ["q2", "a2", "q3", "a3", "q4", "a4"]
    assert recent[-1].metadata == {"n": 4} and recent[-2].metadata == {}
    assert recent[0].created_at <= recent[1].created_at
    full = await store.get("chat_123", with_messages=True)
    assert full.message_count == 10 and len(full.messages) == 10
    assert full.title == "q0"
    await store.set_summary("chat_123", "one\n\ntwo")
    assert (await store.get("chat_123")).summary == "one\n\ntwo"


async def test_list_delete_and_errors(db: Database) -> None:
    store = SqliteMemoryStore(db)
    ids = [(await store.get_or_create(device_id="dev" if i % 2 else None)).id for i in range(5)]
    page = await store.list_conversations(limit=2, offset=0)
    assert page.total == 5 and len(page.items) == 2
    assert (await store.list_conversations(device_id="dev")).total == 2
    await store.append_pair(ids[0], "q", "a")
    assert await store.delete(ids[0]) is True
    assert await store.delete(ids[0]) is False
    assert await db.fetchone("SELECT 1 FROM chat_messages") is None  # cascade
    with pytest.raises(ConversationNotFound):
        await store.get(ids[0])
    with pytest.raises(ConversationNotFound):
        await store.set_summary("missing", "s")
    with pytest.raises(InvalidConversationId):
        await store.get_or_create("x" * 500)
    with pytest.raises(InvalidConversationId):
        await store.open("x" * 500)


async def test_an_opened_conversation_is_stored_only_with_its_first_messages(
    db: Database,
) -> None:
    """A turn killed between opening its conversation and storing its answer leaves nothing
    (issue #32: 4 empty conversations after 4 killed `store: true` turns)."""
    store = SqliteMemoryStore(db)
    opened = await store.open("new_chat", device_id="dev")
    device_new = await store.open(device_id="dev2")
    assert opened.id == "new_chat" and opened.message_count == 0
    assert (await store.list_conversations()).total == 0  # nothing written yet
    with pytest.raises(ConversationNotFound):
        await store.get(device_new.id)
    await store.append_pair(opened.id, "q", "a", device_id="dev")
    stored = await store.get("new_chat", with_messages=True)
    assert stored.device_id == "dev" and [m.role for m in stored.messages] == ["user", "assistant"]
    assert (await store.open(device_id="dev")).id == "new_chat"  # the device's current one
    await store.append_pair(opened.id, "q2", "a2", device_id="other")  # an existing one: kept
    assert (await store.get("new_chat")).message_count == 4


async def test_device_conversation_survives_reopening(database_target: Path | str) -> None:
    path = database_target
    first = Database(path, CHAT_MIGRATIONS)
    await first.open()
    store = SqliteMemoryStore(first)
    conversation = await store.conversation_for_device("02:00:00:00:00:01")
    await store.append_pair(conversation.id, "bật đèn", "Đã bật đèn.")
    assert (await store.conversation_for_device("02:00:00:00:00:01")).id == conversation.id
    assert (await store.conversation_for_device("02:00:00:00:00:02")).id != conversation.id
    await first.close()

    second = Database(path, CHAT_MIGRATIONS)
    await second.open()
    again = await SqliteMemoryStore(second).conversation_for_device("02:00:00:00:00:01")
    assert again.id == conversation.id and again.message_count == 2
    messages = (await SqliteMemoryStore(second).get(again.id, with_messages=True)).messages
    assert [m.content for m in messages] == ["bật đèn", "Đã bật đèn."]
    await second.close()


async def test_kill_9_inside_a_turn_leaves_whole_pairs(tmp_path: Path) -> None:
    path = tmp_path / "bridge.sqlite3"
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.chat_crash_child",
        str(path),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert child.stdout is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(60):
            while not lines or lines[-1] != "inside the pair":
                line = await child.stdout.readline()
                assert line, f"child ended early: {lines}"
                lines.append(line.decode().strip())
    finally:
        os.kill(child.pid, signal.SIGKILL)
        await child.wait()
    assert lines == ["turn 1 done", "turn 2 done", "turn 3 done", "inside the pair"]
    assert child.returncode == -signal.SIGKILL

    db = Database(path, CHAT_MIGRATIONS)
    await db.open()
    try:
        check = await db.fetchone("PRAGMA integrity_check")
        assert check is not None and check[0] == "ok"
        conversation = await SqliteMemoryStore(db).get("crash", with_messages=True)
        roles = [m.role for m in conversation.messages]
        assert roles == ["user", "assistant"] * 3 and conversation.message_count == 6
        assert [m.content for m in conversation.messages[::2]] == QUESTIONS[:3]
        assert QUESTIONS[3] not in [m.content for m in conversation.messages]
        assert len(conversation.summary.split("\n\n")) == 3  # one summary piece per stored turn
    finally:
        await db.close()
