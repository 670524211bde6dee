"""A device as the registry hands it out: `Device`, connected here, and `RemoteDevice`,
connected to another instance of a cluster (its calls forwarded there). Its state is written
by the registry only; `call_tool` validates and sends one call."""

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from backend.common import iso_time
from backend.devices.conversation import Conversation
from backend.devices.errors import (
    ConfirmationRequired,
    DeviceBusy,
    DeviceElsewhere,
    DeviceLayerError,
    DeviceNotReady,
    DeviceOffline,
    InvalidArguments,
    UnknownTool,
)
from backend.devices.state import EMPTY_TOOLS, DeviceState, EventKind, ToolSet, is_user_only
from backend.devices.validation import argument_error
from backend.mcp_session import CallResult, McpClient, Tool
from backend.metrics import record_mcp_call
from backend.transports.base import DeviceIdentity

if TYPE_CHECKING:
    from backend.devices.registry import DeviceRegistry

# ---- live devices -----------------------------------------------------------------------------


class DeviceConnection(Protocol):
    """What the registry needs of the session that carries a live device."""

    @property
    def session_id(self) -> str:
        """The session id of the link."""

    @property
    def mcp(self) -> McpClient:
        """The MCP client speaking to the device over this link."""

    @property
    def conversation(self) -> Conversation:
        """The conversation API over this link."""

    def disconnect(self, reason: str, code: int) -> None:
        """Fail pending calls with `reason` now and close the link in the background."""
        ...


class Device:
    """A connected device. Its state is written by the registry only; read it here."""

    __slots__ = (
        "_connection",
        "_error",
        "_registry",
        "_server_info",
        "_state",
        "_tools",
        "client_id",
        "connected_at",
        "device_id",
        "protocol_version",
        "remote",
        "transport",
    )

    def __init__(
        self, identity: DeviceIdentity, connection: DeviceConnection, registry: "DeviceRegistry"
    ) -> None:
        self.device_id = identity.device_id
        self.client_id = identity.client_id
        self.transport = identity.transport
        self.protocol_version = identity.protocol_version
        self.remote = identity.remote
        self.connected_at = time.time()
        self._connection = connection
        self._registry = registry
        self._state = DeviceState.CONNECTING
        self._server_info: Mapping[str, Any] | None = None
        self._tools = EMPTY_TOOLS
        self._error: str | None = None

    @property
    def state(self) -> DeviceState:
        """The current state; only the registry changes it."""
        return self._state

    @property
    def server_info(self) -> Mapping[str, Any] | None:
        """The MCP `serverInfo` from the device's initialize result, once it is known."""
        return self._server_info

    @property
    def tools(self) -> ToolSet:
        """The tool list read at the handshake (or the last `list_changed` re-list)."""
        return self._tools

    @property
    def error(self) -> str | None:
        """Why the MCP handshake failed, in state `failed`."""
        return self._error

    @property
    def session_id(self) -> str:
        """The session id of the current link."""
        return self._connection.session_id

    @property
    def mcp(self) -> McpClient:
        """The MCP client of the current link."""
        return self._connection.mcp

    @property
    def connection(self) -> DeviceConnection:
        """The transport-side session this device runs over."""
        return self._connection

    @property
    def is_live(self) -> bool:
        """Whether the device is connected now (any state but offline)."""
        return self._state is not DeviceState.OFFLINE

    def tool_list(self, *, include_user_only: bool = True) -> list[Tool]:
        """The tools; without the user-only ones (`include_user_only=False`) for models."""
        return [t for t in self._tools.tools if include_user_only or not is_user_only(t)]

    def summary(self) -> dict[str, Any]:
        """The device as the API lists it: ids, transport, state, times, server info, tool count."""
        record = self._registry.record(self.device_id)
        return {
            "device_id": self.device_id,
            "client_id": self.client_id,
            "transport": self.transport,
            "state": self._state.value,
            "connected_at": iso_time(self.connected_at),
            "last_seen": None if self.is_live else iso_time(time.time()),
            "first_seen": iso_time(record.first_seen) if record else None,
            "server_info": dict(self._server_info) if self._server_info is not None else None,
            "tool_count": len(self._tools),
            "tools_read_at": iso_time(record.tools_read_at) if record else None,
            "error": self._error,
            "ota": record.ota_summary() if record else None,
            "name": record.name if record else None,
            "notes": record.notes if record else None,
            **self._registry.placement(self.owner),
        }

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        confirmed: bool = False,
        actor: str | None = None,
    ) -> CallResult:
        """Validate and send one tools/call.

        Raises DeviceNotReady, UnknownTool, InvalidArguments, ConfirmationRequired (a risky tool
        without `confirmed`), DeviceBusy before sending, and the MCP client's errors after
        (RequestTimeout, DeviceDisconnected, DeviceError, ProtocolViolation). A tool that
        reports `isError` returns normally. Every call, refused ones too, ends in one
        `tool_called` event with `actor` (who asked: a key id, a conversation), the outcome and
        the arguments (the audit log keeps their digest).
        """
        arguments = arguments or {}
        started = time.perf_counter()
        outcome = "error"
        error: str | None = None
        try:
            tool = self._checked_tool(name, arguments)
            if not confirmed:
                reason = self._registry.confirmation.reason(self.device_id, tool)
                if reason is not None:
                    raise ConfirmationRequired(self.device_id, name, reason)
            result = await self._send(tool, arguments, timeout_s, actor)
            outcome = "tool_error" if result.is_error else "ok"
            return result
        except DeviceLayerError as exc:
            outcome, error = "refused", type(exc).__name__
            raise
        except Exception as exc:
            error = type(exc).__name__
            raise
        finally:
            seconds = time.perf_counter() - started
            failure = _FAILURES.get(error or "", "other")
            record_mcp_call(failure if outcome == "error" else outcome, seconds)
            duration_ms = seconds * 1000
            self._registry.emit_from(
                self.owner,
                EventKind.TOOL_CALLED,
                self.device_id,
                tool=name,
                outcome=outcome,
                duration_ms=round(duration_ms, 3),
                actor=actor,
                arguments=arguments,
                confirmed=confirmed,
                error=error,
            )

    @property
    def owner(self) -> str | None:
        """The other bridge instance this device is connected to; None: connected here."""
        return None

    async def _send(
        self, tool: Tool, arguments: dict[str, Any], timeout_s: float | None, actor: str | None
    ) -> CallResult:
        mcp = self._connection.mcp
        limit = self._registry.max_pending_calls
        if mcp.pending_count >= limit:
            raise DeviceBusy(self.device_id, limit)
        return await mcp.call_tool(tool.name, arguments, timeout_s=timeout_s)

    def _checked_tool(self, name: str, arguments: dict[str, Any]) -> Tool:
        if self._state is not DeviceState.READY:
            if self._state is DeviceState.OFFLINE:
                raise DeviceOffline(self.device_id)
            raise DeviceNotReady(self.device_id, self._state.value)
        tool = self._tools.by_name.get(name)
        if tool is None:
            raise UnknownTool(self.device_id, name, self._tools.by_name)
        reason = argument_error(tool.input_schema, arguments)
        if reason is not None:
            raise InvalidArguments(name, reason)
        return tool


