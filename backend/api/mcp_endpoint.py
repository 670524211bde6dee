"""`/mcp`: the bridge as an MCP server over Streamable HTTP, on the API's port (official `mcp` SDK).

Any MCP host (MCP Inspector, an agent) sees, according to its key's scopes:

- **resources** (`chat:use`): every chat conversation as `memory://conversation/{id}` (JSON:
  title, summary, messages), listed newest first and paged; a resource template for the same;
- **tools** (`chat:use`): `duckduckgo_search` and `knowledge_base_search`;
- **tools** (`devices:read` to list, `devices:call` to call, both limited to a key's devices):
  the model-visible tools of every ready device as `device.<device id>.<tool>`. The device id is
  made MCP-name-safe (every character but letters, digits, `_` and `-` becomes `-`, so
  `a4:cf:12:34:56:78` is `a4-cf-12-34-56-78`; ids that collide that way get a `-<6 hex>` suffix
  from a hash of the real id); the tool keeps its name when it is safe (stock names are), else
  its LLM-safe name. Each tool's `_meta` holds the real `device_id` and `tool`. User-only
  tools (`audience: ["user"]`, e.g. reboot) stay with the admin API;
- **tools** (`mcp:dialin`, every dialed-in server, or `mcp:dialin-<key id>`, that one): the tools
  of the MCP servers dialed in through the MCP endpoint (backend/mcp_dialin) while they are
  connected, named as chat turns name them, `dialin-<key id>__<tool>` (LLM-safe,
  backend/mcp_servers/toolbox.py: never a device's `device.…` name); `_meta` holds the real
  `server` and `tool`. A device-limited key sees only servers bound to one of its devices. A call
  goes through the hub like a chat turn's (`audited_call`): arguments checked against the
  inputSchema, the server's timeout and result cap, one audit row (`mcp:<server>`, actor
  `mcp:key:<id>`). A risky tool (`destructiveHint`) is not run, as a risky device tool is not
  here: the result says it needs a confirmation (given in a chat turn).

The bearer key is checked by the API's gate before any body is read; a session is bound to the
key that opened it (the SDK answers another key's requests for it with 404). A call without the
scope is a JSON-RPC error -32001 with `data.required_scope` (the chat integration design).
Device failures are tool results with `isError: true` (the caller's model should see them); an
unknown tool or resource is -32602. Sessions that listed tools get
`notifications/tools/list_changed` when a device becomes ready, changes its tools or goes away,
and when a dialed-in server comes, goes or changes its tools (handshake-era sessions with a GET
stream open).
"""

import asyncio
import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import anyio
import structlog
from mcp import types
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.session import ServerSession
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from pydantic import TypeAdapter, ValidationError
from starlette.requests import HTTPConnection
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from backend import __version__
from backend.api.chat import conversation_json
from backend.api.scopes import principal_of
from backend.chat import ChatService, ConversationNotFound, SearchFailed, format_results
from backend.chat.language import detect_language
from backend.common import Lru
from backend.devices import Device, DeviceRegistry, DeviceState
from backend.devices.state import DeviceEvent, EventKind, is_user_only
from backend.errors import BridgeError
from backend.keys import Principal
from backend.keys import Scope as KeyScope
from backend.mcp_servers.hub import (
    DIALIN_PREFIX,
    ExternalServer,
    McpServerError,
    McpServerHub,
    ServerConfirmationRequired,
    ServerState,
)
from backend.mcp_servers.toolbox import audited_call, external_tool_names
from backend.mcp_session import McpError, Tool, ToolNameMap

log = structlog.get_logger("mcp")

