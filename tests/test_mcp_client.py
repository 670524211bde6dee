"""McpClient against an in-memory device: correlation, pagination, timeouts, hostile payloads."""

import asyncio
import json
import random
from typing import Any

import pytest
import structlog
from pydantic import ValidationError
from structlog.testing import capture_logs

from backend import __version__
from backend.mcp_session import (
    CallResult,
    DeviceDisconnected,
    DeviceError,
    McpClient,
    ProtocolViolation,
    RequestTimeout,
    TimeoutPolicy,
)
from backend.mcp_session.client import MAX_LIST_PAGES
from testkit.stock_device import StockMcp, stock_tools, text_result
from testkit.stock_device import ok as result
from tests.fakes.mcp_link import Link, feed_json, running_device


def StockDevice(tools: list | None = None, page_size: int = 3) -> StockMcp:
    """The stock MCP semantics with every stock tool, three tools per page."""
    return StockMcp(tools if tools is not None else stock_tools(), page_size)


SECRET = "vision-secret-7f3a9c"


def make_client(**kwargs: Any) -> tuple[McpClient, Link]:
    link = Link()
    return McpClient(link.send, **kwargs), link


async def settle() -> None:
    """Let callbacks scheduled by feed()/close() run (a few loop iterations, no wall clock)."""
    for _ in range(5):
        await asyncio.sleep(0)


def client_tasks(before: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    return {task for task in asyncio.all_tasks() - before if not task.done()}


# ---- initialize ----------------------------------------------------------------------------------


async def test_initialize_sends_handshake_then_initialized_and_stores_server() -> None:
    client, link = make_client()
    async with running_device(client, link, StockDevice()):
        server = await client.initialize()
    init = link.sent[0]
    assert init == {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2024-11-05",
            "capabilities": {},
            "clientInfo": {"name": "esp32-mcp-bridge", "version": __version__},
        },
    }
    assert link.sent[1] == {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert server.protocol_version == "2024-11-05"
    assert server.server_info == {"name": "bread-compact-wifi", "version": "2.4.2"}
    assert (server.server_name, server.server_version) == ("bread-compact-wifi", "2.4.2")
    assert server.capabilities == {"tools": {}}


async def test_initialize_offers_vision_capability() -> None:
    vision = {"url": "http://bridge:8003/vision/explain", "token": SECRET}
    client, link = make_client(vision=vision)
    async with running_device(client, link, StockDevice()):
        await client.initialize()
    assert link.sent[0]["params"]["capabilities"] == {"vision": vision}


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ([1, 2], "not an object"),
        ({"serverInfo": {"name": "x"}}, "protocolVersion"),
        ({"protocolVersion": 2024}, "protocolVersion"),
    ],
)
async def test_initialize_rejects_unusable_result(reply: Any, reason: str) -> None:
    client, link = make_client()
    async with running_device(client, link, lambda m: result(m, reply) if "id" in m else None):
        with pytest.raises(ProtocolViolation, match=reason):
            await client.initialize()
    assert link.notifications("notifications/initialized") == []


async def test_initialize_tolerates_odd_optional_fields() -> None:
    reply = {"protocolVersion": "2025-06-18", "serverInfo": "board", "capabilities": None}
    client, link = make_client()
    async with running_device(client, link, lambda m: result(m, reply) if "id" in m else None):
        server = await client.initialize()
    assert (server.protocol_version, server.server_info, server.capabilities) == (
        "2025-06-18",
        {},
        {},
    )


async def test_initialize_timeout_is_not_cancelled_towards_the_device() -> None:
    client, link = make_client()
    with pytest.raises(RequestTimeout) as caught:
        await client.initialize(timeout_s=0.01)
    assert (caught.value.method, caught.value.tool, caught.value.timeout_s) == (
        "initialize",
        None,
        0.01,
    )
    assert link.notifications("notifications/cancelled") == []
    assert client.pending_count == 0


# ---- tools/list ----------------------------------------------------------------------------------