# The metrics' outcome of a call that failed after it was sent, by the error's class.
_FAILURES = {
    "RequestTimeout": "timeout",
    "DeviceDisconnected": "disconnected",
    "DeviceError": "device_error",
    "ProtocolViolation": "protocol_error",
}


# ---- devices connected to another instance of a cluster -------------------------------------

# Sends one validated tools/call to the instance a remote device is connected to:
# (device, tool name, arguments, timeout_s, actor) -> the device's result, or the same errors a
# local call raises.
Forward = Callable[
    ["RemoteDevice", str, dict[str, Any], float | None, str | None], Awaitable[CallResult]
]


class _Elsewhere:
    """The `connection` of a remote device: nothing here can use its link."""

    __slots__ = ("_device_id", "_owner")

    def __init__(self, device_id: str, owner: str) -> None:
        self._device_id = device_id
        self._owner = owner

    @property
    def session_id(self) -> str:
        return ""

    @property
    def mcp(self) -> McpClient:
        raise DeviceElsewhere(self._device_id, self._owner)

    @property
    def conversation(self) -> Conversation:
        raise DeviceElsewhere(self._device_id, self._owner)

    def disconnect(self, reason: str, code: int) -> None:
        return None  # its link is on the owner; the owner's lease check closes it


@dataclass(frozen=True, slots=True)
class RemoteReport:
    """What another instance reported about a device connected to it (a fleet event)."""

    kind: EventKind
    device_id: str
    owner: str
    epoch: int
    client_id: str | None = None
    transport: str = "websocket"
    state: DeviceState = DeviceState.CONNECTING
    connected_at: float | None = None
    server_info: Mapping[str, Any] | None = None
    tools: ToolSet | None = None
    # A report leaves out a large tool list: the digest names it in the shared catalogue.
    tools_digest: str | None = None
    error: str | None = None
    reason: str | None = None


class RemoteDevice(Device):
    """A device connected to another bridge instance: listed and called like a local one, its
    calls forwarded to that instance (`owner`)."""

    __slots__ = ("_forward", "_owner", "epoch")

    def __init__(self, report: RemoteReport, registry: "DeviceRegistry", forward: Forward) -> None:
        identity = DeviceIdentity(report.device_id, report.client_id, 1, report.transport)
        super().__init__(identity, _Elsewhere(report.device_id, report.owner), registry)
        self._owner = report.owner
        self._forward = forward
        self.epoch = report.epoch
        if report.connected_at is not None:
            self.connected_at = report.connected_at

    @property
    def owner(self) -> str:
        """The instance the device is connected to."""
        return self._owner

    async def _send(
        self, tool: Tool, arguments: dict[str, Any], timeout_s: float | None, actor: str | None
    ) -> CallResult:
        return await self._forward(self, tool.name, arguments, timeout_s, actor)