MCP_PATH = "/mcp"
FORBIDDEN = -32001  # chat integration design: "Authorization error (custom)"
RESOURCE_PREFIX = "memory://conversation/"
RESOURCE_PAGE = 100
MAX_SESSIONS = 1000
SESSION_IDLE_S = 30 * 60.0
WEB_SEARCH = "duckduckgo_search"
KB_SEARCH = "knowledge_base_search"
META_DEVICE = "esp32-mcp-bridge/device_id"
META_TOOL = "esp32-mcp-bridge/tool"
META_SERVER = "esp32-mcp-bridge/server"
_DESCRIPTION_LIMIT = 1024
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_SAFE_TOOL = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_LIST_CHANGING = frozenset({EventKind.READY, EventKind.TOOLS_CHANGED, EventKind.DISCONNECTED})
_CONTENT = TypeAdapter[types.ContentBlock](types.ContentBlock)

INSTRUCTIONS = (
    "esp32-mcp-bridge: the dental assistant's conversation memory (resources "
    "memory://conversation/{id}), its searches (duckduckgo_search, knowledge_base_search) and "
    "the tools of connected ESP32 voice devices, named device.<device id>.<tool>, and of MCP "
    "servers dialed in to the bridge, named dialin-<key id>__<tool>."
)

_QUERY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "description": "what to search for", "minLength": 1},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 10, "default": 5},
    },
    "required": ["query"],
}
_KB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_QUERY_SCHEMA["properties"],
        "language": {
            "type": "string",
            "enum": ["vi", "en"],
            "description": "entries in this language (default: the query's)",
        },
    },
    "required": ["query"],
}
SEARCH_TOOLS = [
    types.Tool(
        name=WEB_SEARCH,
        # The seed's name; it searches with the configured providers (search_providers).
        description=(
            "Search the web (the bridge's search providers in their configured order, "
            "DuckDuckGo by default); title, content and link per result."
        ),
        input_schema=_QUERY_SCHEMA,
        annotations=types.ToolAnnotations(read_only_hint=True, open_world_hint=True),
    ),
    types.Tool(
        name=KB_SEARCH,
        description=(
            "Search the bundled dental knowledge base (Vietnamese and English entries from "
            "NHS, ADA, WHO, CDC, ...); title, content and link per entry."
        ),
        input_schema=_KB_SCHEMA,
        annotations=types.ToolAnnotations(read_only_hint=True, open_world_hint=False),
    ),
]


@dataclass(frozen=True, slots=True)
class DeviceTool:
    """One device tool as `/mcp` names it."""

    mcp_name: str
    device: Device
    tool: str


@dataclass(frozen=True, slots=True)
class DialInTool:
    """One tool of a dialed-in server as `/mcp` names it (as chat turns do)."""

    mcp_name: str
    server: ExternalServer
    tool: Tool


def safe_device_ids(device_ids: list[str]) -> dict[str, str]:
    """MCP-name-safe ids for these devices: unsafe characters → `-`; a `-<6 hex>` suffix from
    the real id's SHA-256 for ids that collide that way."""
    base = {device_id: _UNSAFE.sub("-", device_id) for device_id in device_ids}
    counts: dict[str, int] = {}
    for safe in base.values():
        counts[safe] = counts.get(safe, 0) + 1
    return {
        device_id: (
            safe
            if counts[safe] == 1
            else f"{safe}-{hashlib.sha256(device_id.encode()).hexdigest()[:6]}"
        )
        for device_id, safe in base.items()
    }


def forbidden(message: str, scope: KeyScope, principal: Principal) -> MCPError:
    """The MCP error for a key that lacks `scope`, naming the scope needed and the key's scopes."""
    data = {"required_scope": str(scope), "key_scopes": sorted(principal.scopes)}
    return MCPError(FORBIDDEN, message, data)


class _BridgeServer(Server[dict[str, Any]]):
    """The low-level server, announcing `tools.listChanged` (the SDK's default says false)."""

    def create_initialization_options(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True),
            experimental_capabilities,
            extensions,
        )


Context = ServerRequestContext[dict[str, Any], Any]