async def test_list_tools_follows_cursors_over_pages() -> None:
    device = StockDevice(page_size=2)
    client, link = make_client()
    async with running_device(client, link, device):
        tools = await client.list_tools()
    pages = link.requests("tools/list")
    assert [page["params"] for page in pages] == [
        {"cursor": ""},
        {"cursor": "self.screen.set_brightness"},
        {"cursor": "self.led.set"},
    ]
    assert [tool.name for tool in tools] == [tool["name"] for tool in stock_tools()[:5]]
    assert [page["id"] for page in pages] == [1, 2, 3]


async def test_list_tools_with_user_tools_sends_the_flag_on_every_page() -> None:
    client, link = make_client()
    async with running_device(client, link, StockDevice(page_size=3)):
        tools = await client.list_tools(with_user_tools=True)
    pages = link.requests("tools/list")
    assert len(pages) == 3
    assert all(page["params"]["withUserTools"] is True for page in pages)
    assert [tool.name for tool in tools][-2:] == ["self.get_system_info", "self.reboot"]
    assert tools[-1].annotations == {"audience": ["user"]}


async def test_list_tools_keeps_schemas_whole_and_unicode_intact() -> None:
    schema = {
        "type": "object",
        "properties": {"mode": {"type": "string", "enum": ["a", "b"]}},
        "required": ["mode"],
        "additionalProperties": False,
        "$defs": {"x": {"type": "integer"}},
    }
    raw = [{"name": "灯.开关", "description": "打开灯 💡", "inputSchema": schema}]
    client, link = make_client()
    async with running_device(client, link, StockDevice(raw)):
        (tool,) = await client.list_tools()
    assert (tool.name, tool.description, tool.input_schema) == ("灯.开关", "打开灯 💡", schema)
    assert tool.to_wire() == raw[0]


@pytest.mark.parametrize("last_cursor", [None, ""])
async def test_list_tools_treats_null_and_empty_cursor_as_the_end(last_cursor: Any) -> None:
    def device(message: dict[str, Any]) -> dict[str, Any] | None:
        if "id" not in message:
            return None
        if message["params"]["cursor"] == "":
            return result(message, {"tools": [{"name": "a"}], "nextCursor": "p2"})
        return result(message, {"tools": [{"name": "b"}], "nextCursor": last_cursor})

    client, link = make_client()
    async with running_device(client, link, device):
        tools = await client.list_tools()
    assert [tool.name for tool in tools] == ["a", "b"]
    assert len(link.requests("tools/list")) == 2


async def test_list_tools_repeated_cursor_is_a_protocol_violation() -> None:
    cursors = {"": "c1", "c1": "c2", "c2": "c1"}

    def device(message: dict[str, Any]) -> dict[str, Any] | None:
        if "id" not in message:
            return None
        cursor = message["params"]["cursor"]
        return result(message, {"tools": [{"name": f"t{cursor}"}], "nextCursor": cursors[cursor]})

    client, link = make_client()
    async with running_device(client, link, device):
        with pytest.raises(ProtocolViolation, match="repeated a cursor"):
            await client.list_tools()
    assert len(link.requests("tools/list")) == 3


async def test_list_tools_gives_up_after_64_pages() -> None:
    def device(message: dict[str, Any]) -> dict[str, Any] | None:
        if "id" not in message:
            return None
        return result(message, {"tools": [], "nextCursor": f"page-{message['id']}"})

    client, link = make_client()
    async with running_device(client, link, device):
        with pytest.raises(ProtocolViolation, match="64 pages"):
            await client.list_tools()
    assert len(link.requests("tools/list")) == MAX_LIST_PAGES == 64


async def test_list_tools_accepts_exactly_64_pages() -> None:
    def device(message: dict[str, Any]) -> dict[str, Any] | None:
        if "id" not in message:
            return None
        page = message["id"]
        reply: dict[str, Any] = {"tools": [{"name": f"t{page}"}]}
        if page < 64:
            reply["nextCursor"] = f"page-{page}"
        return result(message, reply)

    client, link = make_client()
    async with running_device(client, link, device):
        tools = await client.list_tools()
    assert len(tools) == 64


