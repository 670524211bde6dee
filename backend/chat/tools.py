"""The seam between a chat turn and device tools.

A turn sees a `ToolBox`: the functions it may offer the model, a way back from an LLM function
name to the device's MCP tool name (for events), and `call`, which never raises for tool or
device failures: they come back as an error `ToolOutcome` that the model is told about.

`DeviceToolBox` adapts anything shaped like the core's `Device` (`ToolSource`): model-visible
tools only (user-only tools stay with the user), LLM-safe names from `ToolNameMap`, the full
`inputSchema` as parameters. `unavailable_reason` (e.g. "missing scope devices:call") keeps the
functions visible for intent detection, but the turn offers no tools and reports why.

A risky tool (reboot, upgrade, settings: `backend.devices.confirm`) comes back unrun with
`needs_confirmation`; the turn asks the user and calls it again with `confirmed=True` only after
a "yes" in the next turn (backend/chat/confirmation.py). `actor` names who asks, for the audit
log.
"""

from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from backend.chat.confirm import UNSURE_REASON
from backend.chat.llm.base import FunctionSpec
from backend.devices.errors import ConfirmationRequired
from backend.errors import BridgeError
from backend.mcp_session import CallResult, McpError, Tool, ToolNameMap, UnknownToolName
from backend.mcp_session.names import llm_functions

log = structlog.get_logger("chat")


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """What a call gave: the text for the model, and whether it is an error.

    `failed` means the call did not complete (device error, timeout, disconnect, bad arguments);
    a tool that ran and answered `isError: true` has `is_error` but not `failed`.
    """

    text: str
    is_error: bool = False
    failed: bool = False
    needs_confirmation: str | None = None  # why the tool did not run yet (a risky tool)


class ToolBox(Protocol):
    """What a turn may call (see the module docstring)."""

    @property
    def unavailable_reason(self) -> str | None:
        """Why no tool may be called (e.g. a missing scope), or None."""

    def functions(self) -> list[FunctionSpec]:
        """The functions to offer the model."""

    def external_functions(self) -> list[FunctionSpec]:
        """The part of `functions()` that is not the device's (external MCP servers): offered
        on every turn, while the device's wait for a turn about the device."""
        ...

    def device_tool_name(self, llm_name: str) -> str:
        """The tool an LLM function name stands for, for events and logs."""

    async def call(
        self, llm_name: str, arguments: dict[str, Any], *, confirmed: bool = False
    ) -> ToolOutcome:
        """Call the function's tool; failures come back as an error outcome, never raised."""


class ToolSource(Protocol):
    """The part of the core's `Device` that tools need (satisfied by `backend.devices.Device`)."""

    device_id: str

    def tool_list(self, *, include_user_only: bool = True) -> list[Tool]:
        """The device's tools (see `Device.tool_list`)."""

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        confirmed: bool = False,
        actor: str | None = None,
    ) -> CallResult:
        """Call a device tool (see `Device.call_tool`)."""


class DeviceToolBox:
    """The model-visible tools of one device, as LLM functions."""

    def __init__(
        self,
        source: ToolSource,
        *,
        unavailable_reason: str | None = None,
        timeout_s: float | None = None,
        actor: str | None = None,
    ) -> None:
        self.source = source
        self.unavailable_reason = unavailable_reason
        self.timeout_s = timeout_s
        self.actor = actor
        self._tools: list[Tool] = []
        self._names = ToolNameMap(())
        self._functions: list[FunctionSpec] = []
        self.refresh()

    @property
    def device_id(self) -> str:
        """The id of the device whose tools these are."""
        return self.source.device_id

    def refresh(self) -> None:
        """Re-read the device's tools (they may change on `notifications/tools/list_changed`)."""
        tools = self.source.tool_list(include_user_only=False)
        if tools == self._tools:
            return
        self._tools = tools
        self._names = ToolNameMap(tool.name for tool in tools)
        self._functions = [
            FunctionSpec(item["name"], item["description"], item["parameters"])
            for item in llm_functions(tools, self._names)
        ]

    def functions(self) -> list[FunctionSpec]:
        """The device's model-visible tools as functions, refreshed if its tool list changed."""
        self.refresh()
        return list(self._functions)

    def external_functions(self) -> list[FunctionSpec]:
        """None: a device's own tools only."""
        return []  # a device's own tools only

    def device_tool_name(self, llm_name: str) -> str:
        """The device's MCP tool name (the LLM name itself when unknown)."""
        try:
            return self._names.from_llm(llm_name)
        except UnknownToolName:
            return llm_name

    async def call(
        self, llm_name: str, arguments: dict[str, Any], *, confirmed: bool = False
    ) -> ToolOutcome:
        """Call the device tool; unavailability, refusals and failures become error outcomes."""
        if self.unavailable_reason is not None:
            return ToolOutcome(f"error: {self.unavailable_reason}", is_error=True, failed=True)
        try:
            name = self._names.from_llm(llm_name)
        except UnknownToolName:
            known = ", ".join(spec.llm_name for spec in self._functions) or "none"
            return ToolOutcome(
                f"error: there is no function {llm_name!r}; available: {known}",
                is_error=True,
                failed=True,
            )
        try:
            result = await self.source.call_tool(
                name, arguments, timeout_s=self.timeout_s, confirmed=confirmed, actor=self.actor
            )
        except ConfirmationRequired as exc:
            return ToolOutcome(
                f"not run yet: {exc.reason}; the user is asked to confirm",
                is_error=True,
                failed=True,
                needs_confirmation=exc.reason,
            )
        except (BridgeError, McpError) as exc:
            return ToolOutcome(f"error: {exc}", is_error=True, failed=True)
        except Exception as exc:
            # Not a documented error: a bug in a tool source. The turn goes on (the model hears
            # that the call failed) and the log keeps the traceback.
            log.warning(
                "tool call failed",
                device_id=self.device_id,
                tool=name,
                error=type(exc).__name__,
                exc_info=True,
            )
            return ToolOutcome(f"error: {exc}", is_error=True, failed=True)
        text = result.text or ("(no output)" if not result.is_error else "error")
        return ToolOutcome(text, is_error=result.is_error)


