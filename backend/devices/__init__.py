"""Devices: the registry (one owner of device state), the catalogue that persists it, the
transport-agnostic session, and the conversation API the pipelines use."""

from backend.devices.conversation import Conversation, ConversationHub
from backend.devices.device import Device
from backend.devices.errors import (
    DeviceBusy,
    DeviceLayerError,
    DeviceNotReady,
    DeviceOffline,
    DeviceOnline,
    InvalidArguments,
    UnknownDevice,
    UnknownTool,
)
from backend.devices.registry import DeviceRegistry
from backend.devices.state import DeviceEvent, DeviceRecord, DeviceState, EventKind, ToolSet

__all__ = [
    "Conversation",
    "ConversationHub",
    "Device",
    "DeviceBusy",
    "DeviceEvent",
    "DeviceLayerError",
    "DeviceNotReady",
    "DeviceOffline",
    "DeviceOnline",
    "DeviceRecord",
    "DeviceRegistry",
    "DeviceState",
    "EventKind",
    "InvalidArguments",
    "ToolSet",
    "UnknownDevice",
    "UnknownTool",
]
