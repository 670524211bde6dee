"""Child process for the kill -9 test: three offline turns, then a fourth that stops inside the
transaction writing its message pair (after the user row, before the assistant row) and waits
there to be killed. `python -m tests.chat_crash_child DB_PATH`."""

import asyncio
import sqlite3
import sys
import time
from pathlib import Path

from backend.chat import CHAT_MIGRATIONS, ChatService, SqliteMemoryStore, TurnRequest, collect
from backend.logs import configure_logging
from backend.storage import Database

QUESTIONS = [
    "How often should I floss?",
    "Một ngày nên đánh răng bao nhiêu lần?",
    "Is teeth whitening safe?",
    "What causes bad breath?",
]


async def main(path: Path) -> None:
    configure_logging("warning", "json")  # logs on stderr; stdout is for the parent
    db = Database(path, CHAT_MIGRATIONS)
    await db.open()
    service = ChatService(SqliteMemoryStore(db), None, None)
    for number, question in enumerate(QUESTIONS[:3], 1):
        await collect(service.run_turn(TurnRequest(text=question, conversation_id="crash")))
        print(f"turn {number} done", flush=True)

    inserts = 0

    def trace(statement: str) -> None:
        nonlocal inserts
        if statement.lstrip().startswith("INSERT INTO chat_messages"):
            inserts += 1
            if inserts == 2:  # the user row is written, the assistant row is next
                print("inside the pair", flush=True)
                time.sleep(120)

    def install(connection: sqlite3.Connection) -> None:
        connection.set_trace_callback(trace)

    await db.run(install)
    await collect(service.run_turn(TurnRequest(text=QUESTIONS[3], conversation_id="crash")))
    print("turn 4 done (should not happen)", flush=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
