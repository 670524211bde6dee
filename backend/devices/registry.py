"""The device registry: the one owner of device state, for live devices and remembered ones.

Every state change goes through a method of `DeviceRegistry` and emits exactly one `DeviceEvent`;
nothing else writes a device's state, tools or server info. Sessions report what happened on
their link (hello, MCP handshake done, link gone), the registry decides what it means (a
reconnect replaces the previous link; a stale session's report is ignored), and listeners (the
device catalogue that persists it, the API's waiters, later the chat pipeline) follow the events.

The registry also remembers every device it has seen (`DeviceRecord`): the catalogue loads those
at start and persists them, so a device that is offline now is still listed with its last tools.
"""

import asyncio
import contextlib
import hashlib
import json
import time
import weakref
from bisect import bisect_right
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum, StrEnum
from types import MappingProxyType
from typing import Any, Protocol

import structlog

from backend.common import iso_time
from backend.devices.confirm import ConfirmationPolicy
from backend.devices.conversation import Conversation
from backend.devices.errors import (
    ConfirmationRequired,
    DeviceBusy,
    DeviceElsewhere,
    DeviceLayerError,
    DeviceNotReady,
    DeviceOffline,
    DeviceOnline,
    InvalidArguments,
    UnknownDevice,
    UnknownTool,
)
from backend.devices.validation import argument_error
from backend.logs import LineRate
from backend.mcp_session import CallResult, McpClient, Tool
from backend.metrics import record_mcp_call
from backend.transports.base import DeviceIdentity

log = structlog.get_logger("devices")

REPLACED = "replaced by a new connection"
SHUTDOWN = "bridge shutting down"
GOING_AWAY = 1001
NORMAL_CLOSURE = 1000
POLICY_VIOLATION = 1008
SERVICE_RESTART = 1012  # "reconnect": the device comes back, here or on another instance
# A call to a device that was just asked to reconnect (a drain or a rebalance moving it to
# another instance, docs/cluster.md) waits this long at most for it to be ready again, instead
# of failing as offline: the firmware's reconnect pause (1 s +-20 %) plus its hello and MCP
# handshake, with room for a balancer's retry.
HANDOVER_WAIT_S = 5.0
RECONNECT_SUFFIX = ": reconnect"  # how every reason of a close 1012 ends (backend/cluster)


class DeviceState(StrEnum):
    """A device's state as the registry sees it; values are the API's `state` strings."""

    CONNECTING = "connecting"  # link up, waiting for the device hello
    INITIALIZING = "initializing"  # MCP initialize / tools/list in progress
    READY = "ready"
    FAILED = "failed"  # link up, but the MCP handshake failed (see `error`)
    OFFLINE = "offline"  # not connected now; its last known tools are cached


LIVE_STATES = frozenset(
    {DeviceState.CONNECTING, DeviceState.INITIALIZING, DeviceState.READY, DeviceState.FAILED}
)


class EventKind(StrEnum):
    """What a `DeviceEvent` reports; values are the event names of the API's event stream."""

    CONNECTED = "connected"  # → connecting
    INITIALIZING = "initializing"  # → initializing
    READY = "ready"  # → ready
    FAILED = "failed"  # → failed
    DISCONNECTED = "disconnected"  # → offline; detail["reason"] says why (replaced, shutdown...)
    TOOLS_CHANGED = "tools_changed"  # a ready device's tool list was read again and differs
    FORGOTTEN = "forgotten"  # an offline device was removed from the catalogue
    REPORTED = "reported"  # the device reported its system info (OTA check)
    ANNOTATED = "annotated"  # an admin changed its display name or notes
    TOOL_CALLED = "tool_called"  # not a state change: one tools/call finished or was refused
    VOICE_TURN = "voice_turn"  # not a state change: a spoken turn ended; detail has its timings


class Unset(Enum):
    """The type of UNSET: a field a caller leaves as it is (None would clear it)."""

    UNSET = "unset"


UNSET = Unset.UNSET

_MAX_AUDITED_ID = 256  # a refused call may name any device id or tool: kept bounded


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    """One registry change, delivered to every listener in order."""

    kind: EventKind
    device_id: str
    detail: dict[str, Any] = field(default_factory=dict)
    # The bridge instance it happened on when that is another one (a cluster's fleet view);
    # None for this instance. The catalogue and the audit log store only their own events.
    origin: str | None = None


