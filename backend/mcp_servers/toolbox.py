"""A chat turn's tools: a device's (if any) plus those of the external MCP servers it may use.

LLM names cannot collide: a device tool keeps the name its `DeviceToolBox` gives it; an external
tool is `<server>__<tool>` made LLM-safe by the same reversible `ToolNameMap` (a hash suffix when
that would clash with a device function or another server's tool). The list is rebuilt whenever a
server's tools change (`tools/list_changed`) or a server comes or goes, so a long turn offers
what is there now; a call maps its LLM name back through the names the model was last shown.

Every external call is audited like a device call (one `tool_called` registry event, device id
`mcp:<server>`), its arguments checked against the tool's inputSchema first (as a device's are),
bounded in time (`timeout_s`) and size (`max_result_bytes`), and never raises into the turn:
failures come back as an error `ToolOutcome` the model is told about.

`external_tool_names` and `audited_call` are the naming and the call on their own: `/mcp`
(backend/api/mcp_endpoint.py) offers the dialed-in servers' tools with them, under the same names.
"""

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from backend.chat.llm.base import FunctionSpec
from backend.chat.tools import ToolBox, ToolOutcome
from backend.devices.validation import argument_error
from backend.mcp_servers.errors import (
    InvalidToolArguments,
    McpServerError,
    ServerConfirmationRequired,
)
from backend.mcp_servers.servers import ExternalServer, ServerState
from backend.mcp_session import CallResult, Tool, ToolNameMap

log = structlog.get_logger("mcp_servers")

# (device id "mcp:<server>", tool, outcome, duration_ms, actor, arguments, confirmed, error)
AuditSink = Callable[..., None]
_SEPARATOR = "__"
_DESCRIPTION_LIMIT = 1024


def external_tool_names(
    servers: Iterable[ExternalServer], taken: Iterable[str] = ()
) -> dict[str, tuple[ExternalServer, Tool]]:
    """Every tool of `servers` by its LLM-safe name: `<server>__<tool>` through the reversible
    `ToolNameMap` (a hash suffix when that clashes with another tool or with a name of `taken`,
    e.g. a device's functions), never one of `taken`; in the servers' and tools' order."""
    reserved = frozenset(taken)
    wanted: dict[str, tuple[ExternalServer, Tool]] = {}
    for server in servers:
        for tool in server.tools:
            key = f"{server.name}{_SEPARATOR}{tool.name}"
            if key in reserved:
                key += "\u2063"  # not LLM-safe: the map gives it a hashed, distinct name
            wanted[key] = (server, tool)
    names = ToolNameMap([*wanted, *reserved])
    named: dict[str, tuple[ExternalServer, Tool]] = {}
    for key, found in wanted.items():
        llm_name = names.to_llm(key)
        if llm_name not in reserved:
            named[llm_name] = found
    return named


async def audited_call(
    server: ExternalServer,
    tool_name: str,
    arguments: dict[str, Any],
    *,
    actor: str,
    audit: AuditSink | None,
    confirmed: bool = False,
) -> CallResult:
    """One call of an external server's tool, as a chat turn and `/mcp` make it.

    Before anything is sent: arguments that break the tool's inputSchema raise
    InvalidToolArguments, a risky tool without `confirmed` raises ServerConfirmationRequired.
    Then `server.call` (its timeout and result cap; an McpServerError when the call did not
    complete). Every call, refused ones too, ends in one `audit("mcp:<server>", ...)` row."""
    started = time.perf_counter()
    outcome, error = "error", None
    try:
        tool = server.tool(tool_name)
        if tool is not None:
            problem = argument_error(tool.input_schema, arguments)
            if problem is not None:
                raise InvalidToolArguments(server.name, tool_name, problem)
            if not confirmed:
                reason = server.confirmation_reason(tool)
                if reason is not None:
                    raise ServerConfirmationRequired(server.name, tool_name, reason)
        result = await server.call(tool_name, arguments)
        outcome = "tool_error" if result.is_error else "ok"
        return result
    except (InvalidToolArguments, ServerConfirmationRequired) as exc:
        outcome, error = "refused", type(exc).__name__
        raise
    except asyncio.CancelledError:  # the caller went away (client gone, bridge stopping)
        error = "cancelled"
        raise
    except Exception as exc:
        error = type(exc).__name__
        raise
    finally:
        if audit is not None:
            audit(
                f"mcp:{server.name}",
                tool=tool_name,
                outcome=outcome,
                duration_ms=round((time.perf_counter() - started) * 1000, 3),
                actor=actor,
                arguments=arguments,
                confirmed=confirmed,
                error=error,
            )


