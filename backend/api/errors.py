"""Every deliberate error maps to one HTTP status and one `error.code`, in this one table.

The lookup walks the exception's class hierarchy (most specific class first), so the order of the
table does not matter and a new subclass inherits its parent's mapping until it gets its own.
"""

from backend.chat.memory import ConversationNotFound, InvalidConversationId
from backend.devices.errors import (
    ConfirmationRequired,
    DeviceBusy,
    DeviceNotReady,
    DeviceOffline,
    DeviceOnline,
    InvalidArguments,
    UnknownDevice,
    UnknownTool,
)
from backend.errors import BridgeError, MessageTooLarge
from backend.keys import InvalidKey, MissingScope, UnknownKey
from backend.mcp_session import (
    DeviceDisconnected,
    DeviceError,
    McpError,
    ProtocolViolation,
    RequestTimeout,
)
from backend.provisioning.errors import (
    AmbiguousActivation,
    InvalidInput,
    InvalidRelease,
    NotProvisioned,
    NotVerified,
    TooManyPending,
    UnknownActivation,
    UnknownEnrollment,
    UnknownRelease,
    UnknownSerialKey,
)
from backend.storage import DatabaseError

ERROR_TABLE: dict[type[BaseException], tuple[int, str]] = {
    InvalidKey: (401, "unauthorized"),
    MissingScope: (403, "forbidden"),
    UnknownDevice: (404, "unknown_device"),
    UnknownKey: (404, "unknown_key"),
    ConversationNotFound: (404, "unknown_conversation"),
    UnknownTool: (404, "unknown_tool"),
    DeviceNotReady: (409, "device_not_ready"),
    DeviceOnline: (409, "device_online"),
    InvalidArguments: (422, "invalid_arguments"),
    MessageTooLarge: (413, "message_too_large"),
    InvalidConversationId: (422, "invalid_request"),
    DeviceBusy: (429, "device_busy"),
    ConfirmationRequired: (428, "confirmation_required"),
    UnknownActivation: (404, "unknown_activation"),
    UnknownEnrollment: (404, "unknown_enrollment"),
    UnknownRelease: (404, "unknown_release"),
    UnknownSerialKey: (404, "unknown_serial_key"),
    NotProvisioned: (404, "not_provisioned"),
    AmbiguousActivation: (409, "ambiguous_activation"),
    NotVerified: (409, "not_verified"),
    InvalidInput: (422, "invalid_request"),
    InvalidRelease: (422, "invalid_release"),
    TooManyPending: (503, "too_many_pending"),
    DeviceError: (502, "device_error"),
    ProtocolViolation: (502, "device_protocol_error"),
    McpError: (502, "device_protocol_error"),
    DeviceOffline: (503, "device_offline"),
    DeviceDisconnected: (503, "device_disconnected"),
    DatabaseError: (503, "storage_unavailable"),
    RequestTimeout: (504, "timeout"),
    BridgeError: (500, "internal_error"),
}


def http_status(error: BaseException) -> tuple[int, str]:
    """(status, code) for an error: its most specific class in the table."""
    for cls in type(error).__mro__:
        mapped = ERROR_TABLE.get(cls)
        if mapped is not None:
            return mapped
    return 500, "internal_error"