class NoTools:
    """The empty toolbox (a turn without a device)."""

    unavailable_reason: str | None = None

    def functions(self) -> list[FunctionSpec]:
        """No functions."""
        return []

    def external_functions(self) -> list[FunctionSpec]:
        """No functions."""
        return []

    def device_tool_name(self, llm_name: str) -> str:
        """The name itself."""
        return llm_name

    async def call(
        self, llm_name: str, arguments: dict[str, Any], *, confirmed: bool = False
    ) -> ToolOutcome:
        """An error outcome: there is no function to call."""
        return ToolOutcome(f"error: there is no function {llm_name!r}", is_error=True, failed=True)


# Verbs that start a tool name that only reads ("self.get_device_status", "read_sensor").
_READ_VERBS = ("get", "read", "list", "show", "check", "query", "describe", "fetch")


def reads_only(tool: str, annotations: dict[str, Any] | None = None) -> bool:
    """Whether a tool only reads: its MCP annotations say `readOnlyHint: true`, or its name's
    last part starts with a reading verb ("self.get_device_status")."""
    if annotations and annotations.get("readOnlyHint") is True:
        return True
    last = tool.rsplit(".", 1)[-1].lower()
    return last.split("_", 1)[0] in _READ_VERBS


class AskBeforeChanging:
    """A toolbox for a turn whose words the recognizer was not sure of: every tool that may
    change something comes back unrun with `needs_confirmation`, so the user is asked ("Did
    you want me to set the screen brightness to 3?") and it runs only after a "yes". Reading
    tools run. A misheard sentence may cost a question, never a device change."""

    def __init__(self, inner: ToolBox) -> None:
        self.inner = inner

    @property
    def unavailable_reason(self) -> str | None:
        """The inner toolbox's."""
        return self.inner.unavailable_reason

    def functions(self) -> list[FunctionSpec]:
        """The inner toolbox's functions."""
        return self.inner.functions()

    def external_functions(self) -> list[FunctionSpec]:
        """The inner toolbox's external functions."""
        return self.inner.external_functions()

    def device_tool_name(self, llm_name: str) -> str:
        """The inner toolbox's name for it."""
        return self.inner.device_tool_name(llm_name)

    async def call(
        self, llm_name: str, arguments: dict[str, Any], *, confirmed: bool = False
    ) -> ToolOutcome:
        """Reads run; changes wait for the user's "yes" (`confirmed`)."""
        tool = self.inner.device_tool_name(llm_name)
        if confirmed or reads_only(tool, self._annotations(tool)):
            return await self.inner.call(llm_name, arguments, confirmed=confirmed)
        return ToolOutcome(
            f"not run yet: {UNSURE_REASON}; the user is asked to confirm",
            is_error=True,
            failed=True,
            needs_confirmation=UNSURE_REASON,
        )

    def _annotations(self, tool: str) -> dict[str, Any] | None:
        source = getattr(self.inner, "source", None)
        if source is None:
            return None
        for known in source.tool_list(include_user_only=False):
            if known.name == tool:
                annotations: dict[str, Any] | None = known.annotations
                return annotations
        return None
