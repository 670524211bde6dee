"""Typed views of what devices send, built with tolerant checks at the boundary.

Tools and the initialize result are validated once (pydantic) when they arrive; tool-call results
sit on the hot path, so they only get light dict checks and land in a slotted dataclass.
"""

import json
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any

import structlog
from pydantic import BaseModel, ConfigDict, Field

from backend.common import excerpt
from backend.logs import LogBudget
from backend.mcp_session.errors import ProtocolViolation

Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]

_MISSING: Any = object()


def default_input_schema() -> dict[str, Any]:
    """Schema for a tool whose own schema is missing or unusable: no arguments."""
    return {"type": "object", "properties": {}}


class TimeoutPolicy(BaseModel):
    """Reply deadlines: one default, overridden per tool (e.g. the camera needs 30 s)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    default_s: Seconds = 10.0
    per_tool: dict[str, Seconds] = Field(default_factory=dict)

    def for_tool(self, name: str) -> float:
        """The timeout of a tool call in seconds: the tool's own, else the default."""
        return self.per_tool.get(name, self.default_s)


@dataclass(frozen=True, slots=True)
class ToolLimits:
    """How much of a device's tool list the bridge keeps (a hostile device may declare
    thousands): at most `max_tools` declarations and `max_bytes` of their JSON."""

    max_tools: int = 2000
    max_bytes: int = 1 << 20


DEFAULT_TOOL_LIMITS = ToolLimits()


class Tool(BaseModel):
    """One tool as the device declared it; `input_schema` is kept whole for the LLM."""

    model_config = ConfigDict(frozen=True, validate_by_name=True, validate_by_alias=True)

    name: str = Field(min_length=1)
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=default_input_schema, alias="inputSchema")
    title: str | None = None
    annotations: dict[str, Any] | None = None
    output_schema: dict[str, Any] | None = Field(default=None, alias="outputSchema")

    def to_wire(self) -> dict[str, Any]:
        """The MCP JSON form (camelCase keys, absent optionals omitted)."""
        return self.model_dump(by_alias=True, exclude_none=True)


class InitializeResult(BaseModel):
    """The device's answer to MCP `initialize`, as the client keeps it."""

    model_config = ConfigDict(frozen=True)

    protocol_version: str
    server_info: dict[str, Any] = Field(default_factory=dict)
    capabilities: dict[str, Any] = Field(default_factory=dict)
    instructions: str | None = None

    @property
    def server_name(self) -> str | None:
        """`serverInfo.name` if the device sent a string there."""
        name = self.server_info.get("name")
        return name if isinstance(name, str) else None

    @property
    def server_version(self) -> str | None:
        """`serverInfo.version` if the device sent a string there."""
        version = self.server_info.get("version")
        return version if isinstance(version, str) else None

    @classmethod
    def from_wire(cls, result: Any) -> "InitializeResult":
        """Accept any reply that names a protocol version; odd optional fields become defaults."""
        if not isinstance(result, dict):
            raise ProtocolViolation(f"initialize result is {json_kind(result)}, not an object")
        version = result.get("protocolVersion")
        if not isinstance(version, str) or not version:
            raise ProtocolViolation("initialize result has no protocolVersion string")
        return cls(
            protocol_version=version,
            server_info=_dict_or_empty(result.get("serverInfo")),
            capabilities=_dict_or_empty(result.get("capabilities")),
            instructions=_str_or_none(result.get("instructions")),
        )