@pytest.mark.parametrize(
    ("page", "reason"),
    [
        ("tools", "result is a string"),
        ([], "result is an array"),
        ({}, "tools is null"),
        ({"tools": {"name": "x"}}, "tools is an object"),
        ({"tools": [], "nextCursor": 2}, "nextCursor is a number"),
    ],
)
async def test_list_tools_rejects_malformed_pages(page: Any, reason: str) -> None:
    client, link = make_client()
    async with running_device(client, link, lambda m: result(m, page) if "id" in m else None):
        with pytest.raises(ProtocolViolation, match=reason):
            await client.list_tools()


async def test_list_tools_drops_or_repairs_bad_tools_one_by_one() -> None:
    default_schema = {"type": "object", "properties": {}}
    raw: list[Any] = [
        {"name": "ok", "inputSchema": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "not a tool",
        {"description": "no name"},
        {"name": "", "inputSchema": default_schema},
        {"name": 7},
        {"name": "no_schema"},
        {"name": "string_schema", "inputSchema": "object"},
        {"name": "array_type", "inputSchema": {"type": "array"}},
        {"name": "bad_props", "inputSchema": {"type": "object", "properties": []}},
        {"name": "bad_required", "inputSchema": {"type": "object", "required": [1]}},
        {"name": "bad_description", "description": 5, "inputSchema": default_schema},
        {"name": "ok", "description": "duplicate", "inputSchema": default_schema},
    ]
    client, link = make_client()
    with capture_logs() as logs:
        async with running_device(client, link, StockDevice(raw, page_size=100)):
            tools = await client.list_tools()
    names = [tool.name for tool in tools]
    assert names == [
        "ok",
        "no_schema",
        "string_schema",
        "array_type",
        "bad_props",
        "bad_required",
        "bad_description",
    ]
    assert tools[0].input_schema["properties"] == {"x": {"type": "integer"}}
    assert tools[0].description == ""
    assert all(tool.input_schema == default_schema for tool in tools[1:])
    events = [entry["event"] for entry in logs]
    # Three lines of each problem, then one counted summary (a hostile list costs a few lines).
    assert events.count("tool dropped") == 3
    assert events.count("tool schema replaced by an empty one") == 3
    summaries = {e["event"]: e for e in logs if e["event"].endswith("(repeated)")}
    assert summaries["tool dropped (repeated)"]["total"] == 4
    assert summaries["tool schema replaced by an empty one (repeated)"]["total"] == 5
    assert events.count("duplicate tool name; keeping the first") == 1


async def test_identical_tool_declarations_are_shared_between_devices() -> None:
    listed = []
    for _device in range(2):
        client, link = make_client()
        async with running_device(client, link, StockDevice()):
            listed.append(await client.list_tools())
    first, second = listed
    assert [tool.name for tool in first] == [tool.name for tool in second]
    assert all(a is b for a, b in zip(first, second, strict=True))
    changed = stock_tools()
    changed[0]["description"] = "Another firmware's wording"
    client, link = make_client()
    async with running_device(client, link, StockDevice(changed)):
        third = await client.list_tools()
    assert third[0] is not first[0] and third[0].description == "Another firmware's wording"
    assert third[1] is first[1]
    with pytest.raises(ValidationError):
        first[0].name = "renamed"  # type: ignore[misc]


# ---- tools/call: correlation ---------------------------------------------------------------------


async def test_replies_out_of_order_reach_their_own_callers() -> None:
    client, link = make_client()
    calls = [asyncio.create_task(client.call_tool(f"t{i}", {"i": i})) for i in range(3)]
    requests = [await link.next_request() for _ in range(3)]
    assert [request["id"] for request in requests] == [1, 2, 3]
    for request in reversed(requests):
        feed_json(client, result(request, text_result(request["params"]["name"])))
    results = await asyncio.gather(*calls)
    assert [r.text for r in results] == ["t0", "t1", "t2"]
    assert client.pending_count == 0


async def test_200_concurrent_calls_each_get_their_own_reply() -> None:
    client, link = make_client()
    calls = [asyncio.create_task(client.call_tool("echo", {"n": n})) for n in range(200)]
    requests = [await link.next_request() for _ in range(200)]
    assert client.pending_count == 200
    random.Random(7).shuffle(requests)
    for request in requests:
        feed_json(client, result(request, text_result(str(request["params"]["arguments"]["n"]))))
    results = await asyncio.gather(*calls)
    assert [r.text for r in results] == [str(n) for n in range(200)]
    assert len({request["id"] for request in requests}) == 200
    assert client.pending_count == 0


async def test_batch_replies_are_processed_element_by_element() -> None:
    client, link = make_client()
    calls = [asyncio.create_task(client.call_tool(f"t{i}")) for i in range(2)]
    first, second = [await link.next_request() for _ in range(2)]
    feed_json(client, [result(second, text_result("2")), "junk", result(first, text_result("1"))])
    assert [r.text for r in await asyncio.gather(*calls)] == ["1", "2"]


@pytest.mark.parametrize("echoed", [1.0, "1"])
async def test_integral_float_and_decimal_string_ids_match(echoed: Any) -> None:
    client, link = make_client()
    call = asyncio.create_task(client.call_tool("t"))
    await link.next_request()
    feed_json(client, {"jsonrpc": "2.0", "id": echoed, "result": text_result("ok")})
    assert (await call).text == "ok"


@pytest.mark.parametrize("echoed", [True, "01", " 1", "1.0", 1.5, "١", None, [1], {"id": 1}])
async def test_other_id_forms_never_match(echoed: Any) -> None:
    client, link = make_client()
    call = asyncio.create_task(client.call_tool("t"))
    request = await link.next_request()
    assert request["id"] == 1
    feed_json(client, {"jsonrpc": "2.0", "id": echoed, "result": text_result("wrong")})
    await settle()
    assert not call.done()
    feed_json(client, result(request, text_result("right")))
    assert (await call).text == "right"


async def test_a_duplicate_reply_is_dropped_as_late() -> None:
    client, link = make_client()
    call = asyncio.create_task(client.call_tool("t"))
    request = await link.next_request()
    with capture_logs() as logs:
        feed_json(client, result(request, text_result("first")))
        feed_json(client, result(request, text_result("second")))
    assert (await call).text == "first"
    assert [e["event"] for e in logs] == ["late MCP reply dropped"]
    assert logs[0]["request_id"] == 1


# ---- timeouts ------------------------------------------------------------------------------------


async def test_timeout_cancels_on_the_device_and_drops_the_late_reply() -> None:
    client, link = make_client()
    with pytest.raises(RequestTimeout) as caught:
        await client.call_tool("self.slow", {}, timeout_s=0.01)
    assert (caught.value.method, caught.value.tool, caught.value.timeout_s) == (
        "tools/call",
        "self.slow",
        0.01,
    )
    assert "self.slow" in str(caught.value)
    timed_out = link.requests("tools/call")[0]
    assert link.notifications("notifications/cancelled") == [
        {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": timed_out["id"], "reason": "timeout after 0.01s"},
        }
    ]
    assert client.pending_count == 0

    # The next call is pending when the late reply arrives: it must not be resolved by it.
    next_call = asyncio.create_task(client.call_tool("self.fast"))
    _first, fresh = [await link.next_request() for _ in range(2)]
    assert fresh["id"] == timed_out["id"] + 1
    with capture_logs() as logs:
        feed_json(client, result(timed_out, text_result("late")))
    await settle()
    assert not next_call.done()
    assert [e["event"] for e in logs] == ["late MCP reply dropped"]
    feed_json(client, result(fresh, text_result("fresh")))
    assert (await next_call).text == "fresh"


async def test_per_tool_timeout_overrides_the_default_and_explicit_wins() -> None:
    policy = TimeoutPolicy(default_s=60, per_tool={"self.camera.take_photo": 0.01})
    client, link = make_client(timeouts=policy)
    with pytest.raises(RequestTimeout) as caught:
        await client.call_tool("self.camera.take_photo", {"question": "?"})
    assert caught.value.timeout_s == 0.01

    # An explicit timeout beats the per-tool one, and other tools get the 60 s default. Both calls
    # are sent before the 0.01 s call below starts, so a 0.01 s deadline of theirs would be
    # earlier than its deadline and would have fired by the time it raises.
    photo = asyncio.create_task(client.call_tool("self.camera.take_photo", timeout_s=60))
    other = asyncio.create_task(client.call_tool("self.get_device_status"))
    await settle()
    assert len(link.requests("tools/call")) == 3
    with pytest.raises(RequestTimeout) as caught:
        await client.call_tool("self.reboot", timeout_s=0.01)
    assert caught.value.timeout_s == 0.01
    assert not photo.done() and not other.done()
    for request in link.requests("tools/call"):
        if request["params"]["name"] != "self.reboot":
            feed_json(client, result(request, text_result(request["params"]["name"])))
    assert (await photo).text == "self.camera.take_photo"
    assert (await other).text == "self.get_device_status"


def test_timeout_policy_validates_values() -> None:
    assert TimeoutPolicy().for_tool("x") == 10.0
    assert TimeoutPolicy(per_tool={"x": 30}).for_tool("x") == 30.0
    for bad in ({"default_s": 0}, {"default_s": -1}, {"per_tool": {"x": 0}}, {"other": 1}):
        with pytest.raises(ValidationError):
            TimeoutPolicy(**bad)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
async def test_invalid_explicit_timeouts_are_rejected_before_sending(bad: float) -> None:
    client, link = make_client()
    with pytest.raises(ValueError, match="timeout_s"):
        await client.call_tool("t", timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s"):
        await client.request("ping", timeout_s=bad)
    assert link.sent == []


async def test_caller_cancellation_removes_the_entry_and_cancels_on_the_device() -> None:
    client, link = make_client()
    call = asyncio.create_task(client.call_tool("t"))
    request = await link.next_request()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await settle()
    assert client.pending_count == 0
    assert link.notifications("notifications/cancelled")[0]["params"] == {
        "requestId": request["id"],
        "reason": "cancelled by caller",
    }


# ---- results and errors --------------------------------------------------------------------------


async def test_stock_error_without_code_becomes_device_error() -> None:
    client, link = make_client()
    async with running_device(client, link, StockDevice()):
        with pytest.raises(DeviceError) as caught:
            await client.call_tool("self.nope")
    assert (caught.value.code, caught.value.message) == (None, "Unknown tool: self.nope")
    assert str(caught.value) == "Unknown tool: self.nope"


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        ({"code": -32603, "message": "Internal error", "data": {"x": 1}}, -32603, "Internal error"),
        ({"code": -32601.0, "message": "nope"}, -32601, "nope"),
        ({"code": "E1", "message": "odd code"}, None, "odd code"),
        ({"code": True, "message": "bool code"}, None, "bool code"),
        ({"code": -32000}, -32000, "device error without a message (code -32000)"),
        ({"message": ""}, None, "device error without a message"),
        ({"message": 42}, None, "device error without a message"),
        ("boom", None, "malformed error from device: boom"),
        (42, None, "malformed error from device (a number)"),
        ([1], None, "malformed error from device (an array)"),
        (False, None, "malformed error from device (a boolean)"),
    ],
)
async def test_error_shapes_become_device_errors(error: Any, code: Any, message: str) -> None:
    client, link = make_client()
    call = asyncio.create_task(client.call_tool("t"))
    request = await link.next_request()
    feed_json(client, {"jsonrpc": "2.0", "id": request["id"], "error": error})
    with pytest.raises(DeviceError) as caught:
        await call
    assert (caught.value.code, caught.value.message) == (code, message)
    if isinstance(error, dict) and "data" in error:
        assert caught.value.data == error["data"]


