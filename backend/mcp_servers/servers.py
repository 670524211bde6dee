"""What every external MCP server of the hub is (`ExternalServer`), one living on an MCP client
session (`SessionServer`), their states, errors and bounds. The hub (hub.py) holds them; the
connectors (connectors.py) open configured ones; the toolbox (toolbox.py) offers their tools."""

import asyncio
import ctypes
import ctypes.util
import fnmatch
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal, Protocol

import structlog
from mcp import types as mcp_types

from backend.devices.session import RELIST_INTERVAL_S
from backend.logs import redact_urls
from backend.mcp_servers.errors import (
    CallTimedOut,
    McpServerError,
    ServerBusy,
    ServerNotReady,
    UnknownServerTool,
)
from backend.mcp_servers.settings import (
    DEFAULT_MAX_PENDING_CALLS,
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TOOL_BOUNDS,
    TOOL_NAME,
    ToolBounds,
    check_server_name,
)
from backend.mcp_session import CallResult, Tool

log = structlog.get_logger("mcp_servers")

ServerKind = Literal["stdio", "http", "dialin"]
# A dialed-in server is named `dialin-<key id>` (backend/mcp_dialin); `/mcp` names its tools
# `dialin-<key id>__<tool>` (toolbox.external_tool_names).
DIALIN_PREFIX = "dialin-"
MAX_CURSOR_CHARS = 1024  # as for devices: a longer nextCursor ends the listing
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


class ServerState(StrEnum):
    """An external server's state; values are the API's `state` strings."""

    CONNECTING = "connecting"
    READY = "ready"
    BACKING_OFF = "backing-off"
    FAILED = "failed"  # gave up (a configuration that cannot work), or a dial-in that went away
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class RiskyRule:
    """Which tools need a "yes" first: all, none, some names (fnmatch patterns), or (`None`
    setting) the tools the server marks `destructiveHint: true`, as for devices."""

    every: bool = False
    patterns: tuple[str, ...] = ()
    destructive_hint: bool = True

    @classmethod
    def from_setting(cls, value: bool | Iterable[str] | None) -> "RiskyRule":
        """The rule of a server's `risky` setting: None (the destructive hint), true/false, or
        patterns."""
        if value is None:
            return cls()
        if isinstance(value, bool):
            return cls(every=value, destructive_hint=False)
        return cls(patterns=tuple(value), destructive_hint=False)

    def reason(self, tool: Tool) -> str | None:
        """Why calling this tool needs a confirmation, or None."""
        if self.every:
            return "every tool of this server is marked risky"
        for pattern in self.patterns:
            if fnmatch.fnmatchcase(tool.name, pattern):
                return f"risky rule {pattern!r}"
        if self.destructive_hint and (tool.annotations or {}).get("destructiveHint") is True:
            return "the tool is marked destructiveHint"
        return None


class CallSession(Protocol):
    """What a server needs of an initialized `mcp.ClientSession` (so tests may pass a fake)."""

    async def list_tools(self, *, params: Any = None) -> Any:
        """MCP `tools/list` (the SDK's ClientSession method)."""

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: float | None = None,
    ) -> Any:
        """MCP `tools/call` (the SDK's ClientSession method)."""


