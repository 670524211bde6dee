"""What instances say to each other over the broker, as JSON: fleet events (a device's state on
its owner), forwarded tool calls, their results and their errors. Pure functions, no I/O.

Errors cross the wire by class name and fields, and come back as the same classes a local call
raises, so a caller (the API's status codes, the chat, /mcp) cannot tell a forwarded call from a
local one. A class not in the table comes back as `DeviceError` with the original message.
"""

import json
from collections.abc import Callable
from typing import Any

from backend.devices.device import Device, RemoteReport
from backend.devices.errors import (
    ConfirmationRequired,
    DeviceBusy,
    DeviceElsewhere,
    DeviceNotReady,
    DeviceOffline,
    InvalidArguments,
    UnknownDevice,
    UnknownTool,
)
from backend.devices.state import DeviceState, EventKind, ToolSet
from backend.mcp_session import (
    CallResult,
    DeviceDisconnected,
    DeviceError,
    ProtocolViolation,
    RequestTimeout,
)
from backend.mcp_session.models import parse_tools

VERSION = 1
# What one message may hold: the broker's own limit is 64 KiB (BrokerLimits.max_message_bytes).
MAX_MESSAGE_BYTES = 48 * 1024
# A longer tool list stays out of the report; the others read it from the shared catalogue.
INLINE_TOOLS_BYTES = 16 * 1024
# The kinds of fleet events; the others (tool calls, OTA reports, voice turns) stay local.
FLEET_KINDS = frozenset(
    {
        EventKind.CONNECTED,
        EventKind.INITIALIZING,
        EventKind.READY,
        EventKind.FAILED,
        EventKind.TOOLS_CHANGED,
        EventKind.DISCONNECTED,
    }
)
_WITH_TOOLS = frozenset({EventKind.READY, EventKind.TOOLS_CHANGED})


class WireError(ValueError):
    """A message from another instance that does not have the expected shape."""


