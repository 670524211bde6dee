"""One device conversation, independent of the transport that carries it.

The transport calls `on_text`, `on_binary` and `on_closed`; the session answers the hello, runs
the MCP handshake (initialize → notifications/initialized → paginated tools/list) and keeps the
registry's view of the device current. One bad message is logged and dropped, never fatal.
"""

import asyncio
import secrets
from typing import Any

import structlog

from backend.config import Settings
from backend.devices.registry import Device, DeviceRegistry, DeviceState
from backend.mcp_session import (
    DeviceDisconnected,
    McpClient,
    McpError,
    TimeoutPolicy,
)
from backend.protocol import (
    Abort,
    AudioParams,
    DeviceHello,
    Goodbye,
    Listen,
    ParseError,
    ServerHello,
)
from backend.protocol.messages import decode_device_message, device_message, mcp_envelope
from backend.transports.base import DeviceLink

log = structlog.get_logger("device")

REPLACED = "replaced by a new connection"


class DeviceSession:
    __slots__ = (
        "_background",
        "_hello_timer",
        "_log",
        "_settings",
        "audio_frames",
        "device",
        "hello",
        "link",
        "registry",
        "session_id",
    )

    def __init__(self, link: DeviceLink, registry: DeviceRegistry, settings: Settings) -> None:
        identity = link.identity
        self.link = link
        self.registry = registry
        self._settings = settings
        self.session_id = secrets.token_hex(16)
        self._log = log.bind(device_id=identity.device_id, session_id=self.session_id)
        self.hello: DeviceHello | None = None
        self.audio_frames = 0
        self._background: set[asyncio.Task[Any]] = set()
        mcp = McpClient(
            self._send_mcp,
            timeouts=TimeoutPolicy(
                default_s=settings.call_timeout_s, per_tool=dict(settings.tool_timeouts)
            ),
            vision=_vision_capability(settings),
            on_tools_changed=self._on_tools_changed,
            log=self._log,
        )
        self.device = Device(
            device_id=identity.device_id,
            client_id=identity.client_id,
            transport=link.transport,
            session_id=self.session_id,
            protocol_version=identity.protocol_version,
            link=link,
            mcp=mcp,
            registry=registry,
            max_pending_calls=settings.max_pending_calls,
        )
        self._hello_timer = asyncio.get_running_loop().call_later(
            settings.hello_timeout_s, self._on_hello_timeout
        )
        previous = registry.add(self.device)
        if previous is not None:
            self._replace(previous)
        self._log.info("device connected", transport=link.transport, remote=identity.remote)

    # ---- inbound, called by the transport ------------------------------------------------------

    async def on_text(self, text: str) -> None:
        try:
            data = decode_device_message(text)
            if data["type"] == "mcp" and "payload" in data:
                # Every tool reply: straight to the MCP client, no model built on this path.
                self.device.mcp.feed(data["payload"])
                return
            message = device_message(data)
        except ParseError as exc:
            self._log.warning("dropped device message", reason=str(exc), size=len(text))
            return
        if isinstance(message, DeviceHello):
            await self._on_hello(message)
        elif isinstance(message, Listen):
            self._log.info("listen", state=message.state, mode=message.mode, text=message.text)
        elif isinstance(message, Abort):
            self._log.info("abort", reason=message.reason)
        elif isinstance(message, Goodbye):
            self._log.info("device said goodbye")
            await self.link.close(1000, "goodbye")

    def on_binary(self, data: bytes) -> None:
        # Audio arrives here once the voice pipeline exists; until then it is counted, not kept.
        if self.audio_frames == 0:
            self._log.debug("audio frames are ignored for now", size=len(data))
        self.audio_frames += 1

    def on_closed(self, reason: str) -> None:
        self._hello_timer.cancel()
        for task in list(self._background):
            task.cancel()
        self.device.mcp.close(reason)
        self.registry.remove(self.device, reason)
        self._log.info("device disconnected", reason=reason)

    # ---- hello and MCP handshake ---------------------------------------------------------------

    async def _on_hello(self, hello: DeviceHello) -> None:
        first = self.hello is None
        self._hello_timer.cancel()
        self.hello = hello
        # The stock device waits 10 s for this reply; it goes out before any other work.
        await self.link.send_text(self._server_hello())
        if not first:
            self._log.info("repeated hello answered with the same session")
            return
        if hello.features.mcp:
            self.device.state = DeviceState.INITIALIZING
            self._spawn(self._initialize())
        else:
            self._log.info("device has no MCP server (no features.mcp in hello)")
            self.registry.mark_ready(self.device)

    def _server_hello(self) -> str:
        params = AudioParams(
            sample_rate=self._settings.audio_sample_rate,
            frame_duration=self._settings.audio_frame_duration,
        )
        return ServerHello(session_id=self.session_id, audio_params=params).to_json()

    async def _initialize(self) -> None:
        mcp = self.device.mcp
        try:
            result = await mcp.initialize(timeout_s=self._settings.init_timeout_s)
            self.device.server_info = result.server_info
            await self._load_tools()
        except DeviceDisconnected:
            return
        except McpError as exc:
            self._log.warning("MCP handshake failed; device stays connected", error=str(exc))
            self.registry.mark_failed(self.device, str(exc))
            return
        self._log.info("device ready", tools=len(self.device.tools))
        self.registry.mark_ready(self.device)

    async def _load_tools(self) -> None:
        tools = await self.device.mcp.list_tools(with_user_tools=self._settings.list_user_tools)
        self.device.tools = {tool.name: tool for tool in tools}

    def _on_tools_changed(self) -> None:
        if self.device.state is DeviceState.READY:
            self._spawn(self._reload_tools())

    async def _reload_tools(self) -> None:
        try:
            await self._load_tools()
        except McpError as exc:
            self._log.warning("re-listing tools failed", error=str(exc))
            return
        self._log.info("tool list changed", tools=len(self.device.tools))
        self.registry.mark_ready(self.device)

    # ---- outbound and housekeeping -------------------------------------------------------------

    async def _send_mcp(self, payload: dict[str, Any]) -> None:
        await self.link.send_text(mcp_envelope(self.session_id, payload))

    def _on_hello_timeout(self) -> None:
        self._log.warning("no hello from device; closing", timeout_s=self._settings.hello_timeout_s)
        self._spawn(self.link.close(1008, "no hello"))

    def _replace(self, previous: Device) -> None:
        self._log.info("same device id reconnected; closing the old link")
        previous.mcp.close(REPLACED)
        self._spawn(previous.link.close(1000, REPLACED))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _vision_capability(settings: Settings) -> dict[str, str] | None:
    if not settings.vision_url:
        return None
    vision = {"url": settings.vision_url}
    if settings.vision_token is not None:
        vision["token"] = settings.vision_token.get_secret_value()
    return vision
