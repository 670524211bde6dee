"""The device registry: device_id → live device, with events others subscribe to.

The admin API, the CLI (through the API) and later the chat pipeline read devices here and call
their tools through `Device.call_tool`, which knows tools and arguments but not transports.
"""

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import structlog

from backend.devices.errors import (
    DeviceBusy,
    DeviceNotReady,
    InvalidArguments,
    UnknownDevice,
    UnknownTool,
)
from backend.devices.validation import argument_error
from backend.mcp_session import CallResult, McpClient, Tool

if TYPE_CHECKING:
    from backend.transports.base import DeviceLink

log = structlog.get_logger("devices")


class DeviceState(StrEnum):
    CONNECTING = "connecting"  # link up, waiting for the device hello
    INITIALIZING = "initializing"  # MCP initialize / tools/list in progress
    READY = "ready"
    FAILED = "failed"  # link up, but the MCP handshake failed (see `error`)
    DISCONNECTED = "disconnected"


class EventKind(StrEnum):
    CONNECTED = "connected"
    READY = "ready"
    FAILED = "failed"
    DISCONNECTED = "disconnected"
    TOOL_CALLED = "tool_called"


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    kind: EventKind
    device_id: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Device:
    device_id: str
    client_id: str | None
    transport: str
    session_id: str
    protocol_version: int
    link: "DeviceLink"
    mcp: McpClient
    registry: "DeviceRegistry"
    max_pending_calls: int = 256
    connected_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    state: DeviceState = DeviceState.CONNECTING
    server_info: dict[str, Any] | None = None
    tools: dict[str, Tool] = field(default_factory=dict)
    error: str | None = None

    def tool_list(self, *, include_user_only: bool = True) -> list[Tool]:
        tools = self.tools.values()
        return [t for t in tools if include_user_only or not is_user_only(t)]

    def summary(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "client_id": self.client_id,
            "transport": self.transport,
            "state": self.state.value,
            "connected_at": self.connected_at.isoformat(),
            "server_info": self.server_info,
            "tool_count": len(self.tools),
            "error": self.error,
        }

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> CallResult:
        """Validate and send one tools/call; MCP errors (timeout, disconnect...) propagate."""
        arguments = arguments or {}
        tool = self._checked_tool(name, arguments)
        if self.mcp.pending_count >= self.max_pending_calls:
            raise DeviceBusy(self.device_id, self.max_pending_calls)
        started = time.perf_counter()
        outcome = "error"
        try:
            result = await self.mcp.call_tool(tool.name, arguments, timeout_s=timeout_s)
            outcome = "tool_error" if result.is_error else "ok"
            return result
        finally:
            duration_ms = (time.perf_counter() - started) * 1000
            self.registry.emit(
                EventKind.TOOL_CALLED,
                self.device_id,
                tool=name,
                outcome=outcome,
                duration_ms=round(duration_ms, 3),
            )

    def _checked_tool(self, name: str, arguments: dict[str, Any]) -> Tool:
        if self.state is not DeviceState.READY:
            raise DeviceNotReady(self.device_id, self.state.value)
        tool = self.tools.get(name)
        if tool is None:
            raise UnknownTool(self.device_id, name)
        reason = argument_error(tool.input_schema, arguments)
        if reason is not None:
            raise InvalidArguments(name, reason)
        return tool


def is_user_only(tool: Tool) -> bool:
    """Stock firmware marks tools meant for people, not the model, with audience ["user"]."""
    annotations = tool.annotations or {}
    audience = annotations.get("audience")
    return isinstance(audience, list) and "user" in audience and "assistant" not in audience


Listener = Callable[[DeviceEvent], None]


class DeviceRegistry:
    """Live devices by id. One device id has at most one live link: a reconnect replaces it."""

    def __init__(self) -> None:
        self._devices: dict[str, Device] = {}
        self._listeners: list[Listener] = []

    def __len__(self) -> int:
        return len(self._devices)

    def __iter__(self) -> Iterator[Device]:
        return iter(list(self._devices.values()))

    def get(self, device_id: str) -> Device | None:
        return self._devices.get(device_id)

    def require(self, device_id: str) -> Device:
        device = self._devices.get(device_id)
        if device is None:
            raise UnknownDevice(device_id)
        return device

    def add(self, device: Device) -> Device | None:
        """Register a new link; returns the device it replaces, which the caller closes."""
        previous = self._devices.get(device.device_id)
        self._devices[device.device_id] = device
        self.emit(EventKind.CONNECTED, device.device_id, transport=device.transport)
        return previous

    def remove(self, device: Device, reason: str) -> None:
        """Forget `device` unless a newer link with the same id already replaced it."""
        device.state = DeviceState.DISCONNECTED
        if self._devices.get(device.device_id) is device:
            del self._devices[device.device_id]
        self.emit(EventKind.DISCONNECTED, device.device_id, reason=reason)

    def mark_ready(self, device: Device) -> None:
        device.state = DeviceState.READY
        device.error = None
        self.emit(EventKind.READY, device.device_id, tool_count=len(device.tools))

    def mark_failed(self, device: Device, error: str) -> None:
        device.state = DeviceState.FAILED
        device.error = error
        self.emit(EventKind.FAILED, device.device_id, error=error)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener` on every event; returns a function that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def emit(self, kind: EventKind, device_id: str, **detail: Any) -> None:
        event = DeviceEvent(kind, device_id, detail)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("device event listener failed", event=kind.value)

    async def wait_for_state(
        self, device_id: str, state: DeviceState = DeviceState.READY, timeout_s: float = 10.0
    ) -> Device:
        """Wait until `device_id` is connected and in `state` (for the demo and the tests)."""
        ready = asyncio.Event()

        def check(_event: DeviceEvent | None = None) -> None:
            device = self._devices.get(device_id)
            if device is not None and device.state is state:
                ready.set()

        unsubscribe = self.subscribe(check)
        try:
            check()
            async with asyncio.timeout(timeout_s):
                await ready.wait()
        finally:
            unsubscribe()
        return self.require(device_id)
