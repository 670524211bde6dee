"""The one scripted stock device of the test suite, and the hang/stall fakes for it.

`StockMcp` is the stock firmware's MCP semantics as a pure function from a JSON-RPC request to
its reply (initialize; tools/list pages with name cursors, `nextCursor` omitted on the last page,
user-only tools only with `withUserTools`; tools/call with the stock volume rules; errors without
`code`; string ids and notifications get no reply). `WireDevice` speaks it over a real WebSocket
like xiaozhi-esp32 2.4 (headers, hello, compact envelopes), and the in-memory links of
`tests/fakes.py` feed it to an `McpClient` directly. A test changes one method's behaviour with
`device.handlers[method] = ...`, usually one of the fakes at the bottom of this module.
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
CLIENT_ID = "6c4a5a2e-2f0e-4a4e-9d59-3b2d1c0e9f11"
SERVER_INFO = {"name": "bread-compact-wifi", "version": "2.4.2"}


def _schema(
    properties: dict[str, Any] | None = None, required: list[str] | None = None
) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties or {}}
    if required:
        schema["required"] = required
    return schema


def _percent(name: str) -> dict[str, Any]:
    return {name: {"type": "integer", "minimum": 0, "maximum": 100}}


STATUS_TOOL = {
    "name": "self.get_device_status",
    "description": "Get the device status.",
    "inputSchema": _schema(),
}
VOLUME_TOOL = {
    "name": "self.audio_speaker.set_volume",
    "description": "Set the volume of the audio speaker.",
    "inputSchema": _schema(_percent("volume"), ["volume"]),
}


def stock_tools() -> list[dict[str, Any]]:
    """The stock tool list of a device with speaker, backlight, theme and LED."""
    user = {"audience": ["user"]}
    led: dict[str, dict[str, Any]] = {
        "on": {"type": "boolean"},
        "brightness": {"type": "integer", "default": 100},
    }
    led["brightness"].update(minimum=0, maximum=100)
    return [
        STATUS_TOOL,
        VOLUME_TOOL,
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


def ok(request: dict[str, Any], result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request["id"], "result": result}


def stock_error(request: dict[str, Any], message: str) -> dict[str, Any]:
    """The stock firmware's error shape: a message and no code."""
    return {"jsonrpc": "2.0", "id": request["id"], "error": {"message": message}}


def text_result(text: str, *, is_error: bool = False) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": is_error}