@dataclass(frozen=True, slots=True)
class CallResult:
    """A tools/call result. `is_error=True` is a tool failure the model should see, not raised."""

    content: list[dict[str, Any]] = field(default_factory=list)
    is_error: bool = False
    structured_content: Any = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The text parts joined by newlines (what the stock device returns)."""
        parts = [item["text"] for item in self.content if isinstance(item.get("text"), str)]
        return "\n".join(parts)

    @classmethod
    def from_wire(cls, result: Any) -> "CallResult":
        """Parse a `tools/call` result; raises ProtocolViolation when it is not the MCP shape."""
        if type(result) is not dict:
            raise ProtocolViolation(f"tools/call result is {json_kind(result)}, not an object")
        content = result.get("content", _MISSING)
        if content is _MISSING or content is None:
            content = []
        elif type(content) is not list:
            raise ProtocolViolation(f"tools/call content is {json_kind(content)}, not an array")
        for item in content:
            if type(item) is not dict:
                kind = json_kind(item)
                raise ProtocolViolation(f"tools/call content item is {kind}, not an object")
        is_error = result.get("isError", False)
        if is_error is None:
            is_error = False
        elif type(is_error) is not bool:
            raise ProtocolViolation(f"tools/call isError is {json_kind(is_error)}, not a boolean")
        return cls(content, is_error, result.get("structuredContent"), result)


_SHARED_TOOLS: "weakref.WeakValueDictionary[str, Tool]" = weakref.WeakValueDictionary()


def parse_tools(
    raw_tools: Iterable[Any], log: Any = None, *, start: int = 0, seen: set[str] | None = None
) -> list[Tool]:
    """Keep every usable tool: drop nameless ones and duplicates, repair unusable schemas.

    `start` numbers the tools in log lines and `seen` carries the names of earlier pages, so a
    list can be parsed page by page."""
    # A device declaring thousands of broken tools gets a few lines and a count, not thousands.
    owned = not isinstance(log, LogBudget)
    budget = LogBudget(log if log is not None else structlog.get_logger("mcp")) if owned else log
    tools: list[Tool] = []
    seen = seen if seen is not None else set()
    for index, raw in enumerate(raw_tools, start):
        try:
            tool = _parse_tool(index, raw, budget)
        except (ValueError, RecursionError) as exc:  # pydantic's ValidationError is a ValueError
            budget.warning("tool dropped", index=index, reason=excerpt(str(exc).splitlines()[0]))
            continue
        if tool is None:
            continue
        if tool.name in seen:
            budget.warning("duplicate tool name; keeping the first", tool=excerpt(tool.name))
            continue
        seen.add(tool.name)
        tools.append(tool)
    if owned:
        budget.close()
    return tools


def _parse_tool(index: int, raw: Any, log: Any) -> Tool | None:
    if not isinstance(raw, dict):
        log.warning("tool dropped", index=index, reason=f"tool is {json_kind(raw)}, not an object")
        return None
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        log.warning("tool dropped", index=index, reason="no non-empty string name")
        return None
    schema = raw.get("inputSchema", _MISSING)
    problem = _schema_problem(schema)
    if problem is not None:
        log.warning("tool schema replaced by an empty one", tool=excerpt(name), reason=problem)
        schema = default_input_schema()
    description = raw.get("description")
    if description is not None and not isinstance(description, str):
        kind = json_kind(description)
        log.info("tool description ignored", tool=excerpt(name), reason=f"it is {kind}")
    return _shared_tool(
        name=name,
        description=description if isinstance(description, str) else "",
        input_schema=schema,
        title=_str_or_none(raw.get("title")),
        annotations=_dict_or_none(raw.get("annotations")),
        output_schema=_dict_or_none(raw.get("outputSchema")),
    )


def _shared_tool(**fields: Any) -> Tool:
    """One Tool object per distinct declaration, shared by every device that declares it.

    Devices of one model declare identical tools, so a thousand sessions hold one copy instead
    of a thousand. Tools are frozen; their schema dicts must be treated as read-only too.
    """
    try:
        key = json.dumps(fields, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):  # not JSON-shaped, or nested absurdly deep
        return Tool(**fields)
    tool = _SHARED_TOOLS.get(key)
    if tool is None:
        tool = Tool(**fields)
        _SHARED_TOOLS[key] = tool
    return tool


def _schema_problem(schema: Any) -> str | None:
    """Why `schema` cannot serve as a tool's parameters, or None when it can."""
    if schema is _MISSING or schema is None:
        return "inputSchema is missing"
    if not isinstance(schema, dict):
        return f"inputSchema is {json_kind(schema)}, not an object"
    if schema.get("type") != "object":
        return 'inputSchema type is not "object"'
    properties = schema.get("properties", _MISSING)
    if properties is not _MISSING and not isinstance(properties, dict):
        return "inputSchema properties is not an object"
    required = schema.get("required", _MISSING)
    if required is not _MISSING and not (
        isinstance(required, list) and all(isinstance(item, str) for item in required)
    ):
        return "inputSchema required is not an array of strings"
    return None


def json_kind(value: Any) -> str:
    """JSON name of a value's type, for error messages that never echo device data."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _dict_or_empty(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _dict_or_none(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
