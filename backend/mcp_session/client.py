"""The bridge's MCP client for one device: JSON-RPC correlation over any transport.

The client knows nothing of sockets: it hands request payloads (dicts) to `send` and receives
every inbound payload through `feed`. Design points, each a lesson from existing backends:

* Request ids are integers counting up from 1 per client and are never reused, so a reply that
  arrives after its request timed out can never be mistaken for the answer to another request.
  A reply id is accepted as an int, an integral float (`3.0`, from JSON libraries that print
  doubles) or the canonical decimal string of an int (`"3"`, from devices that stringify ids):
  we never send anything else, ids are never reused and only pending ids match, so this cannot
  mis-route a reply. Booleans never match (`true` is not request 1).
* Each request owns one timer (no task): on expiry the waiter is resolved with a marker, the
  caller sends `notifications/cancelled` (never for `initialize`) and raises RequestTimeout.
* Replies are resolved exactly once: whoever pops the pending entry (reply, timer, close) wins.
* `feed` never raises: a device sending garbage is logged, not fatal.
"""

import asyncio
import inspect
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from backend import __version__
from backend.common import excerpt
from backend.errors import MessageTooLarge
from backend.logs import LogBudget
from backend.mcp_session.errors import (
    DeviceDisconnected,
    DeviceError,
    ProtocolViolation,
    RequestTimeout,
)
from backend.mcp_session.models import (
    DEFAULT_TOOL_LIMITS,
    CallResult,
    InitializeResult,
    TimeoutPolicy,
    Tool,
    ToolLimits,
    json_kind,
    parse_tools,
)

SendFn = Callable[[dict[str, Any]], Awaitable[None]]
ToolsChangedFn = Callable[[], Any]

PROTOCOL_VERSION = "2024-11-05"
# Versions whose tools/list and tools/call shapes we understand; others are used with a warning.
KNOWN_PROTOCOL_VERSIONS = frozenset({"2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"})
MAX_LIST_PAGES = 64
MAX_CURSOR_LENGTH = 1024
# A request id from the device is echoed in our reply: a longer one is dropped, never echoed.
MAX_DEVICE_ID_LENGTH = 128
# Replies to the device's own requests (ping) waiting to be sent; more means it is not reading.
MAX_DEVICE_REQUESTS = 16
# A device's error message is kept to this many characters (logs, API answers, device state).
MAX_ERROR_CHARS = 200
DEFAULT_CLIENT_INFO: dict[str, str] = {"name": "esp32-mcp-bridge", "version": __version__}
DEFAULT_TIMEOUTS = TimeoutPolicy()
METHOD_NOT_FOUND = -32601

_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_TIMED_OUT: Any = object()  # resolves a waiter whose deadline passed
_MISSING: Any = object()
_MAX_ID_DIGITS = 18