class ExternalServer:
    """One external MCP server as the chat sees it: name, kind, state, tools, rules, `call`."""

    def __init__(
        self,
        name: str,
        *,
        kind: ServerKind,
        bound_device_ids: frozenset[str] | None = None,
        risky: RiskyRule | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        max_pending_calls: int = DEFAULT_MAX_PENDING_CALLS,
        tool_bounds: ToolBounds = DEFAULT_TOOL_BOUNDS,
    ) -> None:
        self.name = check_server_name(name)
        self.tool_bounds = tool_bounds
        self.kind: ServerKind = kind
        self.bound_device_ids = bound_device_ids
        self.risky = risky or RiskyRule()
        self.timeout_s = timeout_s
        self.max_result_bytes = max_result_bytes
        self.max_pending_calls = max_pending_calls
        self.pending = 0  # calls in flight
        self.state = ServerState.CONNECTING
        self.last_error: str | None = None
        self.tools: tuple[Tool, ...] = ()
        self.tools_version = 0  # bumped on every change of `tools` (toolboxes re-read then)
        self.calls = 0
        self.since = time.time()  # when `state` last changed
        # Called when `state` or `tools` change; the hub sets it while the server is registered.
        self.on_change: Callable[[], None] | None = None

    # ---- what the hub and the toolboxes use -----------------------------------------------------

    def serves_device(self, device_id: str | None) -> bool:
        """Whether this server's tools are offered in chats of this device (None: no device)."""
        if self.bound_device_ids is None:
            return True
        return device_id is not None and device_id in self.bound_device_ids

    def tool(self, name: str) -> Tool | None:
        """The tool of this name, if the server lists it."""
        for tool in self.tools:
            if tool.name == name:
                return tool
        return None

    def confirmation_reason(self, tool: Tool) -> str | None:
        """Why calling this tool needs a confirmation (the server's risky rule), or None."""
        return self.risky.reason(tool)

    async def call(
        self, tool: str, arguments: dict[str, Any], *, timeout_s: float | None = None
    ) -> CallResult:
        """One tools/call; raises McpServerError subclasses when the call did not complete.

        The result's text is cut to `max_result_bytes` (UTF-8) with a note saying so."""
        raise NotImplementedError

    async def start(self) -> None:
        """Begin connecting (configured servers); a dial-in server is live when attached."""

    async def stop(self) -> None:
        """Disconnect for good (the hub stops, or the server is removed)."""
        self._set_state(ServerState.STOPPED)

    def summary(self) -> dict[str, Any]:
        """What `GET /api/mcp/servers` shows (never a token or header value)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "state": self.state.value,
            "since": datetime.fromtimestamp(self.since, UTC).isoformat(),
            "last_error": self.last_error,
            "bound_device_ids": (
                sorted(self.bound_device_ids) if self.bound_device_ids is not None else None
            ),
            "calls": self.calls,
            "pending": self.pending,
            "tools": [
                {
                    "name": tool.name,
                    "description": tool.description[:500],
                    "risky": self.confirmation_reason(tool) is not None,
                }
                for tool in self.tools
            ],
        }

    # ---- for subclasses ---------------------------------------------------------------------

    def _set_state(self, state: ServerState, error: str | None = None) -> None:
        if state is not self.state:
            self.since = time.time()
            log.info(
                "mcp server state",
                server=self.name,
                kind=self.kind,
                state=state.value,
                error=error,
            )
        changed = state is not self.state
        self.state = state
        if error is not None:
            self.last_error = error
        if changed:
            self._changed()

    def _set_tools(self, tools: Iterable[Tool]) -> None:
        tools = tuple(tools)
        if tools != self.tools:
            self.tools = tools
            self.tools_version += 1
            self._changed()

    def _changed(self) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change()
        except Exception:  # a listener's bug must not break the server
            log.warning("mcp server change listener failed", server=self.name, exc_info=True)


class SessionServer(ExternalServer):
    """A server reached through an initialized `mcp.ClientSession` that someone else owns: the
    dial-in endpoint, or the hub's own connectors (backend/mcp_servers/connectors.py).

    `attach(session)` lists the tools and makes the server READY; `detach(reason)` drops the
    session (calls in flight fail, new ones get ServerNotReady) and leaves the server FAILED
    (or, with `state=`, e.g. BACKING_OFF while a connector waits to reconnect).
    """

    def __init__(self, name: str, **options: Any) -> None:
        super().__init__(name, **options)
        self._session: CallSession | None = None
        self._relist: asyncio.Task[None] | None = None
        self._relist_wanted = False
        self._last_list = 0.0  # monotonic time of the last listing (re-lists wait for the next)
        self.relist_interval_s = RELIST_INTERVAL_S  # as for devices: at most one per 2 s
        self.relists = 0  # tools/list requests after the first (list_changed, coalesced)
        self.notifications = 0
        self._bound_note: tuple[Any, ...] | None = None  # what the last warning said

    async def attach(self, session: CallSession) -> None:
        """Use `session` (already initialized): list its tools, then be READY."""
        self._session = session
        self._last_list = time.monotonic()
        try:
            self._set_tools(await self._list(session))
        except BaseException:
            self._session = None
            raise
        self._set_state(ServerState.READY)  # `last_error` stays: what went wrong last time

    def detach(self, reason: str, *, state: ServerState = ServerState.FAILED) -> None:
        """The session is gone: stop re-listing and go to `state` with the reason; unless the
        server is only backing off, its tools go too (and with them every schema it sent)."""
        self._session = None
        self._relist_wanted = False
        if self._relist is not None:
            self._relist.cancel()
            self._relist = None
        self._set_state(state, reason)
        if state is not ServerState.BACKING_OFF:  # gone for good: no schema of it stays held
            self._set_tools(())

    async def _list(self, session: CallSession) -> list[Tool]:
        """Every page of tools/list within `tool_bounds`; one warning when something was dropped
        (again only when that changes, so a server re-listing every 2 s is not a log flood)."""
        listing = await list_tools_bounded(session, self.tool_bounds)
        note = listing.note()
        if note is not None and note != self._bound_note:
            log.warning(
                "mcp server tool list bounded",
                server=self.name,
                kept=len(listing.tools),
                **listing.fields(),
            )
        self._bound_note = note
        return listing.tools

    async def message_handler(self, message: Any) -> None:
        """The session's `message_handler`: follows `notifications/tools/list_changed`."""
        if isinstance(message, mcp_types.ToolListChangedNotification):
            self.notifications += 1
            self.tools_changed()
        elif isinstance(message, Exception):
            log.info("mcp server transport error", server=self.name, error=describe_error(message))

    def tools_changed(self) -> None:
        """Re-list the tools in the background, as a device's are (backend/devices/session.py):
        one listing in flight, at most one per `relist_interval_s` (2 s), the notifications in
        between coalesced into the next one, whatever their number."""
        if self._session is None:
            return
        self._relist_wanted = True
        if self._relist is None or self._relist.done():
            self._relist = asyncio.get_running_loop().create_task(self._relist_tools())

    async def _relist_tools(self) -> None:
        while self._relist_wanted:
            self._relist_wanted = False
            wait = self._last_list + self.relist_interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            session = self._session
            if session is None:
                return
            self._last_list = time.monotonic()
            self.relists += 1
            try:
                async with asyncio.timeout(self.timeout_s):
                    tools = await self._list(session)
            except Exception as exc:
                log.warning(
                    "mcp server re-list failed", server=self.name, error=describe_error(exc)
                )
                self.last_error = f"tools/list: {describe_error(exc)}"
            else:
                if session is self._session:
                    self._set_tools(tools)

    async def call(
        self, tool: str, arguments: dict[str, Any], *, timeout_s: float | None = None
    ) -> CallResult:
        """Call a tool on the server; raises ServerNotReady, UnknownServerTool, ServerBusy,
        CallTimedOut, or McpServerError when the call failed on the way."""
        session = self._session
        if session is None or self.state is not ServerState.READY:
            raise ServerNotReady(self.name, self.state)
        if self.tool(tool) is None:
            raise UnknownServerTool(self.name, tool)
        if self.pending >= self.max_pending_calls:
            # Slow or hung calls pile up here, not in the server or in this process's memory.
            raise ServerBusy(self.name, self.max_pending_calls)
        limit = timeout_s if timeout_s is not None else self.timeout_s
        self.calls += 1
        self.pending += 1
        try:
            async with asyncio.timeout(limit):
                result = await session.call_tool(tool, arguments)
        except TimeoutError:
            raise CallTimedOut(self.name, tool, limit) from None
        except McpServerError:
            raise
        except Exception as exc:  # the SDK's MCPError, a closed stream, a crashed process...
            raise McpServerError(f"MCP server {self.name!r}: {describe_error(exc)}") from exc
        finally:
            self.pending -= 1
        return bounded_result(result, self.max_result_bytes)