async def test_error_null_next_to_a_result_is_a_success() -> None:
    client, link = make_client()
    call = asyncio.create_task(client.call_tool("t"))
    request = await link.next_request()
    feed_json(client, {"id": request["id"], "error": None, "result": text_result("ok")})
    assert (await call).text == "ok"


async def test_is_error_results_are_returned_not_raised() -> None:
    client, link = make_client()
    call = asyncio.create_task(client.call_tool("t"))
    request = await link.next_request()
    feed_json(client, result(request, text_result("motor jammed", is_error=True)))
    outcome = await call
    assert outcome == CallResult(
        content=[{"type": "text", "text": "motor jammed"}],
        is_error=True,
        raw=text_result("motor jammed", is_error=True),
    )


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        ({}, CallResult(raw={})),
        ({"content": None, "isError": None}, CallResult(raw={"content": None, "isError": None})),
        (
            {"content": [{"type": "text", "text": "温度 23℃ ✓"}], "structuredContent": {"t": 23}},
            CallResult(
                content=[{"type": "text", "text": "温度 23℃ ✓"}],
                structured_content={"t": 23},
                raw={
                    "content": [{"type": "text", "text": "温度 23℃ ✓"}],
                    "structuredContent": {"t": 23},
                },
            ),
        ),
    ],
)
async def test_call_results_are_read_leniently(wire: dict[str, Any], expected: CallResult) -> None:
    client, link = make_client()
    call = asyncio.create_task(client.call_tool("t"))
    request = await link.next_request()
    feed_json(client, result(request, wire))
    assert await call == expected


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        ("true", "result is a string"),
        (None, "result is null"),
        ({"content": "true"}, "content is a string"),
        ({"content": ["true"]}, "content item is a string"),
        ({"content": [], "isError": "false"}, "isError is a string"),
        ({"content": [], "isError": 1}, "isError is a number"),
    ],
)
async def test_malformed_call_results_are_protocol_violations(wire: Any, reason: str) -> None:
    client, link = make_client()
    call = asyncio.create_task(client.call_tool("t"))
    request = await link.next_request()
    feed_json(client, result(request, wire))
    with pytest.raises(ProtocolViolation, match=reason):
        await call
    assert client.pending_count == 0