class McpClient:
    """One device's MCP session as seen from the bridge (the MCP client side)."""

    __slots__ = (
        "_client_info",
        "_closed_reason",
        "_log",
        "_next_id",
        "_noise",
        "_on_tools_changed",
        "_on_violation",
        "_pending",
        "_replies_in_flight",
        "_send",
        "_tasks",
        "_timeouts",
        "_vision",
    )

    def __init__(
        self,
        send: SendFn,
        *,
        timeouts: TimeoutPolicy | None = None,
        client_info: dict[str, Any] | None = None,
        vision: dict[str, Any] | None = None,
        on_tools_changed: ToolsChangedFn | None = None,
        on_violation: Callable[[str], None] | None = None,
        log: Any = None,
    ) -> None:
        self._send = send
        self._timeouts = timeouts if timeouts is not None else DEFAULT_TIMEOUTS
        self._client_info = client_info if client_info is not None else DEFAULT_CLIENT_INFO
        self._vision = vision  # holds a secret token: never logged
        self._on_tools_changed = on_tools_changed
        self._log = log if log is not None else structlog.get_logger("mcp")
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 1
        self._closed_reason: str | None = None
        self._tasks: set[asyncio.Future[Any]] | None = None  # created on first use
        self._on_violation = on_violation  # the device broke a bound: its link should close
        self._replies_in_flight = 0
        self._noise: LogBudget | None = None

    # ---- state ---------------------------------------------------------------------------------

    @property
    def pending_count(self) -> int:
        """How many requests are waiting for the device's answer."""
        return len(self._pending)

    @property
    def closed(self) -> bool:
        """Whether the link is gone; every call then raises DeviceDisconnected."""
        return self._closed_reason is not None

    # ---- requests ------------------------------------------------------------------------------

    async def initialize(self, *, timeout_s: float | None = None) -> InitializeResult:
        """initialize, then notifications/initialized. Not cancelled on timeout (spec forbids)."""
        capabilities: dict[str, Any] = {}
        if self._vision is not None:
            capabilities["vision"] = dict(self._vision)
        params = {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": capabilities,
            "clientInfo": self._client_info,
        }
        timeout = _timeout_or(timeout_s, self._timeouts.default_s)
        result = await self._roundtrip("initialize", params, timeout, cancellable=False)
        server = InitializeResult.from_wire(result)
        if server.protocol_version not in KNOWN_PROTOCOL_VERSIONS:
            self._log.warning(
                "unknown MCP version from device", version=excerpt(server.protocol_version)
            )
        await self.notify("notifications/initialized")
        self._log.debug(
            "MCP initialized",
            server=excerpt(server.server_name) if server.server_name is not None else None,
            mcp=excerpt(server.protocol_version),
        )
        return server

    async def list_tools(
        self,
        *,
        with_user_tools: bool = False,
        timeout_s: float | None = None,
        limits: ToolLimits = DEFAULT_TOOL_LIMITS,
    ) -> list[Tool]:
        """All pages of tools/list, merged and validated (`timeout_s` applies per page).

        A device declaring more than `limits` allow (tools or bytes of declarations) keeps the
        first ones that fit; the rest are not requested, and one warning says so.
        """
        timeout = _timeout_or(timeout_s, self._timeouts.default_s)
        raw_tools: list[Any] = []
        declared_bytes = 0
        budget = LogBudget(self._log)  # one budget for the whole list: a few lines, then counts
        tools: list[Tool] = []
        seen: set[str] = set()
        cursor = ""
        seen_cursors = {cursor}
        for _page in range(MAX_LIST_PAGES):
            params: dict[str, Any] = {"cursor": cursor}
            if with_user_tools:
                params["withUserTools"] = True
            result = await self._roundtrip("tools/list", params, timeout)
            page_tools, next_cursor = _parse_tools_page(result)
            declared_bytes += _json_size(page_tools)
            before = len(raw_tools)
            raw_tools.extend(page_tools)
            truncated = len(raw_tools) > limits.max_tools or declared_bytes > limits.max_bytes
            if truncated:
                page_tools = page_tools[: max(0, len(_within(raw_tools, limits)) - before)]
            # Page by page, yielding between pages: a list of thousands of tools never holds
            # the event loop (and every other device's calls) in one go.
            tools.extend(parse_tools(page_tools, budget, start=len(tools), seen=seen))
            await asyncio.sleep(0)
            if truncated:
                self._log.warning(
                    "tool list truncated", kept=len(tools), limit=limits.max_tools,
                    max_bytes=limits.max_bytes,
                )  # fmt: skip
                break
            # "" would restart from the first page (or is a zero-value "no more"): either way, done.
            if next_cursor is None or next_cursor == "":
                break
            if len(next_cursor) > MAX_CURSOR_LENGTH:
                raise ProtocolViolation(f"tools/list cursor longer than {MAX_CURSOR_LENGTH}")
            if next_cursor in seen_cursors:
                raise ProtocolViolation("tools/list repeated a cursor (pagination loop)")
            seen_cursors.add(next_cursor)
            cursor = next_cursor
        else:
            raise ProtocolViolation(f"tools/list did not end within {MAX_LIST_PAGES} pages")
        budget.close()
        return tools

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> CallResult:
        """One tools/call. A tool failure comes back as `is_error=True`; JSON-RPC errors raise."""
        if arguments is None:
            arguments = {}
        elif not isinstance(arguments, dict):
            raise TypeError(f"tool arguments must be a dict, not {type(arguments).__name__}")
        if timeout_s is None:
            timeout = self._timeouts.for_tool(name)
        else:
            timeout = _checked_timeout(timeout_s)
        params = {"name": name, "arguments": arguments}
        result = await self._roundtrip("tools/call", params, timeout, tool=name)
        return CallResult.from_wire(result)

    async def request(
        self, method: str, params: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> Any:
        """Any request; returns the raw `result` value."""
        timeout = _timeout_or(timeout_s, self._timeouts.default_s)
        return await self._roundtrip(method, params, timeout, cancellable=method != "initialize")

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        """Send a JSON-RPC notification (no answer expected); raises DeviceDisconnected once
        closed."""
        if self._closed_reason is not None:
            raise DeviceDisconnected(self._closed_reason)
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        await self._send_or_disconnect(message)

    def close(self, reason: str) -> None:
        """Fail every pending call with DeviceDisconnected now; later calls fail at once."""
        if self._closed_reason is not None:
            return
        self._closed_reason = reason
        if self._noise is not None:
            self._noise.close()
        pending = list(self._pending.values())
        self._pending.clear()
        for waiter in pending:
            if not waiter.done():
                waiter.set_exception(DeviceDisconnected(reason))
        current = _current_task()
        for task in list(self._tasks or ()):
            if task is not current:
                task.cancel()

    async def _roundtrip(
        self,
        method: str,
        params: dict[str, Any] | None,
        timeout_s: float,
        tool: str | None = None,
        cancellable: bool = True,
    ) -> Any:
        if self._closed_reason is not None:
            raise DeviceDisconnected(self._closed_reason)
        request_id = self._next_id
        self._next_id = request_id + 1
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._pending[request_id] = waiter
        deadline = loop.call_later(timeout_s, self._expire, request_id)
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        try:
            await self._send_or_disconnect(message)
            reply = await waiter
        except asyncio.CancelledError:
            if cancellable and self._closed_reason is None:
                self._spawn(self._send_cancelled(request_id, "cancelled by caller"), "mcp-cancel")
            raise
        finally:
            deadline.cancel()
            self._pending.pop(request_id, None)
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # retrieved: a failed send must not leave it "never retrieved"
        if reply is _TIMED_OUT:
            if cancellable and self._closed_reason is None:
                await self._send_cancelled(request_id, f"timeout after {timeout_s:g}s")
            raise RequestTimeout(method, timeout_s, tool)
        return _result_of(reply, method)

    def _expire(self, request_id: int) -> None:
        waiter = self._pending.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(_TIMED_OUT)

    async def _send_or_disconnect(self, message: dict[str, Any]) -> None:
        try:
            await self._send(message)
        except MessageTooLarge:
            raise  # nothing was sent; the link is fine
        except Exception as exc:  # a broken link surfaces as whatever the transport raises
            raise DeviceDisconnected(f"send failed: {type(exc).__name__}: {exc}") from exc

    async def _send_cancelled(self, request_id: int, reason: str) -> None:
        params = {"requestId": request_id, "reason": reason}
        notice = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": params}
        await self._send_quietly(notice)

    async def _send_quietly(self, message: dict[str, Any]) -> None:
        """Best-effort send (cancel notices, answers to device requests): failures are logged."""
        try:
            await self._send(message)
        except Exception as exc:
            self._log.info("could not send to device", error=f"{type(exc).__name__}: {exc}")

    # ---- inbound -------------------------------------------------------------------------------

    def feed(self, payload: Any) -> None:
        """Handle one inbound `mcp` payload: any JSON value. Never raises."""
        if type(payload) is list:
            if not payload:
                self._dropped("dropped MCP payload", reason="empty batch")
            for message in payload:
                self._feed_safely(message)
        else:
            self._feed_safely(payload)

    def _feed_safely(self, message: Any) -> None:
        try:
            self._feed_message(message)
        except Exception:  # a bug here must not take the device link down
            self._log.exception("MCP message handling failed")

    def _feed_message(self, message: Any) -> None:
        if type(message) is not dict:
            self._dropped("dropped MCP payload", reason=f"payload is {json_kind(message)}")
            return
        if self._closed_reason is not None:
            self._log.debug("MCP message after close dropped")
            return
        method = message.get("method", _MISSING)
        if method is _MISSING:
            self._on_reply(message)
        elif type(method) is not str:
            self._dropped("dropped MCP message", reason="method is not a string")
        elif message.get("id") is not None:
            self._on_device_request(method, message["id"])
        else:
            self._on_notification(method)

    def _on_reply(self, message: dict[str, Any]) -> None:
        request_id = _as_request_id(message.get("id"))
        waiter = self._pending.pop(request_id, None) if request_id is not None else None
        if waiter is None:
            self._log_stray_reply(message, request_id)
        elif not waiter.done():
            waiter.set_result(message)

    def _log_stray_reply(self, message: dict[str, Any], request_id: int | None) -> None:
        if "result" not in message and "error" not in message:
            self._dropped("dropped MCP message", reason="no method, result or error")
        elif request_id is not None and 0 < request_id < self._next_id:
            # Timed out, cancelled or answered twice: expected now and then, harmless.
            self._noisy().info("late MCP reply dropped", request_id=request_id)
        elif message.get("id") is None and message.get("error") is not None:
            error = _device_error(message["error"])
            self._dropped("device reported an error without request id", error=excerpt(str(error)))
        else:
            self._dropped("MCP reply with unknown id dropped", id=excerpt(repr(message.get("id"))))

    def _on_device_request(self, method: str, request_id: Any) -> None:
        if type(request_id) not in (int, str, float):
            self._dropped("dropped device request", reason=f"id is {json_kind(request_id)}")
            return
        if type(request_id) is str and len(request_id) > MAX_DEVICE_ID_LENGTH:
            self._dropped("dropped device request", reason="id too long to echo")
            return
        if self._replies_in_flight >= MAX_DEVICE_REQUESTS:
            # It keeps asking but does not read our answers: nothing more is queued for it.
            self._dropped("dropped device request", reason="too many requests in flight")
            if self._on_violation is not None:
                self._on_violation(f"more than {MAX_DEVICE_REQUESTS} requests in flight")
            return
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id}
        if method == "ping":
            reply["result"] = {}
        else:
            self._noisy().info(
                "device request answered with method not found", method=excerpt(method)
            )
            reply["error"] = {"code": METHOD_NOT_FOUND, "message": f"Method not found: {method}"}
        self._replies_in_flight += 1
        self._spawn(self._send_reply(reply), "mcp-reply")

    async def _send_reply(self, reply: dict[str, Any]) -> None:
        try:
            await self._send_quietly(reply)
        finally:
            self._replies_in_flight -= 1

    def _noisy(self) -> LogBudget:
        """The log for what the device sends wrong: a few lines each, then counted summaries."""
        if self._noise is None:
            self._noise = LogBudget(self._log)
        return self._noise

    def _dropped(self, event: str, **fields: Any) -> None:
        self._noisy().warning(event, **fields)

    def _on_notification(self, method: str) -> None:
        if method != "notifications/tools/list_changed":
            self._log.debug("device notification ignored", method=excerpt(method))
            return
        callback = self._on_tools_changed
        if callback is None:
            self._log.debug("tools list changed; nobody listens")
            return
        try:
            outcome = callback()
        except Exception:
            self._log.exception("on_tools_changed callback failed")
            return
        if inspect.isawaitable(outcome):
            self._spawn(outcome, "mcp-tools-changed")

    # ---- background work (answers to the device, async callbacks) -----------------------------

    def _spawn(self, work: Awaitable[Any], name: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # fed from plain sync code: nothing can run the work
            if inspect.iscoroutine(work):
                work.close()
            self._log.warning("no event loop; background work dropped", work=name)
            return
        task = asyncio.ensure_future(work, loop=loop)
        if isinstance(task, asyncio.Task):
            task.set_name(name)
        if self._tasks is None:
            self._tasks = set()
        self._tasks.add(task)  # strong reference: the loop keeps only weak ones
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        if self._tasks is not None:
            self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.error("MCP background task failed", exc_info=task.exception())


def _json_size(value: Any) -> int:
    try:
        return len(_COMPACT.encode(value))
    except (TypeError, ValueError, RecursionError):
        return 0


def _within(raw_tools: list[Any], limits: ToolLimits) -> list[Any]:
    """The first declarations that fit both limits."""
    kept: list[Any] = []
    size = 0
    for raw in raw_tools[: limits.max_tools]:
        size += _json_size(raw)
        if size > limits.max_bytes:
            break
        kept.append(raw)
    return kept


def _parse_tools_page(result: Any) -> tuple[list[Any], str | None]:
    if not isinstance(result, dict):
        raise ProtocolViolation(f"tools/list result is {json_kind(result)}, not an object")
    tools = result.get("tools")
    if not isinstance(tools, list):
        raise ProtocolViolation(f"tools/list tools is {json_kind(tools)}, not an array")
    cursor = result.get("nextCursor")
    if cursor is not None and not isinstance(cursor, str):
        raise ProtocolViolation(f"tools/list nextCursor is {json_kind(cursor)}, not a string")
    return tools, cursor


def _result_of(reply: dict[str, Any], method: str) -> Any:
    """The reply's result; an error raises (`"error": null` next to a result is tolerated)."""
    error = reply.get("error")
    if error is not None:
        raise _device_error(error)
    if "result" not in reply:
        raise ProtocolViolation(f"reply to {method} has neither result nor error")
    return reply["result"]


def _device_error(error: Any) -> DeviceError:
    """A DeviceError from any `error` value; stock devices send `{"message"}` without code."""
    if isinstance(error, dict):
        code = _integral(error.get("code"))
        message = error.get("message")
        if not isinstance(message, str) or not message:
            suffix = f" (code {code})" if code is not None else ""
            message = f"device error without a message{suffix}"
        # It travels on: into log lines, the device's `error`, API answers. Clipped once, here.
        return DeviceError(excerpt(message, MAX_ERROR_CHARS), code, error.get("data"))
    if isinstance(error, str) and error:
        return DeviceError(f"malformed error from device: {excerpt(error, MAX_ERROR_CHARS)}")
    return DeviceError(f"malformed error from device ({json_kind(error)})")


def _as_request_id(value: Any) -> int | None:
    """Our integer id from a reply's id, or None (see the module docstring for what matches)."""
    if type(value) is int:  # the usual case, first
        return value
    if (
        type(value) is str
        and 0 < len(value) <= _MAX_ID_DIGITS
        and value.isascii()
        and value.isdigit()
        and (value[0] != "0" or value == "0")
    ):
        return int(value)
    return _integral(value)


def _integral(value: Any) -> int | None:
    """An int, or an integral float (`3.0`); never a bool."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    return None


def _timeout_or(timeout_s: float | None, fallback: float) -> float:
    return fallback if timeout_s is None else _checked_timeout(timeout_s)


def _checked_timeout(timeout_s: float) -> float:
    if not 0 < timeout_s < math.inf:  # also rejects NaN
        raise ValueError(f"timeout_s must be a positive number of seconds, not {timeout_s!r}")
    return float(timeout_s)


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None
