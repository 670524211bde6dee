"""The hub of external MCP servers: one owner of every server the chat may use beside devices.

Two kinds of server live here, behind one interface (`ExternalServer`):

- **configured** servers (`[[mcp_servers]]` in the bridge's TOML, backend/mcp_servers/settings.py):
  `stdio` (a child process) or `http` (Streamable HTTP). The hub connects each once, with the
  official `mcp` SDK, for every conversation to share, and keeps it connected: exponential
  backoff after a failure, a re-list on `notifications/tools/list_changed`
  (backend/mcp_servers/connectors.py);
- **dial-in** servers: a user's MCP server that connected *to* the bridge over a WebSocket
  (xiaozhi "MCP endpoint" style). The endpoint owns that connection and its `ClientSession`; it
  registers the session here for as long as it lives.

Registering a dial-in session (the endpoint's side)::

    server = SessionServer(
        name,                       # [a-z0-9_-]{1,32} (check_server_name); unique in the hub
        kind="dialin",
        bound_device_ids=frozenset({"aa:bb:cc:dd:ee:ff"}),  # or None: every device's turns
        risky=RiskyRule.from_setting(None),  # None: tools marked destructiveHint need a "yes"
        timeout_s=30.0,
        max_result_bytes=65536,
        tool_bounds=ToolBounds(),   # what of its tools/list is kept (DEFAULT_TOOL_BOUNDS)
    )
    session = ClientSession(read, write, message_handler=server.message_handler)
    async with session:
        await session.initialize()
        await server.attach(session)   # lists the tools (all pages): state READY
        hub.add(server)                # DuplicateServer if the name is taken
        try:
            ...                        # until the WebSocket closes
        finally:
            hub.remove(name, server)   # only removes this very server (not a newer one)
            server.detach("disconnected")

`server.message_handler` follows `notifications/tools/list_changed` by re-listing; pass it as
the session's `message_handler` (or call `server.tools_changed()` yourself).

The bridge owns one hub (backend/server.py) and hands it to the chat front ends and the
dial-in endpoint.

Who sees which server: a chat turn asks `hub.toolbox_for(principal, device_id, device_box)`.
A server is offered when it is READY, bound to that device or to every device
(`bound_device_ids is None`; a turn without a device gets only unbound servers), and the caller
may use it: an API key needs the scope `mcp:<name>` (or `admin`); a device's own voice/text
turn (`principal=None`) gets every server bound to it or to all. A dialed-in server (kind
`dialin`) is also covered by the scope `mcp:dialin` (every dialed-in server).

`/mcp` (backend/api/mcp_endpoint.py) offers the dialed-in servers' tools to MCP hosts too, named
and called as here (`toolbox.external_tool_names`, `toolbox.audited_call`); it follows
`hub.subscribe` to tell its sessions when they change.
"""

import asyncio
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import structlog

from backend.mcp_servers.connectors import ConfiguredServer
from backend.mcp_servers.errors import (
    CallTimedOut,
    DuplicateServer,
    InvalidToolArguments,
    McpServerError,
    ServerBusy,
    ServerConfirmationRequired,
    ServerNotReady,
    UnknownServerTool,
)
from backend.mcp_servers.servers import (
    DIALIN_PREFIX,
    CallSession,
    ExternalServer,
    RiskyRule,
    ServerKind,
    ServerState,
    SessionServer,
    ToolListing,
    bounded_result,
    describe_error,
    json_depth,
    list_all_tools,
    list_tools_bounded,
    release_memory,
    tool_problem,
)
from backend.mcp_servers.settings import (
    DEFAULT_MAX_PENDING_CALLS,
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TOOL_BOUNDS,
    RESERVED_NAMES,
    SERVER_NAME,
    TOOL_NAME,
    McpServerSettings,
    ToolBounds,
    check_server_name,
)
from backend.mcp_servers.toolbox import CombinedToolBox

if TYPE_CHECKING:
    from backend.chat.tools import ToolBox
    from backend.keys import Principal

__all__ = [
    "DEFAULT_MAX_PENDING_CALLS",
    "DEFAULT_MAX_RESULT_BYTES",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_TOOL_BOUNDS",
    "DIALIN_PREFIX",
    "RESERVED_NAMES",
    "SERVER_NAME",
    "TOOL_NAME",
    "CallSession",
    "CallTimedOut",
    "DuplicateServer",
    "ExternalServer",
    "InvalidToolArguments",
    "McpServerError",
    "McpServerHub",
    "RiskyRule",
    "ServerBusy",
    "ServerConfirmationRequired",
    "ServerKind",
    "ServerNotReady",
    "ServerState",
    "SessionServer",
    "ToolBounds",
    "ToolListing",
    "UnknownServerTool",
    "bounded_result",
    "check_server_name",
    "describe_error",
    "json_depth",
    "list_all_tools",
    "list_tools_bounded",
    "release_memory",
    "tool_problem",
]