async def test_reply_with_neither_result_nor_error_fails_its_request() -> None:
    client, link = make_client()
    call = asyncio.create_task(client.request("custom/thing"))
    request = await link.next_request()
    feed_json(client, {"jsonrpc": "2.0", "id": request["id"]})
    with pytest.raises(ProtocolViolation, match="neither result nor error"):
        await call


async def test_request_returns_the_raw_result() -> None:
    client, link = make_client()
    call = asyncio.create_task(client.request("custom/thing", {"a": [1, "ü"]}))
    request = await link.next_request()
    assert request["params"] == {"a": [1, "ü"]}
    feed_json(client, result(request, ["any", "json"]))
    assert await call == ["any", "json"]


async def test_non_dict_arguments_are_refused_before_sending() -> None:
    client, link = make_client()
    with pytest.raises(TypeError, match="dict"):
        await client.call_tool("t", ["volume", 3])  # type: ignore[arg-type]
    assert link.sent == []


# ---- messages from the device --------------------------------------------------------------------


async def test_list_changed_runs_a_sync_callback() -> None:
    seen: list[str] = []
    client, _link = make_client(on_tools_changed=lambda: seen.append("changed"))
    feed_json(client, {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
    assert seen == ["changed"]


async def test_list_changed_async_callback_relists_tools() -> None:
    device = StockDevice(stock_tools()[:2])
    relisted: list[list[str]] = []

    async def on_changed() -> None:
        relisted.append([tool.name for tool in await client.list_tools()])

    client, link = make_client(on_tools_changed=on_changed)
    async with running_device(client, link, device):
        assert len(await client.list_tools()) == 2
        device.tools = stock_tools()[:4]
        before = set(asyncio.all_tasks())
        feed_json(client, {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        spawned = client_tasks(before)
        assert len(spawned) == 1
        await asyncio.gather(*spawned)
    assert relisted == [[tool["name"] for tool in stock_tools()[:4]]]


async def test_callback_failures_are_logged_never_raised() -> None:
    async def failing_async() -> None:
        raise RuntimeError("async boom")

    def failing_sync() -> None:
        raise RuntimeError("sync boom")

    notice = {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}
    with capture_logs() as logs:
        for callback in (failing_sync, failing_async):
            client, _link = make_client(on_tools_changed=callback)
            feed_json(client, notice)
            await settle()
    failures = [e for e in logs if e["log_level"] in ("error", "critical")]
    assert [e["event"] for e in failures] == [
        "on_tools_changed callback failed",
        "MCP background task failed",
    ]
    assert "async boom" in repr(failures[1]["exc_info"])


async def test_device_requests_get_method_not_found() -> None:
    client, link = make_client()
    feed_json(client, {"jsonrpc": "2.0", "id": 5, "method": "sampling/createMessage"})
    feed_json(client, {"jsonrpc": "2.0", "id": "abc", "method": "roots/list", "params": {}})
    await settle()
    assert link.sent == [
        {
            "jsonrpc": "2.0",
            "id": 5,
            "error": {"code": -32601, "message": "Method not found: sampling/createMessage"},
        },
        {
            "jsonrpc": "2.0",
            "id": "abc",
            "error": {"code": -32601, "message": "Method not found: roots/list"},
        },
    ]


async def test_ping_from_the_device_gets_an_empty_result() -> None:
    client, link = make_client()
    feed_json(client, {"jsonrpc": "2.0", "id": 9, "method": "ping"})
    await settle()
    assert link.sent == [{"jsonrpc": "2.0", "id": 9, "result": {}}]


async def test_device_notifications_get_no_reply() -> None:
    client, link = make_client()
    for method in ("notifications/progress", "notifications/message", "notifications/cancelled"):
        feed_json(client, {"jsonrpc": "2.0", "method": method, "params": {"x": 1}})
    feed_json(client, {"jsonrpc": "2.0", "method": "ping", "id": None})
    await settle()
    assert link.sent == []


def test_device_request_without_running_loop_is_dropped_quietly() -> None:
    client = McpClient(Link().send)
    with capture_logs() as logs:
        client.feed({"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert "no event loop; background work dropped" in [e["event"] for e in logs]


GARBAGE: list[Any] = [
    "{not json}",
    '{"jsonrpc":"2.0","id":1,"result":{}}',
    0,
    1,
    -3.5,
    None,
    True,
    [],
    [None, [1, 2], "x"],
    [[{"jsonrpc": "2.0", "id": 1, "result": {}}]],
    {},
    {"jsonrpc": "2.0"},
    {"id": 99},
    {"id": True, "result": {}},
    {"id": {"n": 1}, "result": {}},
    {"id": [1], "error": {"message": "x"}},
    {"id": None, "error": {"message": "parse error"}},
    {"id": None, "error": "parse error"},
    {"id": 99, "result": {}},
    {"id": -1, "result": {}},
    {"id": 10**30, "result": {}},
    {"id": "9" * 40, "result": {}},
    {"id": float("inf"), "result": {}},
    {"method": 5},
    {"method": None, "id": 1},
    {"method": ["ping"], "id": 3},
    {"method": "ping", "id": {"x": 1}},
    {"method": "ping", "id": [1]},
    {"method": "ping", "id": True},
    {"method": "notifications/tools/list_changed", "params": "x"},
    {"result": {"content": []}},
]


@pytest.mark.parametrize("payload", GARBAGE, ids=repr)
async def test_garbage_never_raises_and_leaves_pending_calls_alone(payload: Any) -> None:
    client, link = make_client()
    call = asyncio.create_task(client.call_tool("t"))
    request = await link.next_request()
    client.feed(payload)  # not through JSON: also covers values JSON cannot carry
    await settle()
    assert not call.done()
    assert client.pending_count == 1
    assert [m for m in link.sent if "method" not in m] == []  # nothing answered
    feed_json(client, result(request, text_result("fine")))
    assert (await call).text == "fine"


# ---- disconnects ---------------------------------------------------------------------------------


async def test_close_fails_every_pending_call_at_once_and_leaves_nothing_behind() -> None:
    before = set(asyncio.all_tasks())
    client, link = make_client()
    calls = [asyncio.create_task(client.call_tool(f"t{i}", timeout_s=60)) for i in range(5)]
    listing = asyncio.create_task(client.list_tools())
    for _ in range(6):
        await link.next_request()
    assert client.pending_count == 6
    client.close("socket closed")
    assert client.pending_count == 0
    outcomes = await asyncio.gather(*calls, listing, return_exceptions=True)
    assert all(isinstance(o, DeviceDisconnected) for o in outcomes)
    assert all(o.reason == "socket closed" for o in outcomes)  # type: ignore[union-attr]
    await settle()
    assert client_tasks(before) == set()
    assert client.closed
    assert link.notifications("notifications/cancelled") == []


async def test_calls_after_close_fail_immediately_without_sending() -> None:
    client, link = make_client()
    client.close("replaced by a new connection")
    client.close("second close is a no-op")
    for attempt in (
        client.call_tool("t"),
        client.list_tools(),
        client.initialize(),
        client.request("ping"),
        client.notify("notifications/x"),
    ):
        with pytest.raises(DeviceDisconnected, match="replaced by a new connection"):
            await attempt
    assert link.sent == []


async def test_close_cancels_background_work_of_the_client() -> None:
    release = asyncio.Event()

    async def slow_callback() -> None:
        await release.wait()

    before = set(asyncio.all_tasks())
    client, _link = make_client(on_tools_changed=slow_callback)
    feed_json(client, {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
    await settle()
    assert len(client_tasks(before)) == 1
    client.close("gone")
    await settle()
    assert client_tasks(before) == set()


async def test_messages_after_close_are_ignored() -> None:
    seen: list[int] = []
    client, link = make_client(on_tools_changed=lambda: seen.append(1))
    client.close("gone")
    feed_json(client, {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
    feed_json(client, {"jsonrpc": "2.0", "id": 1, "method": "ping"})
    await settle()
    assert (seen, link.sent) == ([], [])


async def test_send_failure_fails_the_call_as_disconnected() -> None:
    client, link = make_client()
    link.fail_with = ConnectionResetError("peer reset")
    with pytest.raises(DeviceDisconnected, match="peer reset") as caught:
        await client.call_tool("t")
    assert isinstance(caught.value.__cause__, ConnectionResetError)
    assert client.pending_count == 0
    with pytest.raises(DeviceDisconnected):
        await client.notify("notifications/initialized")
    link.fail_with = None
    call = asyncio.create_task(client.call_tool("t"))
    request = await link.next_request()
    assert request["id"] == 2  # the failed request's id is not reused
    feed_json(client, result(request, text_result("back")))
    assert (await call).text == "back"


async def test_failing_cancel_notice_still_raises_the_timeout() -> None:
    attempts: list[dict[str, Any]] = []

    async def send(payload: dict[str, Any]) -> None:
        attempts.append(payload)
        if payload.get("method") == "notifications/cancelled":
            raise OSError("link down")

    client = McpClient(send)
    with pytest.raises(RequestTimeout):
        await client.call_tool("t", timeout_s=0.01)
    assert [a.get("method") for a in attempts] == ["tools/call", "notifications/cancelled"]


# ---- logs ----------------------------------------------------------------------------------------


async def test_vision_token_never_reaches_the_logs() -> None:
    vision = {"url": "http://bridge/vision", "token": SECRET}
    with capture_logs() as logs:
        log = structlog.get_logger("mcp").bind(device_id="dev-1")
        client, link = make_client(vision=vision, log=log)
        async with running_device(client, link, StockDevice()):
            await client.initialize()
            await client.list_tools(with_user_tools=True)
            with pytest.raises(DeviceError):
                await client.call_tool("self.missing")
        with pytest.raises(RequestTimeout):
            await client.call_tool("t", timeout_s=0.01)
        for payload in GARBAGE:
            client.feed(payload)
        client.close("done")
    assert link.sent[0]["params"]["capabilities"]["vision"]["token"] == SECRET
    assert logs, "the scenario should have produced some log lines"
    assert SECRET not in json.dumps(logs, default=repr)


async def test_a_tool_list_past_the_limits_is_cut_and_not_paged_further() -> None:
    from backend.mcp_session.models import ToolLimits

    many = [
        {"name": f"t{i:02d}", "description": "d" * 100, "inputSchema": {"type": "object"}}
        for i in range(30)
    ]
    client, link = make_client()
    with capture_logs() as logs:
        async with running_device(client, link, StockDevice(many, page_size=4)):
            by_count = await client.list_tools(limits=ToolLimits(max_tools=10))
            pages_by_count = len(link.requests("tools/list"))
            by_bytes = await client.list_tools(limits=ToolLimits(max_bytes=1500))
    assert [tool.name for tool in by_count] == [f"t{i:02d}" for i in range(10)]
    assert pages_by_count == 3  # 12 declarations read, the rest never requested
    assert 0 < len(by_bytes) < 10 and by_bytes[0].name == "t00"
    assert [e["event"] for e in logs].count("tool list truncated") == 2
