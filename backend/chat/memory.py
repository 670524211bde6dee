"""Conversation memory: every message kept, a rolling summary, one current conversation per
device.

`MemoryStore` is the interface; `SqliteMemoryStore` keeps it in the bridge's database
(`backend.storage.Database`: the SQLite file, or PostgreSQL, with the same SQL) with
`CHAT_MIGRATIONS`. A turn
writes its user and assistant messages in one transaction (`append_pair`), so a crash mid-turn
leaves either both or neither; the summary is updated afterwards in its own transaction.
"""

import json
import re
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

from backend.chat.errors import MAX_ID_LENGTH, ConversationNotFound, InvalidConversationId
from backend.storage import Connection, Database, Migration, Row

MessageRole = Literal["user", "assistant"]

CHAT_MIGRATIONS = [
    Migration(
        "chat",
        1,
        """
        CREATE TABLE chat_conversations (
            id TEXT PRIMARY KEY,
            device_id TEXT,
            title TEXT NOT NULL DEFAULT '',
            summary TEXT NOT NULL DEFAULT '',
            message_count INTEGER NOT NULL DEFAULT 0,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL
        );
        CREATE INDEX chat_conversations_by_device ON chat_conversations (device_id, updated_at);
        CREATE INDEX chat_conversations_by_update ON chat_conversations (updated_at);
        CREATE TABLE chat_messages (
            id {serial_pk},
            conversation_id TEXT NOT NULL
                REFERENCES chat_conversations (id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
            content TEXT NOT NULL,
            created_at TEXT NOT NULL,
            metadata TEXT NOT NULL DEFAULT '{}'
        );
        CREATE INDEX chat_messages_by_conversation ON chat_messages (conversation_id, id);
        """,
    )
]

TITLE_LENGTH = 80  # a title made from the first message
MAX_TITLE_LENGTH = 200  # a title given by `rename`
MAX_SEARCH_LENGTH = 200  # a `list_conversations` search text


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """One stored message, with when it was written and its metadata."""

    role: MessageRole
    content: str
    created_at: datetime
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Conversation:
    """A stored conversation: its device, title and rolling summary (messages only when asked)."""

    id: str
    device_id: str | None
    title: str
    summary: str
    created_at: datetime
    updated_at: datetime
    message_count: int = 0
    messages: tuple[StoredMessage, ...] = ()  # filled by `get(..., with_messages=True)`


@dataclass(frozen=True, slots=True)
class ConversationPage:
    """One page of conversations and the total."""

    items: list[Conversation]
    total: int


class MemoryStore(Protocol):
    """Where conversations are kept (see the module docstring)."""

    async def get_or_create(
        self, conversation_id: str | None = None, *, device_id: str | None = None
    ) -> Conversation:
        """The conversation with that id (created if new), or a new one when id is None."""
        ...

    async def conversation_for_device(self, device_id: str) -> Conversation:
        """The device's current conversation (its most recently used), created if none."""
        ...

    async def open(
        self, conversation_id: str | None = None, *, device_id: str | None = None
    ) -> Conversation:
        """The conversation with that id, or the device's current one (no id, a device); when
        there is none, a new one that is not stored yet: its first `append_pair` stores it with
        its first messages, so a turn killed before then leaves no empty conversation."""
        ...

    async def device_conversation_id(self, device_id: str) -> str:
        """The id of the device's current conversation, or a new id that the device's first
        stored turn creates (a refused turn leaves nothing behind)."""
        ...

    async def get(self, conversation_id: str, *, with_messages: bool = False) -> Conversation:
        """Raises ConversationNotFound."""
        ...

    async def recent(self, conversation_id: str, n: int) -> list[StoredMessage]:
        """The last `n` messages, oldest first."""
        ...

    async def append_pair(
        self,
        conversation_id: str,
        user: str,
        assistant: str,
        *,
        metadata: dict[str, Any] | None = None,
        device_id: str | None = None,
    ) -> None:
        """Both messages of a turn, atomically; the assistant message carries `metadata`. A
        conversation not stored yet (`open`) is stored with them, as `device_id`'s."""
        ...

    async def set_summary(self, conversation_id: str, summary: str) -> None:
        """Replace the conversation's summary; raises ConversationNotFound."""

    async def list_conversations(
        self,
        *,
        limit: int = 50,
        offset: int = 0,
        device_id: str | None = None,
        query: str | None = None,
    ) -> ConversationPage:
        """One page of conversations, newest first (only the device's with `device_id`; with
        `query`, only those whose title or a message contains it, ignoring case)."""

    async def rename(self, conversation_id: str, title: str) -> Conversation:
        """Give the conversation a title (its `updated_at` is kept); raises
        ConversationNotFound."""

    async def delete(self, conversation_id: str) -> bool:
        """Delete a conversation and its messages; False when there was none."""


def now() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


def _iso(moment: datetime) -> str:
    return moment.isoformat(timespec="microseconds")


_CONVERSATION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")