class CombinedToolBox:
    """A `ToolBox` of one device's tools (optional) and the external servers' tools."""

    def __init__(
        self,
        device_box: ToolBox | None,
        servers: Callable[[], list[ExternalServer]],
        *,
        actor: str,
        audit: AuditSink | None = None,
    ) -> None:
        self.device_box = device_box
        self._servers = servers
        self.actor = actor
        self._audit = audit
        self._key: tuple[Any, ...] | None = None
        self._device_names: frozenset[str] = frozenset()
        self._external: dict[str, tuple[ExternalServer, str]] = {}  # LLM name -> (server, tool)
        self._functions: list[FunctionSpec] = []

    @property
    def unavailable_reason(self) -> str | None:
        """Why no tool can be offered, or None (external tools make up for a device's reason)."""
        # The device's reason (a key without devices:call) concerns the device tools only: it
        # stands for the whole box only when no external tool is there to offer instead.
        if self.device_box is None or self.device_box.unavailable_reason is None:
            return None
        return None if self._external_functions() else self.device_box.unavailable_reason

    def functions(self) -> list[FunctionSpec]:
        """The functions offered to the model: the device's and the external servers' for this
        device."""
        external = self._external_functions()
        if self.device_box is None:
            return external
        if self.device_box.unavailable_reason is not None:
            # Shown for intent detection when alone, as a lone DeviceToolBox does.
            return external or self.device_box.functions()
        return self.device_box.functions() + external

    def external_functions(self) -> list[FunctionSpec]:
        """The external servers' functions alone: ChatService offers them on every turn that
        passed the guardrail, while a device's tools wait for a turn about the device."""
        return self._external_functions()

    def _external_functions(self) -> list[FunctionSpec]:
        device = self._callable_device_functions()
        servers = [server for server in self._servers() if server.state is ServerState.READY]
        key = (
            tuple(spec.llm_name for spec in device),
            tuple((id(server), server.tools_version) for server in servers),
        )
        if key != self._key:
            self._rebuild(device, servers)
            self._key = key
        return list(self._functions)

    def _callable_device_functions(self) -> list[FunctionSpec]:
        if self.device_box is None or self.device_box.unavailable_reason is not None:
            return []
        return self.device_box.functions()

    def _rebuild(self, device: list[FunctionSpec], servers: list[ExternalServer]) -> None:
        self._device_names = frozenset(spec.llm_name for spec in device)
        self._external = {}
        functions = []
        for llm_name, (server, tool) in external_tool_names(servers, self._device_names).items():
            self._external[llm_name] = (server, tool.name)
            description = f"[MCP server {server.name}] {tool.description}"[:_DESCRIPTION_LIMIT]
            functions.append(FunctionSpec(llm_name, description, tool.input_schema))
        self._functions = functions

    def device_tool_name(self, llm_name: str) -> str:
        """The name a function stands for, as logged and audited (`server:tool` for external
        ones)."""
        found = self._external.get(llm_name)
        if found is not None:
            return f"{found[0].name}:{found[1]}"
        if self.device_box is not None:
            return self.device_box.device_tool_name(llm_name)
        return llm_name

    async def call(
        self, llm_name: str, arguments: dict[str, Any], *, confirmed: bool = False
    ) -> ToolOutcome:
        """Call the function's tool on the device or the external server it belongs to."""
        self._external_functions()  # the names as they are now
        found = self._external.get(llm_name)
        if found is None:
            if self.device_box is not None and self.device_box.unavailable_reason is not None:
                return await self.device_box.call(llm_name, arguments, confirmed=confirmed)
            if self.device_box is not None and llm_name in self._device_names:
                return await self.device_box.call(llm_name, arguments, confirmed=confirmed)
            known = ", ".join(spec.llm_name for spec in self.functions()) or "none"
            return ToolOutcome(
                f"error: there is no function {llm_name!r}; available: {known}",
                is_error=True,
                failed=True,
            )
        server, tool_name = found
        return await self._call_external(server, tool_name, arguments, confirmed=confirmed)

    async def _call_external(
        self, server: ExternalServer, tool_name: str, arguments: dict[str, Any], *, confirmed: bool
    ) -> ToolOutcome:
        try:
            result = await audited_call(
                server,
                tool_name,
                arguments,
                actor=self.actor,
                audit=self._audit,
                confirmed=confirmed,
            )
        except ServerConfirmationRequired as exc:
            return ToolOutcome(
                f"not run yet: {exc.reason}; the user is asked to confirm",
                is_error=True,
                failed=True,
                needs_confirmation=exc.reason,
            )
        except McpServerError as exc:
            return ToolOutcome(f"error: {exc}", is_error=True, failed=True)
        except Exception as exc:  # a bug below: the turn goes on, the log keeps the traceback
            log.warning("mcp server call failed", server=server.name, tool=tool_name, exc_info=True)
            return ToolOutcome(f"error: {type(exc).__name__}", is_error=True, failed=True)
        text = result.text or ("(no output)" if not result.is_error else "error")
        return ToolOutcome(text, is_error=result.is_error)
