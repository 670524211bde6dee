"""Reading the live fleet stream `GET /api/fleet/events` (tests of the console API and of the
cluster's fleet view)."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from backend.server import Bridge
from tests.helpers import eventually

EVENTS = "/api/fleet/events"


@dataclass
class Stream:
    """The events of one open stream, read in the background as they arrive."""

    events: list[tuple[str, Any]] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    status: int = 0

    def rows(self) -> dict[str, dict[str, Any]]:
        """The latest row of each device, as a page would hold them."""
        rows: dict[str, dict[str, Any]] = {}
        for name, data in self.events:
            if name in ("snapshot", "devices"):
                rows.update({row["device_id"]: row for row in data["devices"]})
            elif name == "removed":
                for device_id in data["device_ids"]:
                    rows.pop(device_id, None)
        return rows

    def named(self, name: str) -> list[Any]:
        return [data for event, data in self.events if event == name]


async def _read(response: httpx.Response, stream: Stream) -> None:
    event, data = "message", ""
    try:
        async for line in response.aiter_lines():
            if line.startswith(":"):
                stream.comments.append(line)
            elif line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
            elif line == "" and data:
                stream.events.append((event, json.loads(data)))
                event, data = "message", ""
    finally:
        stream.ended.set()


@contextlib.asynccontextmanager
async def open_stream(bridge: Bridge, token: str, query: str = "") -> AsyncIterator[Stream]:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30) as client,
        client.stream("GET", EVENTS + query) as response,
    ):
        stream = Stream(status=response.status_code)
        reader = asyncio.create_task(_read(response, stream))
        try:
            yield stream
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await reader


async def stream_ready(stream: Stream) -> None:
    await eventually(lambda: bool(stream.named("ready")))


def stream_state(stream: Stream, device_id: str) -> str | None:
    row = stream.rows().get(device_id)
    return None if row is None else row["state"]