def check_conversation_id(conversation_id: str) -> str:
    """Ids travel in HTTP headers (X-Conversation-Id) and URLs: ASCII letters, digits, `._:@-`."""
    text = conversation_id.strip()
    if len(text) > MAX_ID_LENGTH or not _CONVERSATION_ID.fullmatch(text):
        raise InvalidConversationId(
            f"a conversation id is 1 to {MAX_ID_LENGTH} ASCII letters, digits or ._:@- "
            "(starting with a letter or digit)"
        )
    return text


def _current_of_device(c: Connection, device_id: str) -> str | None:
    row = c.execute(
        "SELECT id FROM chat_conversations WHERE device_id = ?"
        " ORDER BY updated_at DESC, id DESC LIMIT 1",
        (device_id,),
    ).fetchone()
    return str(row["id"]) if row else None


class SqliteMemoryStore:
    """`MemoryStore` on the bridge database; open the database with CHAT_MIGRATIONS."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def get_or_create(
        self, conversation_id: str | None = None, *, device_id: str | None = None
    ) -> Conversation:
        """See `MemoryStore.get_or_create`; raises InvalidConversationId."""
        wanted = check_conversation_id(conversation_id) if conversation_id else None
        return await self.db.run(lambda c: self._get_or_create(c, wanted, device_id))

    def _get_or_create(
        self, c: Connection, conversation_id: str | None, device_id: str | None
    ) -> Conversation:
        if conversation_id is not None:
            found = _fetch(c, conversation_id)
            if found is not None:
                return found
        moment = _iso(now())
        new_id = conversation_id or uuid.uuid4().hex
        c.execute(
            "INSERT INTO chat_conversations (id, device_id, created_at, updated_at)"
            " VALUES (?, ?, ?, ?)",
            (new_id, device_id, moment, moment),
        )
        created = _fetch(c, new_id)
        assert created is not None
        return created

    async def conversation_for_device(self, device_id: str) -> Conversation:
        """See `MemoryStore.conversation_for_device`."""

        def work(c: Connection) -> Conversation:
            return self._get_or_create(c, _current_of_device(c, device_id), device_id)

        return await self.db.run(work)

    async def open(
        self, conversation_id: str | None = None, *, device_id: str | None = None
    ) -> Conversation:
        """See `MemoryStore.open`; raises InvalidConversationId."""
        wanted = check_conversation_id(conversation_id) if conversation_id else None

        def work(c: Connection) -> Conversation:
            found_id = wanted
            if found_id is None and device_id is not None:
                found_id = _current_of_device(c, device_id)
            found = _fetch(c, found_id) if found_id is not None else None
            if found is not None:
                return found
            moment = now()
            new_id = found_id or uuid.uuid4().hex
            return Conversation(new_id, device_id, "", "", moment, moment)

        return await self.db.run(work)

    async def device_conversation_id(self, device_id: str) -> str:
        """See `MemoryStore.device_conversation_id`."""

        def work(c: Connection) -> str:
            return _current_of_device(c, device_id) or uuid.uuid4().hex

        return await self.db.run(work)

    async def get(self, conversation_id: str, *, with_messages: bool = False) -> Conversation:
        """See `MemoryStore.get`; raises ConversationNotFound."""

        def work(c: Connection) -> Conversation:
            found = _fetch(c, conversation_id)
            if found is None:
                raise ConversationNotFound(conversation_id)
            if not with_messages:
                return found
            rows = c.execute(
                "SELECT role, content, created_at, metadata FROM chat_messages"
                " WHERE conversation_id = ? ORDER BY id",
                (conversation_id,),
            ).fetchall()
            return _with_messages(found, tuple(_message(row) for row in rows))

        return await self.db.run(work)

    async def recent(self, conversation_id: str, n: int) -> list[StoredMessage]:
        """See `MemoryStore.recent`."""
        if n <= 0:
            return []
        rows = await self.db.fetchall(
            "SELECT role, content, created_at, metadata FROM chat_messages"
            " WHERE conversation_id = ? ORDER BY id DESC LIMIT ?",
            (conversation_id, n),
        )
        return [_message(row) for row in reversed(rows)]

    async def append_pair(
        self,
        conversation_id: str,
        user: str,
        assistant: str,
        *,
        metadata: dict[str, Any] | None = None,
        device_id: str | None = None,
    ) -> None:
        """See `MemoryStore.append_pair`: both messages, and the conversation when it is not
        stored yet, in one transaction."""
        meta = json.dumps(metadata or {}, ensure_ascii=False, default=str)

        def work(c: Connection) -> None:
            first = now()
            second = max(now(), first)
            c.execute(
                "INSERT INTO chat_conversations (id, device_id, created_at, updated_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                (conversation_id, device_id, _iso(first), _iso(first)),
            )
            changed = c.execute(
                "UPDATE chat_conversations SET updated_at = ?, message_count = message_count + 2,"
                " title = CASE WHEN title = '' THEN ? ELSE title END WHERE id = ?",
                (_iso(second), _title(user), conversation_id),
            ).rowcount
            if changed == 0:
                raise ConversationNotFound(conversation_id)
            c.executemany(
                "INSERT INTO chat_messages (conversation_id, role, content, created_at, metadata)"
                " VALUES (?, ?, ?, ?, ?)",
                [
                    (conversation_id, "user", user, _iso(first), "{}"),
                    (conversation_id, "assistant", assistant, _iso(second), meta),
                ],
            )

        await self.db.run(work)

    async def set_summary(self, conversation_id: str, summary: str) -> None:
        """See `MemoryStore.set_summary`."""
        changed = await self.db.execute(
            "UPDATE chat_conversations SET summary = ? WHERE id = ?", (summary, conversation_id)
        )
        if changed == 0:
            raise ConversationNotFound(conversation_id)

    async def list_conversations(
        self,
        *,
        limit: int = 50,
        offset: int = 0,
        device_id: str | None = None,
        query: str | None = None,
    ) -> ConversationPage:
        """See `MemoryStore.list_conversations` (`limit` is kept within 1..500, `query` cut to
        MAX_SEARCH_LENGTH characters; case is ignored for ASCII letters on SQLite, for all on
        PostgreSQL). A search reads every title and, through the messages' index by
        conversation, each conversation's messages: a scan, fine for the thousands of
        conversations a bridge keeps, not for millions."""
        limit = max(1, min(limit, 500))
        offset = max(0, offset)
        conditions: list[str] = []
        args: list[Any] = []
        if device_id:
            conditions.append("device_id = ?")
            args.append(device_id)
        text = " ".join((query or "").split())[:MAX_SEARCH_LENGTH]
        if text:
            pattern = "%" + _like_escaped(text.lower()) + "%"
            conditions.append(
                "(LOWER(title) LIKE ? ESCAPE '!' OR EXISTS (SELECT 1 FROM chat_messages m"
                " WHERE m.conversation_id = chat_conversations.id"
                " AND LOWER(m.content) LIKE ? ESCAPE '!'))"
            )
            args += [pattern, pattern]
        where = ("WHERE " + " AND ".join(conditions)) if conditions else ""

        def work(c: Connection) -> ConversationPage:
            total = c.execute(f"SELECT COUNT(*) FROM chat_conversations {where}", args).fetchone()
            rows = c.execute(
                f"SELECT {_COLUMNS} FROM chat_conversations {where}"
                " ORDER BY updated_at DESC, id DESC LIMIT ? OFFSET ?",
                [*args, limit, offset],
            ).fetchall()
            return ConversationPage([_conversation(row) for row in rows], int(total[0]))

        return await self.db.run(work)

    async def rename(self, conversation_id: str, title: str) -> Conversation:
        """See `MemoryStore.rename`; the title is kept on one line, at most MAX_TITLE_LENGTH
        characters."""
        text = " ".join(title.split())[:MAX_TITLE_LENGTH]

        def work(c: Connection) -> Conversation:
            changed = c.execute(
                "UPDATE chat_conversations SET title = ? WHERE id = ?", (text, conversation_id)
            ).rowcount
            found = _fetch(c, conversation_id) if changed else None
            if found is None:
                raise ConversationNotFound(conversation_id)
            return found

        return await self.db.run(work)

    async def delete(self, conversation_id: str) -> bool:
        """See `MemoryStore.delete`."""
        return (
            await self.db.execute("DELETE FROM chat_conversations WHERE id = ?", (conversation_id,))
            > 0
        )


_COLUMNS = "id, device_id, title, summary, created_at, updated_at, message_count"


def _fetch(c: Connection, conversation_id: str) -> Conversation | None:
    row = c.execute(
        f"SELECT {_COLUMNS} FROM chat_conversations WHERE id = ?", (conversation_id,)
    ).fetchone()
    return _conversation(row) if row is not None else None


def _conversation(row: Row) -> Conversation:
    return Conversation(
        id=row["id"],
        device_id=row["device_id"],
        title=row["title"],
        summary=row["summary"],
        created_at=datetime.fromisoformat(row["created_at"]),
        updated_at=datetime.fromisoformat(row["updated_at"]),
        message_count=int(row["message_count"]),
    )


def _with_messages(found: Conversation, messages: tuple[StoredMessage, ...]) -> Conversation:
    return Conversation(
        found.id,
        found.device_id,
        found.title,
        found.summary,
        found.created_at,
        found.updated_at,
        found.message_count,
        messages,
    )


def _message(row: Row) -> StoredMessage:
    try:
        metadata = json.loads(row["metadata"])
    except ValueError:
        metadata = {}
    role: MessageRole = "assistant" if row["role"] == "assistant" else "user"
    return StoredMessage(
        role, row["content"], datetime.fromisoformat(row["created_at"]), metadata or {}
    )


def _like_escaped(text: str) -> str:
    """`text` matched literally by LIKE ... ESCAPE '!' (its `%` and `_` are not wildcards)."""
    return text.replace("!", "!!").replace("%", "!%").replace("_", "!_")


def _title(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= TITLE_LENGTH else text[: TITLE_LENGTH - 1] + "…"
