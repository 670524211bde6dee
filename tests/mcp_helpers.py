"""`/mcp` through the official MCP SDK client (`streamable_http_client` + `ClientSession`)."""

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from backend.server import Bridge

VOLUME = "device.02-00-00-00-00-01.self.audio_speaker.set_volume"


@asynccontextmanager
async def mcp_session(
    bridge: Bridge, token: str, on_message: Callable[[Any], Any] | None = None
) -> AsyncIterator[ClientSession]:
    async def handler(message: Any) -> None:
        if on_message is not None:
            on_message(message)

    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30) as http,
        streamable_http_client(f"{bridge.api_url}/mcp", http_client=http) as (read, write),
        ClientSession(read, write, message_handler=handler) as session,
    ):
        await session.initialize()
        yield session