class McpEndpoint:
    """The MCP server and its Streamable HTTP session manager; `start()`/`stop()` with the
    bridge, `route` goes into the API app."""

    def __init__(
        self,
        registry: DeviceRegistry,
        chat: ChatService,
        *,
        host: str,
        servers: McpServerHub | None = None,
    ) -> None:
        self.registry = registry
        self.chat = chat
        self.servers = servers  # the dialed-in servers' tools come from this hub
        self.server = _BridgeServer(
            "esp32-mcp-bridge",
            version=__version__,
            instructions=INSTRUCTIONS,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_list_resources=self._list_resources,
            on_list_resource_templates=self._list_templates,
            on_read_resource=self._read_resource,
        )
        self.manager = StreamableHTTPSessionManager(
            app=self.server,
            security_settings=_security(host),
            session_idle_timeout=SESSION_IDLE_S,
            max_sessions=MAX_SESSIONS,
        )
        # An ASGI app (not a function) as the endpoint: Starlette passes every method through.
        self.route = Route(MCP_PATH, endpoint=_Asgi(self))
        # Sessions that asked for tools, for list_changed notices (oldest first, bounded).
        self._sessions: Lru[str, ServerSession] = Lru(MAX_SESSIONS)
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._notifier: asyncio.Task[None] | None = None
        self._changed = False
        self._unsubscribe = registry.subscribe(self._on_device_event)
        self._unsubscribe_servers = (
            servers.subscribe(self._tools_changed) if servers is not None else None
        )

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Run the session manager (an anyio task group) in a task of its own."""
        ready = asyncio.Event()

        async def run() -> None:
            async with self.manager.run():
                ready.set()
                await self._stop.wait()

        self._task = asyncio.create_task(run(), name="mcp-sessions")
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({self._task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self._task.done():
            await self._task  # surfaces the startup error

    async def stop(self) -> None:
        """End every MCP session (their GET streams close, so the HTTP server can drain)."""
        self._unsubscribe()
        if self._unsubscribe_servers is not None:
            self._unsubscribe_servers()
        self._stop.set()
        if self._notifier is not None:
            self._notifier.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._notifier
        if self._task is not None:
            await self._task
        self._sessions.clear()

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one `/mcp` request, its session bound to the caller's key."""
        principal = principal_of(HTTPConnection(scope))
        # Bind each session to the key that opened it (the SDK compares this identity).
        token = AccessToken(token="", client_id=principal.key_id, scopes=sorted(principal.scopes))
        scope["user"] = AuthenticatedUser(token)
        await self.manager.handle_request(scope, receive, send)

    # ---- tools -------------------------------------------------------------------------------

    async def _list_tools(
        self, ctx: Context, _params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        principal = self._principal(ctx)
        self._remember(ctx)
        tools = list(SEARCH_TOOLS) if principal.has(KeyScope.CHAT_USE) else []
        for entry in self._device_tools(principal):
            source = entry.device.tools.by_name[entry.tool]
            description = f"[device {entry.device.device_id}] {source.description}".strip()
            tools.append(
                types.Tool(
                    name=entry.mcp_name,
                    title=source.title,
                    description=description,
                    input_schema=source.input_schema or {"type": "object"},
                    _meta={META_DEVICE: entry.device.device_id, META_TOOL: entry.tool},
                )
            )
        for dialin in self._dialin_tools(principal).values():
            source = dialin.tool
            description = f"[MCP server {dialin.server.name}] {source.description}".strip()
            tools.append(
                types.Tool(
                    name=dialin.mcp_name,
                    title=source.title,
                    description=description[:_DESCRIPTION_LIMIT],
                    input_schema=source.input_schema or {"type": "object"},
                    annotations=_annotations(source),
                    _meta={META_SERVER: dialin.server.name, META_TOOL: source.name},
                )
            )
        return types.ListToolsResult(tools=tools)

    async def _call_tool(
        self, ctx: Context, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        principal = self._principal(ctx)
        arguments = params.arguments or {}
        if params.name in (WEB_SEARCH, KB_SEARCH):
            if not principal.has(KeyScope.CHAT_USE):
                raise forbidden(
                    f"this key lacks the scope {KeyScope.CHAT_USE}", KeyScope.CHAT_USE, principal
                )
            return await self._search(params.name, arguments)
        if params.name.startswith(DIALIN_PREFIX):
            return await self._call_dialin(principal, params.name, arguments)
        entry = next(
            (t for t in self._device_tools(None, named=params.name) if t.mcp_name == params.name),
            None,
        )
        if entry is None or not principal.may_read(entry.device.device_id):
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {params.name[:200]}")
        device_id = entry.device.device_id
        reason = principal.call_denied_reason(device_id)
        if reason is not None:
            self.registry.refuse_call(
                device_id,
                entry.tool,
                arguments,
                actor=f"mcp:key:{principal.key_id}",
                error="MissingScope",
            )
            raise forbidden(
                f"not allowed to call tools of {device_id!r}: {reason}",
                KeyScope.DEVICES_CALL,
                principal,
            )
        log.info("mcp tool call", device_id=device_id, tool=entry.tool, key_id=principal.key_id)
        try:
            result = await entry.device.call_tool(
                entry.tool, arguments, actor=f"mcp:key:{principal.key_id}"
            )
        except (BridgeError, McpError) as exc:
            return _error_result(str(exc))
        return types.CallToolResult(
            content=[_content(item) for item in result.content],
            structured_content=result.structured_content,
            is_error=result.is_error,
        )

    async def _call_dialin(
        self, principal: Principal, name: str, arguments: dict[str, Any]
    ) -> types.CallToolResult:
        """Call a dialed-in server's tool: the key's scope first (for any `dialin-` name, so a
        key without it learns nothing of which servers are there), then the hub's call."""
        server_name = name.partition("__")[0]
        # Only that server's tools are named: a name never depends on other servers' tools
        # (each begins with its own server's name), so this is the name `tools/list` gave.
        entry = self._dialin_tools(None, only=server_name).get(name)
        actor = f"mcp:key:{principal.key_id}"
        if not principal.may_use_server(server_name, dialin=True):
            if entry is not None and self.servers is not None and self.servers.audit is not None:
                self.servers.audit(
                    f"mcp:{entry.server.name}",
                    tool=entry.tool.name,
                    outcome="refused",
                    duration_ms=0.0,
                    actor=actor,
                    arguments=arguments,
                    confirmed=False,
                    error="MissingScope",
                )
            raise forbidden(
                f"this key lacks the scope {KeyScope.MCP_DIALIN} (or mcp:{server_name[:40]}) "
                "for the tools of dialed-in MCP servers",
                KeyScope.MCP_DIALIN,
                principal,
            )
        if entry is None or not _covers(principal, entry.server):
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {name[:200]}")
        server, tool = entry.server, entry.tool.name
        log.info("mcp dial-in tool call", server=server.name, tool=tool, key_id=principal.key_id)
        try:
            audit = self.servers.audit if self.servers is not None else None
            result = await audited_call(server, tool, arguments, actor=actor, audit=audit)
        except ServerConfirmationRequired as exc:
            return _error_result(
                f"not run: {server.name}:{tool} needs a confirmation ({exc.reason}); risky tools "
                "of dialed-in servers run only in a chat turn where the user says yes"
            )
        except McpServerError as exc:
            return _error_result(str(exc))
        return types.CallToolResult(
            content=[_content(item) for item in result.content], is_error=result.is_error
        )

    def _dialin_tools(
        self, principal: Principal | None, *, only: str | None = None
    ) -> dict[str, DialInTool]:
        """The tools of the ready dialed-in servers (that `principal` may use, when given;
        only the server named `only`, when given), by their `/mcp` name."""
        if self.servers is None:
            return {}
        if only is None:
            candidates = self.servers.servers()
        else:
            found = self.servers.get(only)
            candidates = [found] if found is not None else []
        servers = [
            server
            for server in candidates
            if server.kind == "dialin"
            and server.state is ServerState.READY
            and (
                principal is None
                or (
                    principal.may_use_server(server.name, dialin=True)
                    and _covers(principal, server)
                )
            )
        ]
        named = external_tool_names(servers, (WEB_SEARCH, KB_SEARCH))
        return {name: DialInTool(name, server, tool) for name, (server, tool) in named.items()}

    async def _search(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        query = arguments.get("query")
        count = arguments.get("max_results", 5)
        if not isinstance(query, str) or not query.strip():
            return _error_result("invalid arguments: `query` must be a non-empty string")
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 10:
            return _error_result("invalid arguments: `max_results` is an integer from 1 to 10")
        if name == KB_SEARCH:
            language = arguments.get("language")
            if language not in ("vi", "en"):
                language = detect_language(query)
            results = self.chat.knowledge.search(query, count, language=language)
        else:
            if self.chat.web is None:
                return _error_result("web search is disabled on this bridge (search_enabled)")
            try:
                results = await self.chat.web.search(query, count)
            except SearchFailed as exc:
                return _error_result(str(exc))
        text = format_results(results) if results else "no results"
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)])

    def _device_tools(
        self, principal: Principal | None, *, named: str | None = None
    ) -> Iterator[DeviceTool]:
        """The tools of ready devices (that `principal` may read, when given), named for MCP;
        with `named`, only the devices that name could belong to (no full scan per call)."""
        devices = sorted(
            (d for d in self.registry.fleet() if d.state is DeviceState.READY),
            key=lambda d: d.device_id,
        )
        if named is not None:
            safe_part = named.removeprefix("device.").partition(".")[0]
            wanted = {safe_part, safe_part[:-7]}  # without a `-<6 hex>` collision suffix
            devices = [d for d in devices if _UNSAFE.sub("-", d.device_id) in wanted]
        safe = safe_device_ids([d.device_id for d in devices])
        for device in devices:
            if principal is not None and not principal.may_read(device.device_id):
                continue
            tools = [t for t in device.tool_list(include_user_only=False) if not is_user_only(t)]
            names = ToolNameMap(t.name for t in tools)
            seen: set[str] = set()
            for tool in tools:
                part = tool.name if _SAFE_TOOL.match(tool.name) else names.to_llm(tool.name)
                mcp_name = f"device.{safe[device.device_id]}.{part}"
                if len(mcp_name) > 128 or mcp_name in seen:
                    continue
                seen.add(mcp_name)
                yield DeviceTool(mcp_name, device, tool.name)

    # ---- resources ---------------------------------------------------------------------------

    async def _list_resources(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        principal = self._principal(ctx)
        self._remember(ctx)
        if not principal.has(KeyScope.CHAT_USE):
            return types.ListResourcesResult(resources=[])
        offset = _offset(params.cursor if params is not None else None)
        page = await self.chat.memory.list_conversations(limit=RESOURCE_PAGE, offset=offset)
        resources = [
            types.Resource(
                uri=RESOURCE_PREFIX + quote(item.id, safe=""),
                name=f"conversation {item.id}",
                title=item.title or None,
                description=(
                    f"{item.message_count} messages"
                    + (f", device {item.device_id}" if item.device_id else "")
                    + f", updated {item.updated_at.isoformat()}"
                ),
                mime_type="application/json",
            )
            for item in page.items
        ]
        end = offset + len(page.items)
        return types.ListResourcesResult(
            resources=resources, next_cursor=str(end) if end < page.total else None
        )

    async def _list_templates(
        self, ctx: Context, _params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        principal = self._principal(ctx)
        templates = []
        if principal.has(KeyScope.CHAT_USE):
            templates.append(
                types.ResourceTemplate(
                    uri_template=RESOURCE_PREFIX + "{conversation_id}",
                    name="conversation",
                    description="a chat conversation: title, summary and every message",
                    mime_type="application/json",
                )
            )
        return types.ListResourceTemplatesResult(resource_templates=templates)

    async def _read_resource(
        self, ctx: Context, params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        principal = self._principal(ctx)
        if not principal.has(KeyScope.CHAT_USE):
            raise forbidden(
                f"this key lacks the scope {KeyScope.CHAT_USE}", KeyScope.CHAT_USE, principal
            )
        uri = str(params.uri)
        if not uri.startswith(RESOURCE_PREFIX):
            raise MCPError(types.INVALID_PARAMS, f"Resource not found: {uri[:200]}")
        conversation_id = unquote(uri[len(RESOURCE_PREFIX) :])
        try:
            found = await self.chat.memory.get(conversation_id, with_messages=True)
        except ConversationNotFound:
            raise MCPError(types.INVALID_PARAMS, f"Resource not found: {uri[:200]}") from None
        text = json.dumps(conversation_json(found, with_messages=True), ensure_ascii=False)
        contents = types.TextResourceContents(uri=uri, mime_type="application/json", text=text)
        return types.ReadResourceResult(contents=[contents])

    # ---- sessions and list_changed -----------------------------------------------------------

    def _principal(self, ctx: Context) -> Principal:
        request = ctx.request
        if not isinstance(request, HTTPConnection):
            raise MCPError(FORBIDDEN, "no credentials on this request")
        return principal_of(request)

    def _remember(self, ctx: Context) -> None:
        """Keep the session of a handshake-era client for list_changed notices."""
        request = ctx.request
        if not isinstance(request, HTTPConnection):
            return
        session_id = request.headers.get(MCP_SESSION_ID_HEADER)
        if session_id is None:
            return
        self._sessions.put(session_id, ctx.session)

    def _on_device_event(self, event: DeviceEvent) -> None:
        if event.kind in _LIST_CHANGING:
            self._tools_changed()

    def _tools_changed(self) -> None:
        """A device or a dialed-in server came, went or changed its tools: notify (once for a
        burst) the sessions that listed tools."""
        if not self._sessions or self._stop.is_set():
            return
        self._changed = True
        if self._notifier is None or self._notifier.done():
            try:
                self._notifier = asyncio.get_running_loop().create_task(self._notify())
            except RuntimeError:  # no running loop: nobody to notify from here
                self._changed = False

    async def _notify(self) -> None:
        """Tell every remembered session that the tool list changed (coalesced)."""
        while self._changed:
            self._changed = False
            for session_id, session in list(self._sessions.items()):
                try:
                    with anyio.fail_after(5):
                        await session.send_tool_list_changed()
                except Exception as exc:  # the session ended: forget it
                    log.debug("mcp session gone", session=session_id[:8], error=type(exc).__name__)
                    self._sessions.pop(session_id, None)


class _Asgi:
    def __init__(self, endpoint: McpEndpoint) -> None:
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.endpoint.handle(scope, receive, send)


def _security(host: str) -> TransportSecuritySettings:
    """DNS-rebinding protection (Host and Origin checks) when the API is on loopback."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
        )
    return TransportSecuritySettings(enable_dns_rebinding_protection=False)


def _offset(cursor: str | None) -> int:
    if cursor is None:
        return 0
    if not cursor.isdigit() or len(cursor) > 9:
        raise MCPError(types.INVALID_PARAMS, "invalid cursor")
    return int(cursor)


def _content(item: dict[str, Any]) -> types.ContentBlock:
    try:
        return _CONTENT.validate_python(item)
    except ValidationError:
        return types.TextContent(type="text", text=json.dumps(item, ensure_ascii=False))


def _covers(principal: Principal, server: ExternalServer) -> bool:
    """Whether a device-limited key's devices include one the server is bound to (a key for
    every device, and a server for every device, always do)."""
    if principal.is_admin or principal.device_ids is None or server.bound_device_ids is None:
        return True
    return not principal.device_ids.isdisjoint(server.bound_device_ids)


def _annotations(tool: Tool) -> types.ToolAnnotations | None:
    """The tool's annotations (destructiveHint...) when they are well-formed, else none."""
    if not tool.annotations:
        return None
    try:
        return types.ToolAnnotations.model_validate(tool.annotations)
    except ValidationError:
        return None


def _error_result(message: str) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=message)], is_error=True
    )
