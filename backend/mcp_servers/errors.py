"""The errors of the external MCP servers: calls that did not complete, and a name taken twice.
All are `BridgeError`s, which the API maps to statuses (backend/api/errors.py)."""

from typing import TYPE_CHECKING

from backend.errors import BridgeError

if TYPE_CHECKING:
    from backend.mcp_servers.servers import ServerState


class McpServerError(BridgeError):
    """A call on an external server did not complete (not ready, timeout, crash, protocol)."""


class ServerNotReady(McpServerError):
    """The server is not connected (or not done listing its tools)."""

    def __init__(self, name: str, state: "ServerState") -> None:
        super().__init__(f"MCP server {name!r} is {state.value}")
        self.name = name
        self.state = state


class ServerBusy(McpServerError):
    """The server already has its limit of calls in flight; retry later."""

    def __init__(self, name: str, limit: int) -> None:
        super().__init__(f"MCP server {name!r} has {limit} calls in flight already; try later")


class UnknownServerTool(McpServerError):
    """The server's tool list has no such tool."""

    def __init__(self, name: str, tool: str) -> None:
        super().__init__(f"MCP server {name!r} has no tool {tool[:80]!r}")


class CallTimedOut(McpServerError):
    """The tool gave no answer in time (the server itself may still be fine)."""

    def __init__(self, name: str, tool: str, timeout_s: float) -> None:
        super().__init__(f"MCP server {name!r}: {tool[:80]!r} gave no answer in {timeout_s:g} s")


class InvalidToolArguments(McpServerError):
    """The arguments break the tool's inputSchema (checked before anything is sent)."""

    def __init__(self, name: str, tool: str, reason: str) -> None:
        super().__init__(f"invalid arguments for {name}:{tool[:80]}: {reason}")
        self.reason = reason


class ServerConfirmationRequired(McpServerError):
    """A risky tool called without `confirmed=True`."""

    def __init__(self, name: str, tool: str, reason: str) -> None:
        super().__init__(f"{name}:{tool} needs a confirmation ({reason})")
        self.reason = reason


class DuplicateServer(BridgeError):
    """A server of that name is already registered with the hub."""

    def __init__(self, name: str) -> None:
        super().__init__(f"an MCP server named {name!r} is already registered")
        self.name = name