def dumps(message: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON."""
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()


def loads(payload: bytes) -> dict[str, Any]:
    """A JSON object, or WireError."""
    try:
        message = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise WireError("not a JSON object")
    return message


# ---- fleet events ---------------------------------------------------------------------------


def device_report(
    kind: EventKind, device: Device, owner: str, epoch: int, reason: str | None = None
) -> dict[str, Any]:
    """A local device's event as the fleet sees it (tools included when they changed)."""
    report: dict[str, Any] = {
        "v": VERSION,
        "kind": kind.value,
        "device_id": device.device_id,
        "owner": owner,
        "epoch": epoch,
        "state": device.state.value,
        "client_id": device.client_id,
        "transport": device.transport,
        "connected_at": device.connected_at,
    }
    if kind in _WITH_TOOLS or (kind is EventKind.CONNECTED and device.state is DeviceState.READY):
        report["server_info"] = dict(device.server_info) if device.server_info else None
        report["tools_digest"] = device.tools.digest
        tools = device.tools.to_wire()
        if len(dumps({"t": tools})) <= INLINE_TOOLS_BYTES:
            report["tools"] = tools
    if device.error is not None:
        report["error"] = device.error
    if reason is not None:
        report["reason"] = reason
    return report


def parse_report(message: dict[str, Any]) -> RemoteReport:
    """A fleet event back into the registry's `RemoteReport`; WireError when malformed."""
    try:
        kind = EventKind(message["kind"])
        state = DeviceState(message["state"])
        device_id = message["device_id"]
        owner = message["owner"]
        epoch = message["epoch"]
    except (KeyError, ValueError, TypeError) as exc:
        raise WireError(f"bad fleet event: {exc!r}") from None
    if kind not in FLEET_KINDS or not isinstance(device_id, str) or not isinstance(owner, str):
        raise WireError("bad fleet event: kind, device_id or owner")
    if type(epoch) is not int:
        raise WireError("bad fleet event: epoch")
    tools: ToolSet | None = None
    if "tools" in message:
        if not isinstance(message["tools"], list):
            raise WireError("bad fleet event: tools")
        tools = ToolSet.of(parse_tools(message["tools"]))
    digest = message.get("tools_digest")
    if tools is None and digest is not None and not isinstance(digest, str):
        raise WireError("bad fleet event: tools_digest")
    server_info = message.get("server_info")
    connected_at = message.get("connected_at")
    return RemoteReport(
        kind=kind,
        device_id=device_id,
        owner=owner,
        epoch=epoch,
        client_id=_str_or_none(message.get("client_id")),
        transport=str(message.get("transport") or "websocket"),
        state=state,
        connected_at=float(connected_at) if isinstance(connected_at, int | float) else None,
        server_info=server_info if isinstance(server_info, dict) else None,
        tools=tools,
        tools_digest=digest if tools is None and isinstance(digest, str) else None,
        error=_str_or_none(message.get("error")),
        reason=_str_or_none(message.get("reason")),
    )


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def pack(reports: list[dict[str, Any]]) -> list[bytes]:
    """Reports as few `{"reports": [...]}` messages as fit the broker's message size."""
    messages: list[bytes] = []
    chunk: list[bytes] = []
    size = 0
    for report in reports:
        encoded = dumps(report)
        if chunk and size + len(encoded) + 1 > MAX_MESSAGE_BYTES:
            messages.append(_joined(chunk))
            chunk, size = [], 0
        chunk.append(encoded)
        size += len(encoded) + 1
    if chunk:
        messages.append(_joined(chunk))
    return messages


def _joined(chunk: list[bytes]) -> bytes:
    return b'{"reports":[' + b",".join(chunk) + b"]}"


# ---- forwarded calls --------------------------------------------------------------------------


def call_request(
    device_id: str,
    tool: str,
    arguments: dict[str, Any],
    timeout_s: float | None,
    actor: str | None,
) -> dict[str, Any]:
    """A forwarded tools/call (already validated and confirmed by the caller's instance)."""
    return {
        "v": VERSION,
        "op": "call",
        "device_id": device_id,
        "tool": tool,
        "arguments": arguments,
        "timeout_s": timeout_s,
        "actor": actor,
    }


def result_reply(result: CallResult) -> dict[str, Any]:
    """A call's result as the device gave it."""
    return {"v": VERSION, "result": result.raw or _raw(result)}


def _raw(result: CallResult) -> dict[str, Any]:
    raw: dict[str, Any] = {"content": result.content, "isError": result.is_error}
    if result.structured_content is not None:
        raw["structuredContent"] = result.structured_content
    return raw


def error_reply(error: BaseException) -> dict[str, Any]:
    """An error as class name, message and the fields its class needs to be rebuilt."""
    fields = {name: getattr(error, name) for name in _FIELDS.get(type(error).__name__, ())}
    return {
        "v": VERSION,
        "error": {"type": type(error).__name__, "message": str(error), "fields": fields},
    }


def parse_reply(message: dict[str, Any]) -> CallResult:
    """The forwarded call's result; raises the error the owner's call raised."""
    if "result" in message:
        return CallResult.from_wire(message["result"])
    error = message.get("error")
    if not isinstance(error, dict):
        raise ProtocolViolation("forwarded call: reply has neither result nor error")
    raise rebuild_error(error)


def rebuild_error(error: dict[str, Any]) -> Exception:
    """The exception an error reply describes (DeviceError for an unknown class)."""
    name = error.get("type")
    message = str(error.get("message") or "error on the owning instance")
    fields = error.get("fields")
    build = _BUILDERS.get(name) if isinstance(name, str) else None
    if build is not None and isinstance(fields, dict):
        try:
            return build(fields, message)
        except (KeyError, TypeError, ValueError):
            pass
    return DeviceError(message)


_FIELDS: dict[str, tuple[str, ...]] = {
    "UnknownDevice": ("device_id",),
    "DeviceOffline": ("device_id", "last_seen"),
    "DeviceNotReady": ("device_id", "state"),
    "DeviceElsewhere": ("device_id", "instance"),
    "UnknownTool": ("device_id", "tool", "suggestions"),
    "DeviceBusy": ("device_id", "limit"),
    "InvalidArguments": ("tool", "reason"),
    "ConfirmationRequired": ("device_id", "tool", "reason"),
    "RequestTimeout": ("method", "timeout_s", "tool"),
    "DeviceDisconnected": ("reason",),
    "DeviceError": ("message", "code", "data"),
}

_Builder = Callable[[dict[str, Any], str], Exception]
_BUILDERS: dict[str, _Builder] = {
    "UnknownDevice": lambda f, _: UnknownDevice(f["device_id"]),
    "DeviceOffline": lambda f, _: DeviceOffline(f["device_id"], f.get("last_seen")),
    "DeviceNotReady": lambda f, _: DeviceNotReady(f["device_id"], f["state"]),
    "DeviceElsewhere": lambda f, _: DeviceElsewhere(f["device_id"], f["instance"]),
    "UnknownTool": lambda f, _: UnknownTool(f["device_id"], f["tool"], f.get("suggestions") or ()),
    "DeviceBusy": lambda f, _: DeviceBusy(f["device_id"], int(f["limit"])),
    "InvalidArguments": lambda f, _: InvalidArguments(f["tool"], f["reason"]),
    "ConfirmationRequired": lambda f, _: ConfirmationRequired(
        f["device_id"], f["tool"], f["reason"]
    ),
    "RequestTimeout": lambda f, _: RequestTimeout(
        f["method"], float(f["timeout_s"]), f.get("tool")
    ),
    "DeviceDisconnected": lambda f, _: DeviceDisconnected(f["reason"]),
    "DeviceError": lambda f, _: DeviceError(str(f["message"]), f.get("code"), f.get("data")),
    "ProtocolViolation": lambda _, message: ProtocolViolation(message),
}