async def list_all_tools(
    session: CallSession, bounds: ToolBounds = DEFAULT_TOOL_BOUNDS
) -> list[Tool]:
    """Every page of tools/list within `bounds` (`list_tools_bounded` without the report)."""
    return (await list_tools_bounded(session, bounds)).tools


@dataclass(slots=True)
class ToolListing:
    """The tools kept from one listing, what was dropped (reason -> count) and why the listing
    stopped early (None: it ended by itself)."""

    tools: list[Tool]
    dropped: dict[str, int]
    example: str | None = None  # the first dropped name (clipped)
    stopped: str | None = None
    pages: int = 0
    read_bytes: int = 0

    def note(self) -> tuple[Any, ...] | None:
        """What a warning would say, or None when nothing was dropped or cut."""
        if not self.dropped and self.stopped is None:
            return None
        return (tuple(sorted(self.dropped.items())), self.stopped)

    def fields(self) -> dict[str, Any]:
        """The warning's fields."""
        return {
            "dropped": dict(self.dropped),
            "example": self.example,
            "stopped": self.stopped,
            "pages": self.pages,
            "read_bytes": self.read_bytes,
        }


async def list_tools_bounded(
    session: CallSession, bounds: ToolBounds = DEFAULT_TOOL_BOUNDS
) -> ToolListing:
    """Every page of tools/list, bounded like a device's (`ToolBounds`): at most `max_pages`
    pages and `max_tool_bytes` of declarations read (no page is requested past either), at most
    `max_tools` kept; a tool whose name or schema breaks a bound, or that the bridge cannot read,
    is dropped and counted rather than failing the whole server. Yields to the loop between
    pages; nothing of a page is kept but the tools that passed."""
    listing = ToolListing([], {})
    kept: dict[str, Tool] = {}
    cursor: str | None = None
    seen_cursors: set[str] = set()
    for _page in range(bounds.max_pages):
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
        result = await session.list_tools(params=params)
        listing.pages += 1
        items, cursor = list(result.tools), result.next_cursor
        del result
        for item in items:
            wire = item.model_dump(by_alias=True, mode="json", exclude_none=True)
            listing.read_bytes += _json_size(wire)
            if listing.read_bytes > bounds.max_tool_bytes:
                listing.stopped = "max_tool_bytes"
                break
            if len(kept) >= bounds.max_tools:
                listing.stopped = "max_tools"
                break
            reason = tool_problem(wire, bounds)
            tool: Tool | None = None
            if reason is None:
                try:
                    tool = Tool.model_validate(wire)
                except ValueError:
                    reason = "invalid"
            if tool is None or tool.name in kept:
                _drop(listing, reason or "duplicate", wire.get("name"))
                continue
            kept[tool.name] = tool
        del items
        await asyncio.sleep(0)  # a big page never holds the loop with the next one
        if listing.stopped is not None or not cursor:
            break
        if len(cursor) > MAX_CURSOR_CHARS or cursor in seen_cursors:
            listing.stopped = "bad_cursor"
            break
        seen_cursors.add(cursor)
    else:
        if cursor:
            listing.stopped = "max_pages"
    listing.tools = list(kept.values())
    _forget_dropped(session, kept)
    return listing


