"""In-memory links for McpClient tests: the client's `send` on one side, a device handler on
the other.

Payloads cross the link through `json.dumps`/`json.loads`, as they would on the wire, so a payload
the client cannot serialise fails here too, and the device never shares objects with the client.
The device is usually `testkit.stock_device.StockMcp(...).handle`.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

from backend.mcp_session import McpClient

Handler = Callable[[dict[str, Any]], Any]


class Link:
    """The client's `send` side: everything sent is recorded and queued for the device."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.fail_with: Exception | None = None

    async def send(self, payload: dict[str, Any]) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        wire_copy = json.loads(json.dumps(payload))
        self.sent.append(wire_copy)
        self.outbox.put_nowait(wire_copy)

    async def next_message(self) -> dict[str, Any]:
        return await self.outbox.get()

    async def next_request(self) -> dict[str, Any]:
        """The next sent message that has an id (skips notifications)."""
        while True:
            message = await self.outbox.get()
            if "id" in message:
                return message

    def notifications(self, method: str) -> list[dict[str, Any]]:
        return [m for m in self.sent if m.get("method") == method and "id" not in m]

    def requests(self, method: str) -> list[dict[str, Any]]:
        return [m for m in self.sent if m.get("method") == method and "id" in m]


def feed_json(client: McpClient, payload: Any) -> None:
    client.feed(json.loads(json.dumps(payload, ensure_ascii=False)))


async def serve(client: McpClient, link: Link, handler: Handler) -> None:
    """Run a device: each sent message goes to `handler`; a non-None return is fed back."""
    while True:
        message = await link.next_message()
        reply = handler(message)
        if reply is not None:
            feed_json(client, reply)


@asynccontextmanager
async def running_device(client: McpClient, link: Link, handler: Handler) -> AsyncIterator[None]:
    """A device task serving `link` for the duration of the block."""
    task = asyncio.create_task(serve(client, link, handler))
    try:
        yield
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
