"""Generated hostile input for what an external MCP server (configured or dialed in) sends the
bridge, and the property each step must keep (issue #32): no exception but the parser's own
escapes, and the bounds hold whatever arrives.

- a dial-in text frame (`backend.mcp_dialin.pipe.parse_frame`): a message, or the close it earns;
  a notification among them goes to `SessionServer.message_handler`;
- `tools/list` pages (validated as the SDK does, then `list_tools_bounded` over up to 3 pages):
  kept tools within every `ToolBounds` bound, whatever the names, schemas and cursors;
- `tools/call` results (validated as the SDK does, then `bounded_result`): text within the cap.

Used by tests/test_mcp_server_bounds.py (2,000 examples) and bench/fuzz.py (100,000).
"""

import asyncio
import json
from typing import Any

import hypothesis.strategies as st
import mcp_types
from pydantic import ValidationError

from backend.mcp_dialin.pipe import CloseInfo, parse_frame
from backend.mcp_servers.hub import (
    TOOL_NAME,
    SessionServer,
    ToolBounds,
    bounded_result,
    json_depth,
    list_tools_bounded,
)
from testkit.fuzzing import deep_nesting, json_values, jsonrpc_shaped

BOUNDS = ToolBounds(
    max_tools=5, max_name_chars=16, max_schema_bytes=300, max_schema_depth=4, max_tool_bytes=4096,
    max_pages=3,
)  # fmt: skip
MAX_RESULT_BYTES = 256
FRAME_BYTES = 64 * 1024
_NOTE = len(b"\n[result cut at 256 bytes]")

names = st.one_of(
    st.text(max_size=24),
    st.text(alphabet="abcXYZ019_.-", min_size=1, max_size=20),
    st.sampled_from(["echo", "a" * 17, "say hi", "ü", "", "x/y", "tab\t"]),
    json_values,
)
schemas = st.one_of(
    json_values,
    st.recursive(
        st.just({"type": "string"}),
        lambda inner: st.builds(lambda s: {"type": "object", "properties": {"a": s}}, inner),
        max_leaves=10,
    ),
    st.builds(lambda n: {"type": "object", "description": "y" * n}, st.integers(0, 1000)),
)
tool_shaped = st.fixed_dictionaries(
    {"name": names, "inputSchema": schemas},
    optional={"description": json_values, "outputSchema": schemas, "annotations": json_values},
)
pages = st.fixed_dictionaries(
    {"tools": st.one_of(st.lists(tool_shaped, max_size=8), json_values)},
    optional={"nextCursor": st.one_of(st.text(max_size=8), st.just("c" * 2000), json_values)},
)
results = st.fixed_dictionaries(
    {
        "content": st.one_of(
            st.lists(
                st.one_of(
                    st.builds(
                        lambda t: {"type": "text", "text": t},
                        st.one_of(st.text(max_size=400), st.just("é" * 300)),
                    ),
                    st.fixed_dictionaries({"type": st.sampled_from(["image", "audio"])}),
                    json_values,
                ),
                max_size=4,
            ),
            json_values,
        )
    },
    optional={"isError": json_values, "structuredContent": json_values},
)
frames = st.one_of(
    st.text(max_size=200),
    deep_nesting(),
    jsonrpc_shaped().map(lambda v: json.dumps(v, allow_nan=True, default=str)),
    st.just('{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}'),
    st.builds(
        lambda n: '{"jsonrpc":"2.0","method":"x","params":{"a":"' + "z" * n + '"}}',
        st.integers(FRAME_BYTES - 100, FRAME_BYTES + 100),
    ),
)
server_inputs = st.one_of(
    st.tuples(st.just("frame"), frames),
    st.tuples(st.just("pages"), st.lists(pages, min_size=1, max_size=3)),
    st.tuples(st.just("result"), results),
)

_loop: asyncio.AbstractEventLoop | None = None


def _run(work: Any) -> Any:
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop.run_until_complete(work)


class _Pages:
    """A session answering tools/list with the generated pages in turn (then the last again)."""

    def __init__(self, wire_pages: list[Any]) -> None:
        self.wire_pages = wire_pages
        self.served = 0

    async def list_tools(self, *, params: Any = None) -> Any:
        wire = self.wire_pages[min(self.served, len(self.wire_pages) - 1)]
        self.served += 1
        return mcp_types.ListToolsResult.model_validate(wire)  # the SDK's own check

    async def call_tool(self, name: str, arguments: Any = None, *_: Any) -> Any:
        raise AssertionError("no call expected")


def check_server_input(kind: str, value: Any) -> None:
    """One input of an external server: no exception but the SDK's ValidationError escapes, and
    the bounds hold."""
    if kind == "frame":
        _run(_check_frame(value))
    elif kind == "pages":
        try:
            listing = _run(list_tools_bounded(_Pages(value), BOUNDS))
        except ValidationError:
            return  # the SDK refuses the page (its own error; the listing fails as a whole)
        assert len(listing.tools) <= BOUNDS.max_tools
        assert listing.pages <= BOUNDS.max_pages
        for tool in listing.tools:
            assert TOOL_NAME.fullmatch(tool.name) and len(tool.name) <= BOUNDS.max_name_chars
            for schema in (tool.input_schema, tool.output_schema):
                if schema is not None:
                    assert json_depth(schema, BOUNDS.max_schema_depth) <= BOUNDS.max_schema_depth
                    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
                    assert size <= BOUNDS.max_schema_bytes
    else:
        try:
            result = mcp_types.CallToolResult.model_validate(value)
        except ValidationError:
            return
        bounded = bounded_result(result, MAX_RESULT_BYTES)
        size = sum(len(item.get("text", "").encode()) for item in bounded.content)
        assert size <= MAX_RESULT_BYTES + _NOTE, size


async def _check_frame(text: str) -> None:
    parsed = parse_frame(text, FRAME_BYTES)
    if isinstance(parsed, CloseInfo):
        assert parsed.code in (1007, 1009)
        return
    message = parsed.message
    if not isinstance(message, mcp_types.JSONRPCNotification):
        return
    try:
        notification = mcp_types.server_notification_adapter.validate_python(
            message.model_dump(by_alias=True, mode="json", exclude_none=True)
        )
    except ValidationError:
        return  # the SDK drops a notification it cannot read
    server = SessionServer("fuzz", kind="dialin", tool_bounds=BOUNDS)
    await server.message_handler(notification)
    server.detach("done")
