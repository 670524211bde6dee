"""A scriptable device that speaks the stock firmware's wire format over a real WebSocket.

It behaves like xiaozhi-esp32 2.4 (headers, hello, compact MCP replies, errors without `code`,
tools/list pages with name cursors) unless a test tells it to misbehave. Every MCP message it
receives is recorded, so tests can assert what the bridge sent.
"""

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

STOCK_HELLO = {
    "type": "hello",
    "version": 1,
    "features": {"mcp": True, "glyph_push": True},
    "text_font": {"bundle": "noto-v1", "charset": "common", "size": 20, "bpp": 4},
    "transport": "websocket",
    "audio_params": {"format": "opus", "sample_rate": 16000, "channels": 1, "frame_duration": 60},
}

VOLUME_TOOL = {
    "name": "self.audio_speaker.set_volume",
    "description": "Set the volume of the audio speaker.",
    "inputSchema": {
        "type": "object",
        "properties": {"volume": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["volume"],
    },
}
STATUS_TOOL = {
    "name": "self.get_device_status",
    "description": "Get the device status.",
    "inputSchema": {"type": "object", "properties": {}},
}

Handler = Callable[["WireDevice", dict[str, Any]], Awaitable[Any]]


class WireDevice:
    def __init__(
        self,
        url: str,
        token: str | None,
        device_id: str = "a4:cf:12:34:56:78",
        *,
        tools: list[dict[str, Any]] | None = None,
        page_size: int = 100,
        hello: dict[str, Any] | None = None,
        compact: bool = True,
    ) -> None:
        self.url = url
        self.token = token
        self.device_id = device_id
        self.tools = tools if tools is not None else [STATUS_TOOL, VOLUME_TOOL]
        self.page_size = page_size
        self.hello = STOCK_HELLO if hello is None else hello
        self.compact = compact
        self.session_id = ""
        self.server_hello: dict[str, Any] | None = None
        self.received: list[dict[str, Any]] = []  # every MCP payload from the bridge
        self.handlers: dict[str, Handler] = {}  # method -> custom behaviour
        self.volume = 50
        self.ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self.message_arrived = asyncio.Event()
        self._answering: set[asyncio.Task[None]] = set()

    def headers(self) -> dict[str, str]:
        headers = {
            "Protocol-Version": "1",
            "Device-Id": self.device_id,
            "Client-Id": "6c4a5a2e-2f0e-4a4e-9d59-3b2d1c0e9f11",
        }
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def connect(self, send_hello: bool = True) -> dict[str, Any] | None:
        self.ws = await connect(self.url, additional_headers=self.headers(), compression=None)
        if not send_hello:
            self._reader = asyncio.create_task(self._read())
            return None
        await self.send(self.hello)
        self.server_hello = json.loads(await asyncio.wait_for(self.ws.recv(), 5))
        self.session_id = self.server_hello.get("session_id", "")
        self._reader = asyncio.create_task(self._read())
        return self.server_hello

    async def send(self, message: Any) -> None:
        assert self.ws is not None
        separators = (",", ":") if self.compact else None
        text = (
            message
            if isinstance(message, str | bytes)
            else json.dumps(message, separators=separators)
        )
        await self.ws.send(text)

    async def reply(self, payload: dict[str, Any]) -> None:
        await self.send({"session_id": self.session_id, "type": "mcp", "payload": payload})

    async def wait_for_method(self, method: str, timeout_s: float = 5.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout_s):
            while True:
                for payload in self.received:
                    if payload.get("method") == method:
                        return payload
                self.message_arrived.clear()
                await self.message_arrived.wait()

    def methods(self) -> list[str]:
        return [p.get("method", "<reply>") for p in self.received]

    async def kill(self) -> None:
        """Drop TCP without a close frame, as the stock firmware does."""
        assert self.ws is not None
        self.ws.transport.abort()
        await self.stop_reader()

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        await self.stop_reader()

    async def stop_reader(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    async def _read(self) -> None:
        assert self.ws is not None
        async for text in self.ws:
            message = json.loads(text)
            if message.get("type") != "mcp":
                continue
            payload = message["payload"]
            self.received.append(payload)
            self.message_arrived.set()
            task = asyncio.create_task(self._answer(payload))
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    async def _answer(self, payload: dict[str, Any]) -> None:
        method = payload.get("method")
        if method is None or "id" not in payload:
            return  # notification: the stock device never replies
        handler = self.handlers.get(method) or _DEFAULT_HANDLERS.get(method)
        if handler is None:
            reply = {"message": f"Method not implemented: {method}"}
            await self.reply({"jsonrpc": "2.0", "id": payload["id"], "error": reply})
            return
        result = await handler(self, payload)
        if result is not None:
            await self.reply(result)


def ok(payload: dict[str, Any], result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": payload["id"], "result": result}


def stock_error(payload: dict[str, Any], message: str) -> dict[str, Any]:
    # Stock firmware errors carry no `code`.
    return {"jsonrpc": "2.0", "id": payload["id"], "error": {"message": message}}


async def _initialize(device: WireDevice, payload: dict[str, Any]) -> dict[str, Any]:
    return ok(
        payload,
        {
            "protocolVersion": "2024-11-05",
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "bread-compact-wifi", "version": "2.4.2"},
        },
    )


async def _tools_list(device: WireDevice, payload: dict[str, Any]) -> dict[str, Any]:
    cursor = (payload.get("params") or {}).get("cursor") or ""
    names = [tool["name"] for tool in device.tools]
    start = names.index(cursor) if cursor else 0
    page = device.tools[start : start + device.page_size]
    result: dict[str, Any] = {"tools": page}
    if start + device.page_size < len(device.tools):
        result["nextCursor"] = device.tools[start + device.page_size]["name"]
    return ok(payload, result)


async def _tools_call(device: WireDevice, payload: dict[str, Any]) -> dict[str, Any]:
    params = payload.get("params") or {}
    name = params.get("name")
    arguments = params.get("arguments") or {}
    if name == "self.audio_speaker.set_volume":
        volume = arguments.get("volume")
        if not isinstance(volume, int):
            return stock_error(payload, "Missing valid argument: volume")
        if volume > 100:
            return stock_error(payload, "Value exceeds maximum allowed: 100")
        device.volume = volume
        return ok(payload, {"content": [{"type": "text", "text": "true"}], "isError": False})
    if name == "self.get_device_status":
        text = json.dumps({"audio_speaker": {"volume": device.volume}}, separators=(",", ":"))
        return ok(payload, {"content": [{"type": "text", "text": text}], "isError": False})
    return stock_error(payload, f"Unknown tool: {name}")


_DEFAULT_HANDLERS: dict[str, Handler] = {
    "initialize": _initialize,
    "tools/list": _tools_list,
    "tools/call": _tools_call,
}
