"""In-memory links and a scripted stock-like device for McpClient tests.

Payloads cross the link through `json.dumps`/`json.loads`, as they would on the wire, so a payload
the client cannot serialise fails here too, and the device never shares objects with the client.
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


def result(request: dict[str, Any], value: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request["id"], "result": value}


def stock_error(request: dict[str, Any], message: str) -> dict[str, Any]:
    """The stock firmware's error shape: a message and no code."""
    return {"jsonrpc": "2.0", "id": request["id"], "error": {"message": message}}


def text_result(text: str, *, is_error: bool = False) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": is_error}


async def serve(client: McpClient, link: Link, handler: Handler) -> None:
    """Run a device: each sent message goes to `handler`; a non-None return is fed back."""
    while True:
        message = await link.next_message()
        reply = handler(message)
        if reply is not None:
            feed_json(client, reply)


def _schema(properties: dict[str, Any] | None = None, required: list[str] | None = None) -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": properties or {}}
    if required:
        schema["required"] = required
    return schema


def _percent(name: str) -> dict[str, Any]:
    return {name: {"type": "integer", "minimum": 0, "maximum": 100}}


def stock_tools() -> list[dict[str, Any]]:
    """The stock tool list as a device with speaker, backlight, theme and LED reports it."""
    user = {"audience": ["user"]}
    led = {"on": {"type": "boolean"}, "brightness": {"type": "integer", "default": 100}}
    led["brightness"].update(minimum=0, maximum=100)
    return [
        {
            "name": "self.get_device_status",
            "description": "Device status",
            "inputSchema": _schema(),
        },
        {
            "name": "self.audio_speaker.set_volume",
            "description": "Set the volume (0-100).",
            "inputSchema": _schema(_percent("volume"), ["volume"]),
        },
        {
            "name": "self.screen.set_brightness",
            "description": "Set the screen brightness.",
            "inputSchema": _schema(_percent("brightness"), ["brightness"]),
        },
        {
            "name": "self.screen.set_theme",
            "description": "Set the theme: light or dark.",
            "inputSchema": _schema({"theme": {"type": "string"}}, ["theme"]),
        },
        {
            "name": "self.led.set",
            "description": "Switch the LED.",
            "inputSchema": _schema(led, ["on"]),
        },
        {
            "name": "self.get_system_info",
            "description": "System info.",
            "inputSchema": _schema(),
            "annotations": user,
        },
        {
            "name": "self.reboot",
            "description": "Reboot.",
            "inputSchema": _schema(),
            "annotations": user,
        },
    ]


class StockDevice:
    """Stock-firmware MCP semantics, paged by tool count instead of bytes.

    The cursor is the name of the first tool of the next page and is omitted on the last page;
    errors carry no code; user-only tools need withUserTools; string ids get no reply.
    """

    def __init__(self, tools: list[dict[str, Any]] | None = None, page_size: int = 3) -> None:
        self.tools = tools if tools is not None else stock_tools()
        self.page_size = page_size
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, message: dict[str, Any]) -> dict[str, Any] | None:
        method = message.get("method", "")
        if method.startswith("notifications") or not isinstance(message.get("id"), int):
            return None
        params = message.get("params", {})
        if method == "initialize":
            info = {"name": "fake-board", "version": "2.4.0"}
            return result(
                message,
                {
                    "protocolVersion": "2024-11-05",
                    "capabilities": {"tools": {}},
                    "serverInfo": info,
                },
            )
        if method == "tools/list":
            return self._list(message, params)
        if method == "tools/call":
            self.calls.append((params["name"], params.get("arguments", {})))
            if params["name"] not in {tool["name"] for tool in self.tools}:
                return stock_error(message, f"Unknown tool: {params['name']}")
            return result(message, text_result("true"))
        return stock_error(message, f"Method not implemented: {method}")

    def _list(self, message: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        with_user_tools = params.get("withUserTools") is True
        visible = [t for t in self.tools if with_user_tools or not _user_only(t)]
        names = [tool.get("name") if isinstance(tool, dict) else None for tool in visible]
        cursor = params.get("cursor") or ""
        start = names.index(cursor) if cursor else 0
        page = visible[start : start + self.page_size]
        reply: dict[str, Any] = {"tools": page}
        if start + self.page_size < len(visible):
            reply["nextCursor"] = names[start + self.page_size]
        return result(message, reply)


def _user_only(tool: Any) -> bool:
    return isinstance(tool, dict) and "annotations" in tool


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