# ---- tool sets --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class ToolSet:
    """An immutable tool list and its digest. Devices of one model declare identical lists,
    so identical lists are one shared object (see `ToolSet.of`)."""

    digest: str
    tools: tuple[Tool, ...]
    by_name: Mapping[str, Tool]

    def __len__(self) -> int:
        return len(self.tools)

    @classmethod
    def of(cls, tools: Iterable[Tool]) -> "ToolSet":
        """The shared `ToolSet` of these tools: equal lists (by canonical JSON) are one object."""
        tools = tuple(tools)
        if not tools:
            return EMPTY_TOOLS
        wire = [tool.to_wire() for tool in tools]
        canonical = json.dumps(wire, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        digest = hashlib.sha256(canonical.encode()).hexdigest()[:32]
        shared = _TOOL_SETS.get(digest)
        if shared is None:
            shared = cls(digest, tools, {tool.name: tool for tool in tools})
            _TOOL_SETS[digest] = shared
        return shared

    def to_wire(self) -> list[dict[str, Any]]:
        """The tools as MCP `tools/list` entries."""
        return [tool.to_wire() for tool in self.tools]

    @staticmethod
    def known(digest: str) -> "ToolSet | None":
        """The tool set with this digest if this process holds it now (else None)."""
        return EMPTY_TOOLS if digest == "" else _TOOL_SETS.get(digest)


EMPTY_TOOLS = ToolSet("", (), {})
_TOOL_SETS: "weakref.WeakValueDictionary[str, ToolSet]" = weakref.WeakValueDictionary()


_SERVER_INFOS: dict[str, Mapping[str, Any]] = {}


def _shared_info(info: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """One copy of each distinct serverInfo (a fleet of one model reports the same one)."""
    if info is None:
        return None
    try:
        key = json.dumps(info, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return info
    shared = _SERVER_INFOS.get(key)
    if shared is None:
        if len(_SERVER_INFOS) >= 1024:
            _SERVER_INFOS.clear()
        shared = _SERVER_INFOS[key] = MappingProxyType(dict(info))
    return shared


def is_user_only(tool: Tool) -> bool:
    """Stock firmware marks tools meant for people, not the model, with audience ["user"]."""
    annotations = tool.annotations or {}
    audience = annotations.get("audience")
    return isinstance(audience, list) and "user" in audience and "assistant" not in audience


# ---- what is remembered -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """What the bridge remembers of a device it has seen (persisted by the catalogue)."""

    device_id: str
    client_id: str | None
    transport: str
    first_seen: float
    last_seen: float
    server_info: Mapping[str, Any] | None = None
    tools: ToolSet = EMPTY_TOOLS
    tools_read_at: float | None = None
    # What the device reported at its last OTA check (board, chip, firmware, network, ...).
    ota: Mapping[str, Any] | None = None
    ota_at: float | None = None
    # What an admin wrote about it (`DeviceRegistry.annotate`): a display name and notes.
    name: str | None = None
    notes: str | None = None

    @property
    def board(self) -> str | None:
        """The board name the device reported (MCP server info, else its OTA check), if any."""
        value = (self.server_info or {}).get("name") or (self.ota or {}).get("board_type")
        return value if isinstance(value, str) else None

    @property
    def firmware(self) -> str | None:
        """The firmware version the device reported (MCP server info, else its OTA check), if
        any."""
        value = (self.server_info or {}).get("version") or (self.ota or {}).get("firmware_version")
        return value if isinstance(value, str) else None

    def ota_summary(self) -> dict[str, Any] | None:
        """The OTA report for the API (without the raw system info)."""
        if self.ota is None:
            return None
        shown = {key: value for key, value in self.ota.items() if key != "system_info"}
        shown["reported_at"] = iso_time(self.ota_at)
        return shown

    def summary(self) -> dict[str, Any]:
        """The API's view of an offline device."""
        return {
            "device_id": self.device_id,
            "client_id": self.client_id,
            "transport": self.transport,
            "state": DeviceState.OFFLINE.value,
            "connected_at": None,
            "last_seen": iso_time(self.last_seen),
            "first_seen": iso_time(self.first_seen),
            "server_info": dict(self.server_info) if self.server_info is not None else None,
            "tool_count": len(self.tools),
            "tools_read_at": iso_time(self.tools_read_at),
            "error": None,
            "ota": self.ota_summary(),
            "name": self.name,
            "notes": self.notes,
        }


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


# ---- the registry -----------------------------------------------------------------------------

Listener = Callable[[DeviceEvent], None]


@dataclass(frozen=True, slots=True)
class DevicePage:
    """One page of the device listing, sorted by device id."""

    devices: list[dict[str, Any]]
    next_cursor: str | None
    total: int


class DeviceRegistry:
    """Every device by id: live ones (at most one link per id) and remembered offline ones."""

    def __init__(
        self, *, max_pending_calls: int = 256, confirmation: ConfirmationPolicy | None = None
    ) -> None:
        self.max_pending_calls = max_pending_calls
        # Which tools need an explicit confirmation (secure default: reboot, upgrade, ...).
        self.confirmation = confirmation if confirmation is not None else ConfirmationPolicy()
        self._live: dict[str, Device] = {}
        self._remote: dict[str, RemoteDevice] = {}  # connected to other instances (a cluster)
        self._known: dict[str, DeviceRecord] = {}
        # This instance's name in a cluster (set by backend.cluster): summaries then say which
        # instance each device is connected to. None: a single bridge.
        self.instance_id: str | None = None
        self._listeners: list[Listener] = []
        self._replacement_lines = LineRate()  # a device replacing its own link in a loop
        self._moving: dict[str, float] = {}  # asked to reconnect -> until when to wait for it

    # ---- reading ----------------------------------------------------------------------------

    def __len__(self) -> int:
        """The number of live (connected) devices."""
        return len(self._live)

    def __iter__(self) -> Iterator[Device]:
        """Live devices (a snapshot)."""
        return iter(list(self._live.values()))

    @property
    def known_count(self) -> int:
        """How many devices are remembered, live or offline."""
        return len(self._known)

    def get(self, device_id: str) -> Device | None:
        """The live device with this id, or None."""
        return self._live.get(device_id)

    def require(self, device_id: str) -> Device:
        """The live device, here or (in a cluster) on another instance; raises DeviceOffline for
        a known offline one, else UnknownDevice."""
        device = self._live.get(device_id) or self._remote.get(device_id)
        if device is not None:
            return device
        record = self._known.get(device_id)
        if record is not None:
            raise DeviceOffline(device_id, iso_time(record.last_seen))
        raise UnknownDevice(device_id)

    async def require_ready(self, device_id: str) -> Device:
        """`require`, except for a device moving between instances (asked to reconnect, e.g. by
        a drain): then wait, at most `HANDOVER_WAIT_S` after it left, until it is ready again
        here or elsewhere. A ready device returns without waiting."""
        device = self._live.get(device_id) or self._remote.get(device_id)
        if device is not None and device.state is DeviceState.READY:
            return device
        until = self._moving.get(device_id)
        if until is None:
            return self.require(device_id)
        remaining = until - time.monotonic()
        if remaining <= 0:
            del self._moving[device_id]
            return self.require(device_id)
        back = asyncio.Event()

        def check(_event: DeviceEvent | None = None) -> None:
            found = self._live.get(device_id) or self._remote.get(device_id)
            if found is not None and found.state is DeviceState.READY:
                back.set()

        unsubscribe = self.subscribe(check)
        try:
            check()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await back.wait()
        finally:
            unsubscribe()
        return self.require(device_id)

    def is_moving(self, device_id: str) -> bool:
        """Whether the device was asked to reconnect within the last `HANDOVER_WAIT_S`."""
        until = self._moving.get(device_id)
        return until is not None and until > time.monotonic()

    def _expect_back(self, device_id: str) -> None:
        now = time.monotonic()
        if len(self._moving) > 1024:  # forget the ones past their wait (a drain of a big fleet)
            self._moving = {k: v for k, v in self._moving.items() if v > now}
        self._moving[device_id] = now + HANDOVER_WAIT_S

    def record(self, device_id: str) -> DeviceRecord | None:
        """What is remembered of this device (live or offline), or None."""
        return self._known.get(device_id)

    def records(self) -> list[DeviceRecord]:
        """Every remembered device's record, offline ones included."""
        return list(self._known.values())

    def conversation_of(self, device_id: str) -> Conversation:
        """The live device's conversation API; raises UnknownDevice or DeviceOffline."""
        return self.require(device_id).connection.conversation

    def require_record(self, device_id: str) -> DeviceRecord:
        """The record of a remembered device; raises UnknownDevice otherwise."""
        record = self._known.get(device_id)
        if record is None:
            raise UnknownDevice(device_id)
        return record

    def summary(self, device_id: str) -> dict[str, Any]:
        """The API's view of one device, live or offline; raises UnknownDevice."""
        device = self._live.get(device_id) or self._remote.get(device_id)
        if device is not None:
            return device.summary()
        return {**self.require_record(device_id).summary(), **self.placement(None, live=False)}

    def placement(self, owner: str | None, *, live: bool = True) -> dict[str, Any]:
        """The `instance` field of a summary in a cluster (None when offline); nothing alone."""
        if self.instance_id is None:
            return {}
        return {"instance": (owner or self.instance_id) if live else None}

    def listing(
        self, *, states: frozenset[DeviceState] | None = None, after: str | None = None, limit: int
    ) -> DevicePage:
        """Devices sorted by id, starting after the cursor `after`, filtered by state."""
        ids = sorted(self._known.keys() | self._live.keys() | self._remote.keys())
        if states is not None:
            ids = [device_id for device_id in ids if self._state_of(device_id) in states]
        total = len(ids)
        start = 0
        if after is not None:
            start = bisect_right(ids, after)
        page_ids = ids[start : start + limit]
        next_cursor = page_ids[-1] if start + limit < total and page_ids else None
        return DevicePage([self.summary(i) for i in page_ids], next_cursor, total)

    def _state_of(self, device_id: str) -> DeviceState:
        device = self._live.get(device_id) or self._remote.get(device_id)
        return device.state if device is not None else DeviceState.OFFLINE

    # ---- transitions: the only writers of device state ---------------------------------------

    def load(self, records: Iterable[DeviceRecord]) -> None:
        """Remember devices from the catalogue at start (no events: they are already stored)."""
        for record in records:
            if record.device_id not in self._live:
                self._known[record.device_id] = record

    def connect(self, identity: DeviceIdentity, connection: DeviceConnection) -> Device:
        """A new link for `identity.device_id`; a previous live link for it is replaced."""
        previous = self._live.get(identity.device_id)
        if previous is not None:
            left_out = self._replacement_lines.allow(previous.device_id)
            if left_out is not None:
                log.info(
                    "same device id reconnected; closing the old link",
                    device_id=previous.device_id,
                    **({"suppressed": left_out} if left_out else {}),
                )
            self._go_offline(previous, REPLACED)
            previous.connection.disconnect(REPLACED, NORMAL_CLOSURE)
        self._remote.pop(identity.device_id, None)  # it moved here from another instance
        device = Device(identity, connection, self)
        self._live[device.device_id] = device
        now = time.time()
        known = self._known.get(device.device_id)
        if known is None:
            known = DeviceRecord(device.device_id, device.client_id, device.transport, now, now)
        else:
            known = replace(
                known, client_id=device.client_id, transport=device.transport, last_seen=now
            )
        self._known[device.device_id] = known
        self.emit(EventKind.CONNECTED, device.device_id, transport=device.transport)
        return device

    def initializing(self, device: Device) -> None:
        """The session started the MCP handshake; ignored from a replaced session."""
        if self._is_current(device) and device.state is not DeviceState.INITIALIZING:
            device._state = DeviceState.INITIALIZING
            self.emit(EventKind.INITIALIZING, device.device_id)

    def ready(
        self, device: Device, server_info: Mapping[str, Any] | None, tools: Sequence[Tool]
    ) -> None:
        """The MCP handshake finished (or the device has no MCP server: no tools)."""
        if not self._is_current(device):
            return
        tool_set = ToolSet.of(tools)
        server_info = _shared_info(server_info)
        device._state = DeviceState.READY
        device._server_info = server_info
        device._tools = tool_set
        device._error = None
        self._remember_tools(device, server_info, tool_set)
        self.emit(EventKind.READY, device.device_id, tool_count=len(tool_set))

    def tools_changed(self, device: Device, tools: Sequence[Tool]) -> None:
        """A ready device's tools were listed again (after `notifications/tools/list_changed`)."""
        if not self._is_current(device) or device.state is not DeviceState.READY:
            return
        tool_set = ToolSet.of(tools)
        if tool_set is device.tools:
            return
        device._tools = tool_set
        self._remember_tools(device, device.server_info, tool_set)
        self.emit(EventKind.TOOLS_CHANGED, device.device_id, tool_count=len(tool_set))

    def failed(self, device: Device, error: str) -> None:
        """The MCP handshake failed with `error`; ignored from a replaced session."""
        if not self._is_current(device):
            return
        device._state = DeviceState.FAILED
        device._error = error
        self.emit(EventKind.FAILED, device.device_id, error=error)

    def disconnected(self, device: Device, reason: str) -> None:
        """The device's link is gone; a no-op when the registry already took it offline."""
        if self._is_current(device):
            self._go_offline(device, reason)

    def shutdown(self, reason: str = SHUTDOWN) -> None:
        """Take every live device offline (one event each) and close their links (1001)."""
        for device in list(self._live.values()):
            self._go_offline(device, reason)
            device.connection.disconnect(reason, GOING_AWAY)

    def reported(
        self, device_id: str, client_id: str | None, info: Mapping[str, Any]
    ) -> DeviceRecord:
        """The device reported its system info (OTA check): remember it, live or not."""
        now = time.time()
        known = self._known.get(device_id)
        if known is None:
            known = DeviceRecord(device_id, client_id, "ota", now, now, ota=info, ota_at=now)
        else:
            known = replace(
                known,
                client_id=known.client_id or client_id,
                ota=info,
                ota_at=now,
                last_seen=known.last_seen if device_id in self._live else now,
            )
        self._known[device_id] = known
        self.emit(EventKind.REPORTED, device_id)
        return known

    def disconnect(self, device_id: str, reason: str, code: int = POLICY_VIOLATION) -> bool:
        """Take a live device offline and close its link now (e.g. its credentials were
        revoked); False when it is not connected."""
        device = self._live.get(device_id)
        if device is None:
            return False
        log.info("closing the device's link", device_id=device_id, reason=reason)
        if code == SERVICE_RESTART:
            self._expect_back(device_id)
        self._go_offline(device, reason)
        device.connection.disconnect(reason, code)
        return True

    def annotate(
        self, device_id: str, *, name: str | Unset | None = UNSET, notes: str | Unset | None = UNSET
    ) -> DeviceRecord:
        """Set a remembered device's display name and notes (None or "" clears one; UNSET keeps
        it); raises UnknownDevice. Checking their length is the caller's."""
        known = self.require_record(device_id)
        if not isinstance(name, Unset):
            known = replace(known, name=name or None)
        if not isinstance(notes, Unset):
            known = replace(known, notes=notes or None)
        self._known[device_id] = known
        self.emit(EventKind.ANNOTATED, device_id)
        return known

    def forget(self, device_id: str) -> None:
        """Remove an offline device from memory and (through the event) from the catalogue."""
        if device_id in self._live or device_id in self._remote:
            raise DeviceOnline(device_id)
        if self._known.pop(device_id, None) is None:
            raise UnknownDevice(device_id)
        self.emit(EventKind.FORGOTTEN, device_id)

    def _is_current(self, device: Device) -> bool:
        return self._live.get(device.device_id) is device

    def _go_offline(self, device: Device, reason: str) -> None:
        del self._live[device.device_id]
        device._state = DeviceState.OFFLINE
        known = self._known.get(device.device_id)
        if known is not None:
            self._known[device.device_id] = replace(known, last_seen=time.time())
        self.emit(EventKind.DISCONNECTED, device.device_id, reason=reason)

    def _remember_tools(
        self, device: Device, server_info: Mapping[str, Any] | None, tools: ToolSet
    ) -> None:
        known = self._known[device.device_id]
        self._known[device.device_id] = replace(
            known, server_info=server_info, tools=tools, tools_read_at=time.time()
        )

    # ---- devices of other instances (backend.cluster reports them) ---------------------------

    def fleet(self) -> list[Device]:
        """Every connected device: here, then (in a cluster) on the other instances."""
        return [*self._live.values(), *self._remote.values()]

    def remote(self, device_id: str) -> RemoteDevice | None:
        """The device connected to another instance with this id, or None."""
        return self._remote.get(device_id)

    def remote_devices(self) -> list[RemoteDevice]:
        """Devices connected to other instances of the cluster (a snapshot)."""
        return list(self._remote.values())

    def remote_reported(self, report: RemoteReport, forward: Forward) -> None:
        """Another instance reported a device's state; the event goes out with its `origin`.

        An older claim (lower epoch) than the one known is ignored; a device live here stays
        here until this instance's lease check closes its link.
        """
        current = self._remote.get(report.device_id)
        if current is not None and report.epoch < current.epoch:
            return
        if report.kind is EventKind.DISCONNECTED:
            if current is not None and current.owner == report.owner:
                self._drop_remote(current, report.reason or "disconnected")
            return
        if current is None or current.owner != report.owner or current.epoch != report.epoch:
            current = RemoteDevice(report, self, forward)
            self._remote[report.device_id] = current
        current._state = report.state
        current._error = report.error
        if report.server_info is not None:
            current._server_info = _shared_info(report.server_info)
        if report.tools is not None:
            current._tools = report.tools
        self._remember_remote(current)
        detail: dict[str, Any] = {"transport": current.transport}
        if report.kind in (EventKind.READY, EventKind.TOOLS_CHANGED):
            detail = {"tool_count": len(current.tools)}
        elif report.kind is EventKind.FAILED:
            detail = {"error": report.error}
        self.emit_from(report.owner, report.kind, report.device_id, **detail)

    def remote_tools_read(self, device_id: str, epoch: int, tools: ToolSet) -> None:
        """A remote device's tool list, read after its report (a list too long to send): one
        `tools_changed` event; ignored if the device moved or reconnected meanwhile."""
        device = self._remote.get(device_id)
        if device is None or device.epoch != epoch or device.tools is tools:
            return
        device._tools = tools
        self._remember_remote(device)
        self.emit_from(device.owner, EventKind.TOOLS_CHANGED, device_id, tool_count=len(tools))

    def remote_owner_gone(self, owner: str, reason: str) -> int:
        """Every device of instance `owner` goes offline here (it left or died); how many."""
        gone = [device for device in self._remote.values() if device.owner == owner]
        for device in gone:
            self._drop_remote(device, reason)
        return len(gone)

    def _drop_remote(self, device: RemoteDevice, reason: str) -> None:
        if reason.endswith(RECONNECT_SUFFIX):  # its instance asked it to reconnect (close 1012)
            self._expect_back(device.device_id)
        del self._remote[device.device_id]
        device._state = DeviceState.OFFLINE
        known = self._known.get(device.device_id)
        if known is not None and device.device_id not in self._live:
            self._known[device.device_id] = replace(known, last_seen=time.time())
        self.emit_from(device.owner, EventKind.DISCONNECTED, device.device_id, reason=reason)

    def _remember_remote(self, device: RemoteDevice) -> None:
        now = time.time()
        known = self._known.get(device.device_id)
        if known is None:
            known = DeviceRecord(device.device_id, device.client_id, device.transport, now, now)
        known = replace(
            known, client_id=device.client_id, transport=device.transport, last_seen=now
        )
        if device.state is DeviceState.READY:
            known = replace(
                known, server_info=device.server_info, tools=device.tools, tools_read_at=now
            )
        self._known[device.device_id] = known

    # ---- events -----------------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener` on every event; returns a function that unsubscribes."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def refuse_call(
        self,
        device_id: str,
        tool: str,
        arguments: dict[str, Any] | None,
        *,
        actor: str | None,
        error: str,
        confirmed: bool = False,
    ) -> None:
        """Announce a call refused before it reached a device (an unknown or offline device, a
        key without permission; `error` names the error class) as one `tool_called` event, so
        the audit log keeps it too."""
        record_mcp_call("refused", 0.0)
        self.emit(
            EventKind.TOOL_CALLED,
            device_id[:_MAX_AUDITED_ID],
            tool=tool[:_MAX_AUDITED_ID],
            outcome="refused",
            duration_ms=0.0,
            actor=actor,
            arguments=arguments or {},
            confirmed=confirmed,
            error=error,
        )

    def emit(self, kind: EventKind, device_id: str, **detail: Any) -> None:
        """Deliver one event of this instance to every listener; a failing listener is logged
        and the others still run."""
        self.emit_from(None, kind, device_id, **detail)

    def emit_from(self, origin: str | None, kind: EventKind, device_id: str, **detail: Any) -> None:
        """Deliver one event that happened on instance `origin` (None: this one)."""
        event = DeviceEvent(kind, device_id, detail, origin)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception as exc:
                log.error("device event listener failed", event=kind.value, error=repr(exc))

    async def wait_for_state(
        self, device_id: str, state: DeviceState = DeviceState.READY, timeout_s: float = 10.0
    ) -> Device:
        """Wait until `device_id` is live and in `state` (for the demo and the tests)."""
        reached = asyncio.Event()

        def check(_event: DeviceEvent | None = None) -> None:
            device = self._live.get(device_id)
            if device is not None and device.state is state:
                reached.set()

        unsubscribe = self.subscribe(check)
        try:
            check()
            async with asyncio.timeout(timeout_s):
                await reached.wait()
        finally:
            unsubscribe()
        return self._live[device_id]
