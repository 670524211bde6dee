"""Errors raised by the MCP client. Every message is one line, safe to show to an operator."""

from typing import Any

from backend.errors import BridgeError


class McpError(BridgeError):
    """Base class for everything the MCP client raises about a device."""


class DeviceError(McpError):
    """The device answered with a JSON-RPC error.

    The stock firmware sends `{"message": ...}` without `code`, so `code` is often None, and some
    implementations use -32603 for every failure: callers must not infer meaning from the code.
    """

    def __init__(self, message: str, code: int | None = None, data: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.data = data


class RequestTimeout(McpError):
    """No reply within the time budget; the request was cancelled towards the device."""

    def __init__(self, method: str, timeout_s: float, tool: str | None = None) -> None:
        target = f"{method} {tool}" if tool else method
        super().__init__(f"{target} timed out after {timeout_s:g} s")
        self.method = method
        self.timeout_s = timeout_s
        self.tool = tool


class DeviceDisconnected(McpError):
    """The link to the device is gone (closed, replaced, or sending failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"device disconnected: {reason}")
        self.reason = reason


class ProtocolViolation(McpError):
    """The device's reply breaks the protocol (wrong types, endless pagination...)."""