log = structlog.get_logger("mcp_servers")


class McpServerHub:
    """Every external server by name; started and stopped with the bridge (backend/server.py)."""

    def __init__(self, *, audit: Callable[..., None] | None = None) -> None:
        self._servers: dict[str, ExternalServer] = {}
        # Called once per external tool call, like `DeviceRegistry.emit(TOOL_CALLED, ...)`:
        # audit("mcp:<server>", tool=..., outcome=..., duration_ms=..., actor=..., ...).
        self.audit = audit
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener()` whenever a server is added or removed, or a registered one changes
        its state or tools (`/mcp` sends `tools/list_changed` then); returns the unsubscribe."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def _changed(self) -> None:
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:  # one listener's bug must not stop the others, nor the caller
                log.warning("mcp hub listener failed", exc_info=True)

    def add(self, server: ExternalServer) -> None:
        """Register a server (DuplicateServer when the name is taken)."""
        if server.name in self._servers:
            raise DuplicateServer(server.name)
        self._servers[server.name] = server
        server.on_change = self._changed
        log.info("mcp server added", server=server.name, kind=server.kind)
        self._changed()

    def remove(self, name: str, server: ExternalServer | None = None) -> ExternalServer | None:
        """Unregister `name` (only if it is still `server`, when given); returns what was removed.
        The caller stops or detaches it; turns holding a toolbox see it leave."""
        current = self._servers.get(name)
        if current is None or (server is not None and current is not server):
            return None
        del self._servers[name]
        current.on_change = None
        log.info("mcp server removed", server=name, kind=current.kind)
        self._changed()
        return current

    def get(self, name: str) -> ExternalServer | None:
        """The server of this name, if registered."""
        return self._servers.get(name)

    def servers(self) -> list[ExternalServer]:
        """Every registered server, by name."""
        return [self._servers[name] for name in sorted(self._servers)]

    def __iter__(self) -> Iterator[ExternalServer]:
        return iter(self.servers())

    def __len__(self) -> int:
        return len(self._servers)

    def usable(self, principal: "Principal | None", device_id: str | None) -> list[ExternalServer]:
        """The servers a turn of `principal` (None: the device itself) about `device_id` may use,
        ready or not (the toolbox skips those not ready at the moment it lists)."""
        found = []
        for server in self.servers():
            if not server.serves_device(device_id):
                continue
            if principal is not None and not principal.may_use_server(
                server.name, dialin=server.kind == "dialin"
            ):
                continue
            found.append(server)
        return found

    def toolbox_for(
        self,
        principal: "Principal | None",
        device_id: str | None,
        device_box: "ToolBox | None" = None,
    ) -> "ToolBox | None":
        """The chat `ToolBox` of a turn: `device_box` (a DeviceToolBox, or None) plus the tools of
        every server `principal` (a `backend.keys.Principal`; None for a device's own turn) may
        use for `device_id` (backend/mcp_servers/toolbox.py). When no server is usable at all,
        `device_box` itself (None for none)."""
        if not self.usable(principal, device_id):
            return device_box
        actor = _actor(principal, device_id)
        return CombinedToolBox(
            device_box,
            lambda: self.usable(principal, device_id),
            actor=actor,
            audit=self.audit,
        )

    async def start(self) -> None:
        """Start every configured server (each connects on its own task)."""
        for server in self.servers():
            await server.start()

    async def stop(self) -> None:
        """Stop every server at once; one failing to stop does not hold up the others."""
        servers = list(self._servers.values())
        await asyncio.gather(*(server.stop() for server in servers), return_exceptions=True)

    def listing(self) -> list[dict[str, Any]]:
        """Every server's summary, for the API."""
        return [server.summary() for server in self.servers()]

    @classmethod
    def from_settings(
        cls, servers: Iterable[McpServerSettings], *, audit: Callable[..., None] | None = None
    ) -> "McpServerHub":
        """A hub holding one `ConfiguredServer` per `[[mcp_servers]]` entry (not started)."""
        hub = cls(audit=audit)
        for settings in servers:
            hub.add(ConfiguredServer(settings))
        return hub


def _actor(principal: "Principal | None", device_id: str | None) -> str:
    if principal is None:
        return f"device:{device_id}"
    return "chat:admin" if principal.key_id == "admin" else f"chat:key:{principal.key_id}"
