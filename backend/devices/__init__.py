"""Connected devices: the registry, their state, and the transport-agnostic device session."""

from backend.devices.errors import (
    DeviceBusy,
    DeviceNotReady,
    InvalidArguments,
    UnknownDevice,
    UnknownTool,
)
from backend.devices.registry import Device, DeviceEvent, DeviceRegistry, DeviceState, EventKind

__all__ = [
    "Device",
    "DeviceBusy",
    "DeviceEvent",
    "DeviceNotReady",
    "DeviceRegistry",
    "DeviceState",
    "EventKind",
    "InvalidArguments",
    "UnknownDevice",
    "UnknownTool",
]
