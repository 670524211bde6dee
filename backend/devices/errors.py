"""Errors of the device layer; the MCP-level ones live in backend.mcp_session.errors."""

import difflib
from collections.abc import Collection

from backend.errors import BridgeError


class DeviceLayerError(BridgeError):
    """Base class of the device layer: the message is one line for an operator."""


class UnknownDevice(DeviceLayerError):
    """No device with this id has ever been seen (or it was forgotten)."""

    def __init__(self, device_id: str) -> None:
        super().__init__(f"unknown device {device_id!r}")
        self.device_id = device_id


class DeviceOffline(DeviceLayerError):
    """The device is known but not connected now, so it cannot be called."""

    def __init__(self, device_id: str, last_seen: str | None = None) -> None:
        since = f" (last seen {last_seen})" if last_seen else ""
        super().__init__(f"device {device_id!r} is offline{since}")
        self.device_id = device_id
        self.last_seen = last_seen


class DeviceOnline(DeviceLayerError):
    """The operation needs an offline device (forgetting one), and this one is connected."""

    def __init__(self, device_id: str) -> None:
        super().__init__(f"device {device_id!r} is connected; it can be forgotten once offline")
        self.device_id = device_id


class UnknownTool(DeviceLayerError):
    """The device exists but its current tool list has no such tool; the message suggests the
    closest of its `known` tool names (a typo is the usual cause)."""

    def __init__(self, device_id: str, tool: str, known: Collection[str] = ()) -> None:
        close = difflib.get_close_matches(tool, list(known), n=3) if len(tool) <= 200 else []
        hint = f"; did you mean {' or '.join(repr(name[:120]) for name in close)}?" if close else ""
        super().__init__(f"device {device_id!r} has no tool {tool!r}{hint}")
        self.device_id = device_id
        self.tool = tool
        self.suggestions = close


class DeviceNotReady(DeviceLayerError):
    """The device is connected but its MCP handshake has not finished (or failed)."""

    def __init__(self, device_id: str, state: str) -> None:
        super().__init__(f"device {device_id!r} is not ready (state: {state})")
        self.device_id = device_id
        self.state = state


class DeviceElsewhere(DeviceLayerError):
    """The device is connected to another bridge instance of the cluster: its tools are called
    through that instance, but what needs its link here (a conversation) cannot be."""

    def __init__(self, device_id: str, instance: str) -> None:
        super().__init__(
            f"device {device_id!r} is connected to bridge instance {instance!r}; "
            "its conversation is served there"
        )
        self.device_id = device_id
        self.instance = instance


class DeviceBusy(DeviceLayerError):
    """The device already has its limit of tool calls in flight; retry later."""

    def __init__(self, device_id: str, limit: int) -> None:
        super().__init__(f"device {device_id!r} already has {limit} calls in flight")
        self.device_id = device_id
        self.limit = limit


class InvalidArguments(DeviceLayerError):
    """The arguments do not match the tool's input schema; nothing was sent to the device."""

    def __init__(self, tool: str, reason: str) -> None:
        super().__init__(f"invalid arguments for {tool!r}: {reason}")
        self.tool = tool
        self.reason = reason


class ConfirmationRequired(DeviceLayerError):
    """A risky tool (reboot, upgrade, settings) called without an explicit confirmation."""

    def __init__(self, device_id: str, tool: str, reason: str) -> None:
        super().__init__(
            f"{tool!r} on {device_id!r} needs an explicit confirmation ({reason}): "
            'send "confirm": true (API) or --confirm (CLI)'
        )
        self.device_id = device_id
        self.tool = tool
        self.reason = reason
