"""The bridge's MCP client for devices: JSON-RPC only, transport-independent.

See docs/interfaces.md (`backend.mcp_session`) for the contract.
"""

from backend.mcp_session.client import PROTOCOL_VERSION, McpClient, SendFn
from backend.mcp_session.errors import (
    DeviceDisconnected,
    DeviceError,
    McpError,
    ProtocolViolation,
    RequestTimeout,
)
from backend.mcp_session.models import CallResult, InitializeResult, TimeoutPolicy, Tool
from backend.mcp_session.names import ToolNameMap, UnknownToolName, llm_functions

__all__ = [
    "PROTOCOL_VERSION",
    "CallResult",
    "DeviceDisconnected",
    "DeviceError",
    "InitializeResult",
    "McpClient",
    "McpError",
    "ProtocolViolation",
    "RequestTimeout",
    "SendFn",
    "TimeoutPolicy",
    "Tool",
    "ToolNameMap",
    "UnknownToolName",
    "llm_functions",
]