class StockMcp:
    """Stock-firmware MCP semantics; pages hold `page_size` tools (the firmware pages by bytes)."""

    def __init__(self, tools: list[dict[str, Any]] | None = None, page_size: int = 100) -> None:
        self.tools = tools if tools is not None else [STATUS_TOOL, VOLUME_TOOL]
        self.page_size = page_size
        self.volume = 50
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, message: dict[str, Any]) -> dict[str, Any] | None:
        return self.handle(message)

    def handle(self, message: dict[str, Any]) -> dict[str, Any] | None:
        method = message.get("method", "")
        if not isinstance(method, str) or method.startswith("notifications"):
            return None
        if not isinstance(message.get("id"), int):
            return None  # stock firmware drops string ids without a reply
        params = message.get("params") or {}
        if method == "initialize":
            return ok(
                message,
                {
                    "protocolVersion": "2024-11-05",
                    "capabilities": {"tools": {}},
                    "serverInfo": dict(SERVER_INFO),
                },
            )
        if method == "tools/list":
            return ok(message, self.page(params))
        if method == "tools/call":
            return self.call(message, params)
        return stock_error(message, f"Method not implemented: {method}")

    def page(self, params: dict[str, Any]) -> dict[str, Any]:
        with_user_tools = params.get("withUserTools") is True
        visible = [t for t in self.tools if with_user_tools or not _user_only(t)]
        names = [tool.get("name") if isinstance(tool, dict) else None for tool in visible]
        cursor = params.get("cursor") or ""
        start = names.index(cursor) if cursor else 0
        page: dict[str, Any] = {"tools": visible[start : start + self.page_size]}
        if start + self.page_size < len(visible):
            page["nextCursor"] = names[start + self.page_size]
        return page

    def call(self, message: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        name = params.get("name")
        arguments = params.get("arguments") or {}
        self.calls.append((str(name), arguments))
        if name == VOLUME_TOOL["name"]:
            volume = arguments.get("volume")
            if not isinstance(volume, int):
                return stock_error(message, "Missing valid argument: volume")
            if volume > 100:
                return stock_error(message, "Value exceeds maximum allowed: 100")
            self.volume = volume
            return ok(message, text_result("true"))
        if name == STATUS_TOOL["name"]:
            status = json.dumps({"audio_speaker": {"volume": self.volume}}, separators=(",", ":"))
            return ok(message, text_result(status))
        if name in {tool.get("name") for tool in self.tools if isinstance(tool, dict)}:
            return ok(message, text_result("true"))
        return stock_error(message, f"Unknown tool: {name}")


def _user_only(tool: Any) -> bool:
    return isinstance(tool, dict) and "annotations" in tool


# ---- the device on a real WebSocket -----------------------------------------------------------

Handler = Callable[["WireDevice", dict[str, Any]], Awaitable[Any]]


class WireDevice:
    """A stock device over a real WebSocket. Every MCP payload the bridge sends is recorded in
    `received`, every other JSON message in `messages`, every binary frame in `audio`."""

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
        protocol_version: int = 1,
    ) -> None:
        self.url = url
        self.token = token
        self.device_id = device_id
        self.stock = StockMcp(tools, page_size)
        self.hello = STOCK_HELLO if hello is None else hello
        self.compact = compact
        self.protocol_version = protocol_version
        self.session_id = ""
        self.server_hello: dict[str, Any] | None = None
        self.received: list[dict[str, Any]] = []
        self.messages: list[dict[str, Any]] = []
        self.audio: list[bytes] = []
        self.handlers: dict[str, Handler] = {}  # method -> custom behaviour
        self.ws: ClientConnection | None = None
        self.message_arrived = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._answering: set[asyncio.Task[None]] = set()

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.stock.tools

    @tools.setter
    def tools(self, tools: list[dict[str, Any]]) -> None:
        self.stock.tools = tools

    @property
    def volume(self) -> int:
        return self.stock.volume

    def headers(self) -> dict[str, str]:
        headers = {
            "Protocol-Version": str(self.protocol_version),
            "Device-Id": self.device_id,
            "Client-Id": CLIENT_ID,
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
        found: dict[str, Any] = await self._wait(
            lambda: _first(self.received, "method", method), timeout_s
        )
        return found

    async def wait_for_message(self, kind: str, timeout_s: float = 5.0) -> dict[str, Any]:
        """The first non-MCP message of this `type` (e.g. "tts"), waiting for it if needed."""
        found: dict[str, Any] = await self._wait(
            lambda: _first(self.messages, "type", kind), timeout_s
        )
        return found

    async def wait_for_count(
        self, what: Callable[[], int], count: int, timeout_s: float = 5.0
    ) -> None:
        await self._wait(lambda: True if what() >= count else None, timeout_s)

    def methods(self) -> list[str]:
        return [p.get("method", "<reply>") for p in self.received]

    async def round_trip(self) -> None:
        """Wait until everything the bridge sent before now has arrived (a ping's pong)."""
        assert self.ws is not None
        await asyncio.wait_for(await self.ws.ping(), 5)

    async def kill(self) -> None:
        """Drop TCP without a close frame, as the stock firmware does."""
        assert self.ws is not None
        self.ws.transport.abort()
        await self.stop_reader()

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        await self.stop_reader()

    def start_reader(self) -> None:
        """Read (and answer) frames again after `stop_reader`."""
        self._reader = asyncio.create_task(self._read())

    async def stop_reader(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    async def _wait(self, found: Callable[[], Any], timeout_s: float) -> Any:
        async with asyncio.timeout(timeout_s):
            while True:
                value = found()
                if value is not None:
                    return value
                self.message_arrived.clear()
                await self.message_arrived.wait()

    async def _read(self) -> None:
        assert self.ws is not None
        async for frame in self.ws:
            if isinstance(frame, bytes):
                self.audio.append(frame)
            else:
                message = json.loads(frame)
                if message.get("type") == "mcp":
                    self._on_mcp(message["payload"])
                else:
                    self.messages.append(message)
            self.message_arrived.set()

    def _on_mcp(self, payload: dict[str, Any]) -> None:
        self.received.append(payload)
        task = asyncio.create_task(self._answer(payload))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _answer(self, payload: dict[str, Any]) -> None:
        handler = self.handlers.get(payload.get("method", ""))
        if handler is None:
            reply = self.stock.handle(payload)
        elif "id" in payload:
            reply = await handler(self, payload)
        else:
            reply = None
        if reply is not None:
            await self.reply(reply)


def _first(items: list[dict[str, Any]], key: str, value: str) -> dict[str, Any] | None:
    return next((item for item in items if item.get(key) == value), None)


# ---- hang / stall fakes: `device.handlers[method] = ...` --------------------------------------


async def never_answer(_device: WireDevice, _payload: dict[str, Any]) -> None:
    """The request is received and never answered (a hung tool, a stalled handshake)."""
    return None


def answer_when(event: asyncio.Event, reached: asyncio.Event | None = None) -> Handler:
    """Signal `reached` when the request arrives, answer the stock way once `event` is set."""

    async def handler(device: WireDevice, payload: dict[str, Any]) -> Any:
        if reached is not None:
            reached.set()
        await event.wait()
        return device.stock.handle(payload)

    return handler


def hang_and_signal(reached: asyncio.Event) -> Handler:
    """Signal `reached` when the request arrives; never answer."""
    return answer_when(asyncio.Event(), reached)


def answer_with(make_reply: Callable[[dict[str, Any]], Any]) -> Handler:
    """Answer every request of the method with `make_reply(payload)`."""

    async def handler(_device: WireDevice, payload: dict[str, Any]) -> Any:
        return make_reply(payload)

    return handler
