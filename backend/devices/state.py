"""The registry's vocabulary: a device's state, the events that change it, the tool sets devices
declare (one shared object per distinct list) and what the bridge remembers of a device
(`DeviceRecord`). Values only: `backend.devices.registry` owns and changes them."""

import hashlib
import json
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from types import MappingProxyType
from typing import Any

from backend.common import iso_time
from backend.mcp_session import Tool


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


def shared_info(info: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
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
