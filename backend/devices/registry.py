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
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from backend.common import iso_time
from backend.devices.confirm import ConfirmationPolicy
from backend.devices.conversation import Conversation
from backend.devices.device import Device, DeviceConnection, Forward, RemoteDevice, RemoteReport
from backend.devices.errors import (
    DeviceOffline,
    DeviceOnline,
    UnknownDevice,
)
from backend.devices.state import (
    UNSET,
    DeviceEvent,
    DeviceRecord,
    DeviceState,
    EventKind,
    ToolSet,
    Unset,
    shared_info,
)
from backend.logs import LineRate
from backend.mcp_session import Tool
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
_MAX_AUDITED_ID = 256  # a refused call may name any device id or tool: kept bounded


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
        server_info = shared_info(server_info)
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
            current._server_info = shared_info(report.server_info)
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
