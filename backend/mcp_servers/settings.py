"""`[[mcp_servers]]`: the external MCP servers the chat may use (docs/mcp-servers.md).

One table per server: a `name` (`[a-z0-9_-]{1,32}`, also the scope `mcp:<name>` and the prefix of
its tools' LLM names), then either `command` (+ `args`, `env`, `cwd`) for a stdio child process or
`url` (Streamable HTTP, + `headers` or `bearer_token`). Header values and the bearer token are
`SecretStr`s: never logged, never shown by the API. `risky` is true (every tool needs a "yes"
first), false (none), a list of tool-name patterns, or unset (tools marked `destructiveHint`).

`ToolBounds` bounds what a server (configured or dialed in) may declare: tools, name length and
charset, each input schema's size and depth, bytes of declarations, `tools/list` pages. The
`max_*` fields of an entry set them per configured server; dial-ins use `DEFAULT_TOOL_BOUNDS`.
"""

import re
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

_MAX_SERVERS = 64
SERVER_NAME = re.compile(r"[a-z0-9_-]{1,32}")
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_RESULT_BYTES = 64 * 1024
DEFAULT_MAX_PENDING_CALLS = 32
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
# The MCP tool-name pattern (2025-11-25 spec: `[A-Za-z0-9_.-]`, case-sensitive); others dropped.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@dataclass(frozen=True, slots=True)
class ToolBounds:
    """How much of an external server's tool list the bridge keeps (docs/mcp-servers.md,
    "Bounds"); mirrors a device's `ToolLimits`, tighter since a server is not a device.

    - `max_tools`: tools kept; the rest are dropped (one warning);
    - `max_name_chars`: a longer name, or one outside `[A-Za-z0-9_.-]`, drops the tool;
    - `max_schema_bytes` / `max_schema_depth`: an inputSchema (or outputSchema) over either,
      serialized compactly / nested deeper, drops the tool;
    - `max_tool_bytes`: bytes of declarations read, kept or dropped; past it no further page is
      requested;
    - `max_pages`: `tools/list` pages requested per listing; the tools read so far are kept.
    """

    max_tools: int = 256
    max_name_chars: int = 64
    max_schema_bytes: int = 8 * 1024
    max_schema_depth: int = 8
    max_tool_bytes: int = 1 << 20
    max_pages: int = 16


DEFAULT_TOOL_BOUNDS = ToolBounds()

# `mcp:endpoint` (may dial in) and `mcp:dialin` (every dialed-in server) are scopes of their own
# (backend/keys/store.py), not a server's.
RESERVED_NAMES = frozenset({"endpoint", "dialin"})


def check_server_name(name: str) -> str:
    """`name` if it is a valid server name (`[a-z0-9_-]{1,32}`, not reserved), else ValueError."""
    if not isinstance(name, str) or SERVER_NAME.fullmatch(name) is None:
        raise ValueError(f"an MCP server name is 1 to 32 of [a-z0-9_-], not {str(name)[:40]!r}")
    if name in RESERVED_NAMES:
        raise ValueError(f"the MCP server name {name!r} is reserved")
    return name


class McpServerSettings(BaseModel):
    """One entry of `mcp_servers`: a stdio command or an HTTP URL, and how the bridge treats it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    # stdio
    command: str | None = Field(default=None, min_length=1)
    args: list[str] = Field(default_factory=list)
    env: dict[str, SecretStr] = Field(default_factory=dict)  # over the SDK's safe default env
    cwd: str | None = None
    # Streamable HTTP
    url: str | None = Field(default=None, pattern=r"^https?://")
    headers: dict[str, SecretStr] = Field(default_factory=dict)
    bearer_token: SecretStr | None = None
    # rules and limits
    risky: bool | list[str] | None = None
    device_ids: list[str] | None = None  # None: offered to every device's turns (and the API's)
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=3600)
    connect_timeout_s: float = Field(30.0, gt=0, le=600)
    max_result_bytes: int = Field(DEFAULT_MAX_RESULT_BYTES, ge=256, le=16 << 20)
    max_pending_calls: int = Field(DEFAULT_MAX_PENDING_CALLS, ge=1, le=10_000)
    max_tools: int = Field(DEFAULT_TOOL_BOUNDS.max_tools, ge=1, le=4096)
    max_tool_name_chars: int = Field(DEFAULT_TOOL_BOUNDS.max_name_chars, ge=1, le=128)
    max_schema_bytes: int = Field(DEFAULT_TOOL_BOUNDS.max_schema_bytes, ge=64, le=1 << 20)
    max_schema_depth: int = Field(DEFAULT_TOOL_BOUNDS.max_schema_depth, ge=1, le=64)
    max_tool_bytes: int = Field(DEFAULT_TOOL_BOUNDS.max_tool_bytes, ge=1024, le=16 << 20)
    max_tool_list_pages: int = Field(DEFAULT_TOOL_BOUNDS.max_pages, ge=1, le=256)
    # http: one Server-Sent Event of the server's at most this (the SDK's max_sse_event_size)
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=64 * 1024, le=64 << 20)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_server_name(value)

    @model_validator(mode="after")
    def _one_transport(self) -> "McpServerSettings":
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: set either command (stdio) or url (http)")
        if self.command is not None and (self.headers or self.bearer_token is not None):
            raise ValueError(f"MCP server {self.name!r}: headers and bearer_token need a url")
        if self.url is not None and (self.args or self.env or self.cwd):
            raise ValueError(f"MCP server {self.name!r}: args, env and cwd need a command")
        if self.url is not None and "@" in urlsplit(self.url).netloc:
            # Errors and logs may quote the URL: credentials go in headers or bearer_token.
            raise ValueError(f"MCP server {self.name!r}: no user:password in the url")
        return self

    @property
    def kind(self) -> Literal["stdio", "http"]:
        """`stdio` when a command is set, else `http`."""
        return "stdio" if self.command is not None else "http"

    def tool_bounds(self) -> ToolBounds:
        """The bounds of this server's tool list (its `max_*` fields)."""
        return ToolBounds(
            max_tools=self.max_tools,
            max_name_chars=self.max_tool_name_chars,
            max_schema_bytes=self.max_schema_bytes,
            max_schema_depth=self.max_schema_depth,
            max_tool_bytes=self.max_tool_bytes,
            max_pages=self.max_tool_list_pages,
        )

    def http_headers(self) -> dict[str, str]:
        """The request headers, secrets revealed (for the HTTP client only)."""
        headers = {key: value.get_secret_value() for key, value in self.headers.items()}
        if self.bearer_token is not None:
            headers["Authorization"] = f"Bearer {self.bearer_token.get_secret_value()}"
        return headers


def check_server_list(servers: list[Any]) -> list[Any]:
    """The `mcp_servers` setting's check: at most 64, names unique."""
    if len(servers) > _MAX_SERVERS:
        raise ValueError(f"at most {_MAX_SERVERS} MCP servers")
    names = [server.name for server in servers]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"MCP server names must be unique: {', '.join(duplicates)}")
    return servers