def tool_problem(wire: Any, bounds: ToolBounds) -> str | None:
    """Why a declared tool (its JSON) breaks `bounds`, or None: `name_length`, `name_charset`,
    `schema_bytes`, `schema_depth` (an inputSchema or outputSchema), `not_an_object`."""
    if not isinstance(wire, dict):
        return "not_an_object"
    name = wire.get("name")
    if not isinstance(name, str) or not name:
        return "invalid"
    if len(name) > bounds.max_name_chars:
        return "name_length"
    if TOOL_NAME.fullmatch(name) is None:
        return "name_charset"
    for key in ("inputSchema", "outputSchema"):
        schema = wire.get(key)
        if schema is None:
            continue
        if json_depth(schema, bounds.max_schema_depth) > bounds.max_schema_depth:
            return "schema_depth"
        if _json_size(schema) > bounds.max_schema_bytes:
            return "schema_bytes"
    return None


def json_depth(value: Any, limit: int) -> int:
    """How deep `value` nests (a scalar is 0, `{}` is 1), counted no further than `limit + 1`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth) for child in children)
    return deepest


def _json_size(value: Any) -> int:
    try:
        return len(_COMPACT.encode(value).encode("utf-8", "replace"))
    except (TypeError, ValueError, RecursionError):
        return 1 << 30  # not JSON: counts as too big


def _drop(listing: ToolListing, reason: str, name: Any) -> None:
    listing.dropped[reason] = listing.dropped.get(reason, 0) + 1
    if listing.example is None:
        listing.example = str(name)[:80]


def _forget_dropped(session: Any, kept: dict[str, Tool]) -> None:
    """The SDK's ClientSession caches per-tool state (output schemas, header maps) of every tool
    of every page it lists, and over a paged listing only adds to it: keep only the tools the
    bridge kept, so a server cannot grow it listing after listing."""
    for attribute in ("_tool_output_schemas", "_tool_output_validators", "_x_mcp_header_maps"):
        cache = getattr(session, attribute, None)
        if isinstance(cache, dict):
            for name in [name for name in cache if name not in kept]:
                del cache[name]


def bounded_result(result: Any, max_bytes: int) -> CallResult:
    """The SDK's CallToolResult as the bridge's CallResult, its text cut to `max_bytes` (only the
    text blocks are read; an image or blob keeps its kind only)."""
    kept: list[dict[str, Any]] = []
    budget = max_bytes
    for item in getattr(result, "content", None) or []:
        text = getattr(item, "text", None)
        if not isinstance(text, str):
            kind = getattr(item, "type", None)
            kept.append({"type": kind if isinstance(kind, str) else "unknown"})
            continue
        if len(text) * 4 <= budget:  # a character is at most 4 bytes: no need to count them
            kept.append({"type": "text", "text": text})
            budget -= len(text.encode("utf-8", "replace"))
            continue
        data = text.encode("utf-8", "replace")
        if len(data) > budget:
            cut = data[:budget].decode("utf-8", "ignore")
            kept.append({"type": "text", "text": f"{cut}\n[result cut at {max_bytes} bytes]"})
            break
        kept.append({"type": "text", "text": text})
        budget -= len(data)
    return CallResult(content=kept, is_error=getattr(result, "is_error", False) is True)


_TRIM_EVERY_S = 10.0
_last_trim = -_TRIM_EVERY_S
_libc: Any = None


def release_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc `malloc_trim`), at most once per
    10 s whoever asks: after a server with big declarations left, its pages are free but still
    count in the RSS. True if it trimmed; a no-op (False) off glibc."""
    global _last_trim, _libc
    now = time.monotonic()
    if now - _last_trim < _TRIM_EVERY_S:
        return False
    _last_trim = now
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim  # noqa: B018 - not glibc: AttributeError
        except (OSError, AttributeError):
            _libc = False
    if _libc is False:
        return False
    _libc.malloc_trim(0)
    return True


def describe_error(exc: BaseException) -> str:
    """An exception as one short line (`Type: message`, at most 300 characters), its URLs
    without their secrets (`HTTPStatusError: … for url '…?api_key=…'`)."""
    text = redact_urls(str(exc).strip()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300] if text != type(exc).__name__ else text
