import asyncio
import json

import mcp_server
from fw_support import all_tool_names, call_tool, error_of, list_page, request, tool_text, utf8_len
from mcp_server import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    AsyncCall,
    McpServer,
    boolean,
    integer,
    string,
)
from tinytest import TestCase


def _server():
    return McpServer("test-board", "1.2.3")


class _Recorder:
    """A tool handler that remembers the arguments it got and returns a fixed value."""

    def __init__(self, value=True):
        self.value = value
        self.calls = []

    def __call__(self, args):
        self.calls.append(args)
        return self.value


class _Raiser:
    def __init__(self, error):
        self.error = error

    def __call__(self, args):
        raise self.error


def _synthetic_tools(server, count, description_bytes):
    names = []
    for index in range(count):
        name = "self.synthetic.tool_" + str(index)
        description = "d" * description_bytes
        server.add_tool(name, description, [integer("level", 5, 0, 9)], _Recorder(index))
        names.append(name)
    return names


def _add_tool_of_size(server, name, size, user_only=False):
    """Register a tool whose listed JSON (annotations included) is exactly `size` bytes."""
    probe = _server()
    probe.add_tool(name, "", [], _Recorder(), user_only)
    empty = utf8_len(list_page(probe, with_user_tools=True)["tools"][0])
    server.add_tool(name, "x" * (size - empty), [], _Recorder(), user_only)
    assert utf8_len(list_page(server, name, with_user_tools=True)["tools"][0]) == size


class InitializeTest(TestCase):
    def test_fixed_result_with_server_identity(self):
        reply = _server().handle_message(request("initialize", {"protocolVersion": "2025-11-25"}))
        self.assertEqual(reply["id"], 1)
        self.assertEqual(
            reply["result"],
            {
                "protocolVersion": "2024-11-05",
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "test-board", "version": "1.2.3"},
            },
        )

    def test_reads_vision_url_and_token(self):
        server = _server()
        vision = {"url": "http://host:8003/vision/explain", "token": "abc"}
        server.handle_message(request("initialize", {"capabilities": {"vision": vision}}))
        self.assertEqual(server.vision_url, "http://host:8003/vision/explain")
        self.assertEqual(server.vision_token, "abc")

    def test_vision_without_token_clears_token(self):
        server = _server()
        server.vision_token = "old"
        vision = {"url": "https://host/v"}
        server.handle_message(request("initialize", {"capabilities": {"vision": vision}}))
        self.assertEqual(server.vision_url, "https://host/v")
        self.assertIsNone(server.vision_token)

    def test_ignores_unusable_vision(self):
        server = _server()
        for capabilities in (
            {"vision": {"url": "ws://host/v", "token": "t"}},
            {"vision": {"url": 5}},
            {"vision": "http://host/v"},
            "not an object",
        ):
            reply = server.handle_message(request("initialize", {"capabilities": capabilities}))
            self.assertEqual(reply["result"]["protocolVersion"], "2024-11-05")
        self.assertIsNone(server.vision_url)
        self.assertIsNone(server.vision_token)

    def test_without_params(self):
        reply = _server().handle_message(request("initialize"))
        self.assertEqual(reply["result"]["serverInfo"]["name"], "test-board")


class EnvelopeTest(TestCase):
    def test_ping_answers_empty_result(self):
        self.assertEqual(
            _server().handle_message(request("ping", request_id=7)),
            {"jsonrpc": "2.0", "id": 7, "result": {}},
        )

    def test_string_id_is_answered(self):
        reply = _server().handle_message(request("ping", request_id="req-1"))
        self.assertEqual(reply["id"], "req-1")
        self.assertEqual(reply["result"], {})

    def test_unknown_method(self):
        reply = _server().handle_message(request("resources/list", request_id=3))
        self.assertEqual(reply["id"], 3)
        self.assertEqual(
            error_of(reply), (METHOD_NOT_FOUND, "Method not implemented: resources/list")
        )

    def test_error_codes_are_json_rpc_codes(self):
        self.assertEqual(
            (PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR),
            (-32700, -32600, -32601, -32602, -32603),
        )

    def test_notifications_get_no_reply(self):
        server = _server()
        notification = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        self.assertIsNone(server.handle_message(notification))
        with_id = {"jsonrpc": "2.0", "id": 4, "method": "notifications/cancelled"}
        self.assertIsNone(server.handle_message(with_id))
        self.assertIsNone(server.handle_message({"jsonrpc": "2.0", "method": "tools/list"}))

    def test_batch_is_rejected_with_null_id(self):
        for batch in ([request("ping")], []):
            reply = _server().handle_message(batch)
            self.assertIsNone(reply["id"])
            self.assertEqual(error_of(reply)[0], INVALID_REQUEST)
            self.assertIn("Batch", error_of(reply)[1])

    def test_non_object_messages_are_invalid_requests(self):
        for message in (1, "ping", None, True, 2.5):
            reply = _server().handle_message(message)
            self.assertIsNone(reply["id"], message)
            self.assertEqual(error_of(reply)[0], INVALID_REQUEST, message)

    def test_wrong_jsonrpc_version(self):
        server = _server()
        for version in ("1.0", 2.0, None):
            reply = server.handle_message({"jsonrpc": version, "id": 9, "method": "ping"})
            self.assertEqual(reply["id"], 9)
            self.assertEqual(error_of(reply)[0], INVALID_REQUEST)
            self.assertIn("jsonrpc", error_of(reply)[1])
        self.assertEqual(error_of(server.handle_message({"id": 9, "method": "ping"}))[0], -32600)
        self.assertIsNone(server.handle_message({"jsonrpc": "1.0", "method": "ping"}))

    def test_method_must_be_a_string(self):
        server = _server()
        reply = server.handle_message({"jsonrpc": "2.0", "id": 2, "method": 5})
        self.assertEqual((reply["id"], error_of(reply)[0]), (2, INVALID_REQUEST))
        self.assertIn("method", error_of(reply)[1])
        self.assertIsNone(server.handle_message({"jsonrpc": "2.0", "method": ["x"]}))

    def test_unusable_ids_are_invalid_requests(self):
        for bad_id in (None, True, False, {"a": 1}, [1]):
            reply = _server().handle_message(request("ping", request_id=bad_id))
            self.assertIsNone(reply["id"], bad_id)
            self.assertEqual(error_of(reply)[0], INVALID_REQUEST, bad_id)

    def test_non_finite_ids_are_not_usable(self):
        # NaN and the infinities cannot go back in JSON; some parsers still produce them.
        for bad_id in (float("nan"), float("inf"), float("-inf")):
            reply = _server().handle_message(request("ping", request_id=bad_id))
            self.assertIsNone(reply["id"], bad_id)
            self.assertEqual(error_of(reply)[0], INVALID_REQUEST, bad_id)
        self.assertEqual(_server().handle_message(request("ping", request_id=2.5))["id"], 2.5)

    def test_long_names_are_clipped_in_error_messages(self):
        server = _server()
        clipped = "m" * mcp_server.ECHO_CHARS + "..."
        reply = server.handle_message(request("m" * 5000))
        self.assertEqual(error_of(reply), (METHOD_NOT_FOUND, "Method not implemented: " + clipped))
        reply = call_tool(server, "m" * 5000)
        self.assertEqual(error_of(reply), (INVALID_PARAMS, "Unknown tool: " + clipped))
        reply = server.handle_message(request("tools/list", {"cursor": "m" * 5000}))
        self.assertEqual(error_of(reply), (INVALID_PARAMS, "Unknown cursor: " + clipped))
        exact = "m" * mcp_server.ECHO_CHARS  # at the limit: repeated as it is
        self.assertEqual(error_of(call_tool(server, exact))[1], "Unknown tool: " + exact)

    def test_params_must_be_an_object(self):
        server = _server()
        for method in ("initialize", "tools/list"):
            reply = server.handle_message(request(method, [1, 2]))
            self.assertEqual(error_of(reply)[0], INVALID_PARAMS, method)

    def test_garbage_never_raises(self):
        server = _server()
        server.add_tool("self.t", "t", [integer("n", minimum=0, maximum=3)], _Recorder())
        for message in ({}, {"jsonrpc": "2.0"}, {"params": 5}, {"method": "ping"}):
            self.assertIsNone(server.handle_message(message), message)
        samples = [
            {"id": 1},
            {"jsonrpc": "2.0", "id": 1},
            {"jsonrpc": "2.0", "id": 1, "method": ""},
            {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": None},
            {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": None}},
            {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"cursor": {}}},
            {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"cursor": "x" * 500}},
            request("tools/call", {"name": "self.t", "arguments": {"n": [1]}}),
            request("tools/call", {"name": "self.t", "arguments": {"n": {"n": 1}}}),
            request("tools/call", {"name": "self.t", "arguments": {"n": None}}),
            request("tools/call", {"name": "self.t", "arguments": {"n": -1e300}}),
            [None, {}, []],
        ]
        for message in samples:
            reply = server.handle_message(message)
            self.assertIsInstance(reply, dict, message)
            self.assertEqual(reply["jsonrpc"], "2.0")
            self.assertTrue(("result" in reply) != ("error" in reply), reply)
            self.assertEqual(json.loads(json.dumps(reply)), reply)


class HandleTextTest(TestCase):
    def test_round_trip(self):
        text = _server().handle('{"jsonrpc":"2.0","id":"a","method":"ping"}')
        self.assertEqual(json.loads(text), {"jsonrpc": "2.0", "id": "a", "result": {}})

    def test_reply_is_compact(self):
        text = _server().handle('{"jsonrpc":"2.0","id":1,"method":"initialize"}')
        self.assertNotIn(", ", text)
        self.assertNotIn(": ", text)

    def test_invalid_json_is_a_parse_error_with_null_id(self):
        for text in ("{", "", "nope", '{"jsonrpc":"2.0","id":1', None, b"\xff\xfe"):
            reply = json.loads(_server().handle(text))
            self.assertIsNone(reply["id"], text)
            self.assertEqual(error_of(reply)[0], PARSE_ERROR, text)

    def test_notification_text_gets_nothing(self):
        text = '{"jsonrpc":"2.0","method":"notifications/initialized"}'
        self.assertIsNone(_server().handle(text))

    def test_bytes_are_accepted(self):
        reply = json.loads(_server().handle(b'{"jsonrpc":"2.0","id":5,"method":"ping"}'))
        self.assertEqual(reply["id"], 5)

    def test_nesting_too_deep_for_the_parser_is_an_error_reply(self):
        # CPython's parser recurses (RecursionError); MicroPython's may run out of memory.
        server = _server()
        for text in ("[" * 100000, '{"a":' * 50000, "[" * 100000 + "]" * 100000):
            reply = json.loads(server.handle(text))
            self.assertIsNone(reply["id"])
            self.assertIn(error_of(reply)[0], (PARSE_ERROR, INTERNAL_ERROR, INVALID_REQUEST))
        reply = json.loads(server.handle('{"jsonrpc":"2.0","id":2,"method":"ping"}'))
        self.assertEqual(reply["result"], {})

    def test_a_memory_error_while_handling_is_an_error_reply(self):
        server = _server()

        def exhausted(msg):
            raise MemoryError("no heap")

        server.handle_message = exhausted
        reply = json.loads(server.handle('{"jsonrpc":"2.0","id":7,"method":"ping"}'))
        self.assertEqual((reply["id"], error_of(reply)), (7, (INTERNAL_ERROR, "Out of memory")))
        reply = json.loads(server.handle("[1]"))
        self.assertEqual((reply["id"], error_of(reply)), (None, (INTERNAL_ERROR, "Out of memory")))
        self.assertIsNone(server.handle('{"jsonrpc":"2.0","method":"notifications/x"}'))

    async def test_handle_async_turns_a_memory_error_into_an_error_reply(self):
        server = _server()

        async def exhausted(msg):
            raise MemoryError("no heap")

        server.handle_message_async = exhausted
        reply = json.loads(await server.handle_async('{"jsonrpc":"2.0","id":"x","method":"ping"}'))
        self.assertEqual((reply["id"], error_of(reply)), ("x", (INTERNAL_ERROR, "Out of memory")))

    def test_non_finite_number_does_not_bind(self):
        server = _server()
        server.add_tool("self.t", "t", [integer("n")], _Recorder())
        text = '{"jsonrpc":"2.0","id":1,"method":"tools/call",'
        text += '"params":{"name":"self.t","arguments":{"n":1e400}}}'
        reply = json.loads(server.handle(text))
        self.assertEqual(error_of(reply), (INVALID_PARAMS, "Missing valid argument: n"))


class ToolSchemaTest(TestCase):
    def test_tool_json_shape(self):
        server = _server()
        props = [
            integer("volume", minimum=0, maximum=100),
            boolean("mute", False),
            string("label", "x"),
            integer("step", 5),
            string("name"),
        ]
        server.add_tool("self.a", "Tool A", props, _Recorder())
        server.add_tool("self.b", "Tool B", [], _Recorder())
        tools = list_page(server)["tools"]
        self.assertEqual(
            tools[0],
            {
                "name": "self.a",
                "description": "Tool A",
                "inputSchema": {
                    "type": "object",
                    "properties": {
                        "volume": {"type": "integer", "minimum": 0, "maximum": 100},
                        "mute": {"type": "boolean", "default": False},
                        "label": {"type": "string", "default": "x"},
                        "step": {"type": "integer", "default": 5},
                        "name": {"type": "string"},
                    },
                    "required": ["volume", "name"],
                },
            },
        )
        self.assertEqual(
            tools[1],
            {
                "name": "self.b",
                "description": "Tool B",
                "inputSchema": {"type": "object", "properties": {}},
            },
        )

    def test_registration_order_is_kept(self):
        server = _server()
        names = ["self.z", "self.a", "self.m", "self.b"]
        for name in names:
            server.add_tool(name, "", [], _Recorder())
        self.assertEqual([tool["name"] for tool in list_page(server)["tools"]], names)
        self.assertEqual(server.tool_names(), names)

    def test_registration_errors(self):
        server = _server()
        server.add_tool("self.a", "", [], _Recorder())
        bad_registrations = [
            ("self.a", "", [], _Recorder()),
            ("", "", [], _Recorder()),
            (5, "", [], _Recorder()),
            ("self.b", None, [], _Recorder()),
            ("self.b", "", [integer("n"), boolean("n")], _Recorder()),
            ("self.b", "", [{"name": "n"}], _Recorder()),
            ("self.b", "", [], "not callable"),
        ]
        for args in bad_registrations:
            with self.assertRaises(ValueError):
                server.add_tool(*args)
        self.assertEqual(server.tool_names(), ["self.a"])

    def test_property_errors(self):
        for make in (
            lambda: mcp_server.Property("n", "number"),
            lambda: mcp_server.Property("", "integer"),
            lambda: mcp_server.Property("s", "string", minimum=1),
            lambda: mcp_server.Property("b", "boolean", maximum=1),
            lambda: integer("n", True),
            lambda: integer("n", 1.5),
            lambda: integer("n", "1"),
            lambda: boolean("b", 1),
            lambda: string("s", 1),
            lambda: integer("n", 200, 0, 100),
            lambda: integer("n", -1, 0, 100),
        ):
            self.assertRaises(ValueError, make)

    def test_tool_too_large_for_a_page_is_refused_naming_it(self):
        with self.assertRaises(ValueError) as context:
            _server().add_tool("self.huge", "x" * 8000, [], _Recorder())
        self.assertIn("self.huge", str(context.exception))


class ListPagesTest(TestCase):
    def test_single_page_has_no_next_cursor(self):
        server = _server()
        _synthetic_tools(server, 3, 10)
        page = list_page(server)
        self.assertEqual(len(page["tools"]), 3)
        self.assertNotIn("nextCursor", page)

    def test_empty_server(self):
        self.assertEqual(list_page(_server()), {"tools": []})

    def test_three_or_more_pages_follow_cursors(self):
        server = _server()
        names = _synthetic_tools(server, 40, 480)
        pages = []
        cursor = None
        while True:
            page = list_page(server, cursor)
            pages.append(page)
            cursor = page.get("nextCursor")
            if cursor is None:
                break
            self.assertEqual(cursor, names[sum(len(p["tools"]) for p in pages)])
        self.assertGreater(len(pages), 2)
        listed = [tool["name"] for page in pages for tool in page["tools"]]
        self.assertEqual(listed, names)

    def test_pages_use_the_stock_budget_exactly(self):
        server = _server()
        _synthetic_tools(server, 40, 480)
        cursor = None
        while True:
            page = list_page(server, cursor)
            self.assertLessEqual(utf8_len(page), 8000)
            used = len('{"tools":[') + sum(utf8_len(tool) + 1 for tool in page["tools"])
            self.assertLessEqual(used + 30, 8000)
            cursor = page.get("nextCursor")
            if cursor is None:
                break
            first_of_next = list_page(server, cursor)["tools"][0]
            self.assertEqual(first_of_next["name"], cursor)
            self.assertGreater(used + utf8_len(first_of_next) + 1 + 30, 8000)

    def test_page_boundary_is_exact_to_the_byte(self):
        # Stock rule: '{"tools":[' (10) + each tool's JSON and comma + 30 spare <= 8000.
        for user_only in (False, True):
            for extra, same_page in ((0, True), (1, False)):
                server = _server()
                _add_tool_of_size(server, "self.b", 150, user_only)
                _add_tool_of_size(server, "self.c", 8000 - 30 - 10 - 151 - 1 + extra, user_only)
                page = list_page(server, with_user_tools=True)
                names = [tool["name"] for tool in page["tools"]]
                label = (user_only, extra)
                if same_page:
                    self.assertEqual(names, ["self.b", "self.c"], label)
                    self.assertNotIn("nextCursor", page, label)
                else:
                    self.assertEqual(names, ["self.b"], label)
                    self.assertEqual(page["nextCursor"], "self.c", label)
                    last = list_page(server, "self.c", with_user_tools=True)
                    self.assertEqual([tool["name"] for tool in last["tools"]], ["self.c"])

    def test_largest_tool_that_fits_a_page(self):
        for user_only in (False, True):
            server = _server()
            _add_tool_of_size(server, "self.fits", 8000 - 30 - 10 - 1, user_only)
            self.assertEqual(all_tool_names(server, True), ["self.fits"])
            with self.assertRaises(ValueError):
                _add_tool_of_size(server, "self.over", 8000 - 30 - 10, user_only)

    def test_budget_counts_utf8_bytes(self):
        server = _server()
        for index in range(30):
            server.add_tool("self.t" + str(index), "温度计 température " * 20, [], _Recorder())
        self.assertEqual(len(all_tool_names(server)), 30)
        cursor = None
        while True:
            page = list_page(server, cursor)
            self.assertLessEqual(utf8_len(page), 8000)
            cursor = page.get("nextCursor")
            if cursor is None:
                break

    def test_empty_cursor_means_first_page(self):
        server = _server()
        names = _synthetic_tools(server, 3, 10)
        self.assertEqual([t["name"] for t in list_page(server, "")["tools"]], names)

    def test_cursor_starts_at_that_tool(self):
        server = _server()
        names = _synthetic_tools(server, 5, 10)
        page = list_page(server, names[2])
        self.assertEqual([t["name"] for t in page["tools"]], names[2:])

    def test_unknown_cursor(self):
        server = _server()
        _synthetic_tools(server, 3, 10)
        reply = server.handle_message(request("tools/list", {"cursor": "self.nope"}))
        self.assertEqual(error_of(reply), (INVALID_PARAMS, "Unknown cursor: self.nope"))

    def test_non_string_cursor(self):
        server = _server()
        _synthetic_tools(server, 3, 10)
        reply = server.handle_message(request("tools/list", {"cursor": 2}))
        self.assertEqual(error_of(reply)[0], INVALID_PARAMS)
        self.assertIn("cursor", error_of(reply)[1])

    def test_tool_larger_than_a_shrunk_page_is_an_error_naming_it(self):
        server = _server()
        server.add_tool("self.small", "s", [], _Recorder())
        server.add_tool("self.big", "b" * 300, [], _Recorder())
        server.page_budget = 200
        first = list_page(server)
        self.assertEqual(first["nextCursor"], "self.big")
        reply = server.handle_message(request("tools/list", {"cursor": "self.big"}))
        code, message = error_of(reply)
        self.assertEqual(code, INTERNAL_ERROR)
        self.assertIn("self.big", message)


class UserOnlyToolsTest(TestCase):
    def setUp(self):
        self.server = _server()
        self.server.add_tool("self.public", "p", [], _Recorder())
        self.server.add_tool("self.private", "u", [], _Recorder(), user_only=True)

    def test_hidden_by_default(self):
        self.assertEqual(all_tool_names(self.server), ["self.public"])
        self.assertEqual(all_tool_names(self.server, False), ["self.public"])

    def test_listed_with_annotation_when_asked(self):
        tools = list_page(self.server, with_user_tools=True)["tools"]
        self.assertEqual([t["name"] for t in tools], ["self.public", "self.private"])
        self.assertNotIn("annotations", tools[0])
        self.assertEqual(tools[1]["annotations"], {"audience": ["user"]})

    def test_legacy_with_system_tools(self):
        params = {"withSystemTools": True}
        reply = self.server.handle_message(request("tools/list", params))
        self.assertEqual(len(reply["result"]["tools"]), 2)

    def test_only_json_true_counts(self):
        for flag in ("true", 1, None):
            self.assertEqual(all_tool_names(self.server, flag), ["self.public"], flag)

    def test_callable_without_listing(self):
        self.assertEqual(tool_text(call_tool(self.server, "self.private")), "true")

    def test_annotated_pages_stay_in_budget(self):
        server = _server()
        for index in range(40):
            server.add_tool("self.u" + str(index), "u" * 400, [], _Recorder(), user_only=True)
        self.assertEqual(all_tool_names(server), [])
        self.assertEqual(len(all_tool_names(server, True)), 40)
        page = list_page(server, with_user_tools=True)
        self.assertIn("nextCursor", page)
        self.assertLessEqual(utf8_len(page), 8000)


class CallValidationTest(TestCase):
    def setUp(self):
        self.handler = _Recorder()
        self.server = _server()
        props = [integer("volume", minimum=0, maximum=100)]
        self.server.add_tool("self.set_volume", "v", props, self.handler)
        props = [boolean("on"), integer("brightness", 100, 0, 100), string("color", "white")]
        self.server.add_tool("self.led", "l", props, self.handler)

    def _error(self, name, arguments):
        return error_of(call_tool(self.server, name, arguments))

    def test_success_reply_shape(self):
        reply = call_tool(self.server, "self.set_volume", {"volume": 50}, request_id=12)
        self.assertEqual(
            reply,
            {
                "jsonrpc": "2.0",
                "id": 12,
                "result": {"content": [{"type": "text", "text": "true"}], "isError": False},
            },
        )
        self.assertEqual(self.handler.calls, [{"volume": 50}])

    def test_missing_params(self):
        for params in (None, [1], "x"):
            message = request("tools/call")
            if params is not None:
                message["params"] = params
            reply = self.server.handle_message(message)
            self.assertEqual(error_of(reply), (INVALID_PARAMS, "Missing params"), params)

    def test_missing_name(self):
        for params in ({}, {"name": 5}, {"name": None}):
            reply = self.server.handle_message(request("tools/call", params))
            self.assertEqual(error_of(reply), (INVALID_PARAMS, "Missing name"), params)

    def test_invalid_arguments(self):
        for arguments in ([1], "volume=5", 5, True):
            self.assertEqual(
                self._error("self.set_volume", arguments), (INVALID_PARAMS, "Invalid arguments")
            )
        self.assertEqual(self.handler.calls, [])

    def test_null_arguments_mean_none(self):
        self.server.add_tool("self.noargs", "n", [], self.handler)
        reply = self.server.handle_message(
            request("tools/call", {"name": "self.noargs", "arguments": None})
        )
        self.assertEqual(tool_text(reply), "true")

    def test_unknown_tool(self):
        self.assertEqual(self._error("self.nope", {}), (INVALID_PARAMS, "Unknown tool: self.nope"))

    def test_missing_required_argument(self):
        self.assertEqual(
            self._error("self.set_volume", {}), (INVALID_PARAMS, "Missing valid argument: volume")
        )
        self.assertEqual(self.handler.calls, [])

    def test_no_coercion_of_strings(self):
        self.assertEqual(
            self._error("self.set_volume", {"volume": "50"}),
            (INVALID_PARAMS, "Missing valid argument: volume"),
        )

    def test_integer_does_not_accept_booleans(self):
        for flag in (True, False):
            self.assertEqual(
                self._error("self.set_volume", {"volume": flag}),
                (INVALID_PARAMS, "Missing valid argument: volume"),
            )

    def test_boolean_does_not_accept_numbers(self):
        for number in (0, 1, 1.0):
            self.assertEqual(
                self._error("self.led", {"on": number}),
                (INVALID_PARAMS, "Missing valid argument: on"),
            )

    def test_string_does_not_accept_numbers(self):
        call_tool(self.server, "self.led", {"on": True, "color": 5})
        self.assertEqual(self.handler.calls[-1]["color"], "white")

    def test_integer_truncates_toward_zero(self):
        for given, bound in ((50.7, 50), (99.99, 99), (-0.5, 0), (100.9, 100), (7, 7)):
            reply = call_tool(self.server, "self.set_volume", {"volume": given})
            self.assertEqual(tool_text(reply), "true")
            self.assertEqual(self.handler.calls[-1]["volume"], bound)
            self.assertIsInstance(self.handler.calls[-1]["volume"], int)

    def test_range_errors(self):
        self.assertEqual(
            self._error("self.set_volume", {"volume": 101}),
            (INVALID_PARAMS, "Value exceeds maximum allowed: 100"),
        )
        self.assertEqual(
            self._error("self.set_volume", {"volume": -1}),
            (INVALID_PARAMS, "Value is below minimum allowed: 0"),
        )
        self.assertEqual(
            self._error("self.led", {"on": True, "brightness": 250}),
            (INVALID_PARAMS, "Value exceeds maximum allowed: 100"),
        )
        self.assertEqual(self.handler.calls, [])

    def test_defaults_fill_missing_and_wrongly_typed(self):
        call_tool(self.server, "self.led", {"on": True})
        call_tool(self.server, "self.led", {"on": False, "brightness": "high", "color": None})
        self.assertEqual(
            self.handler.calls,
            [
                {"on": True, "brightness": 100, "color": "white"},
                {"on": False, "brightness": 100, "color": "white"},
            ],
        )

    def test_extra_arguments_are_ignored(self):
        call_tool(self.server, "self.set_volume", {"volume": 3, "extra": 1, "other": "x"})
        self.assertEqual(self.handler.calls, [{"volume": 3}])


class ToolResultTest(TestCase):
    def _text(self, value):
        server = _server()
        server.add_tool("self.t", "t", [], _Recorder(value))
        return tool_text(call_tool(server, "self.t"))

    def test_booleans(self):
        self.assertEqual(self._text(True), "true")
        self.assertEqual(self._text(False), "false")

    def test_integers_in_decimal(self):
        self.assertEqual(self._text(42), "42")
        self.assertEqual(self._text(-7), "-7")
        self.assertEqual(self._text(0), "0")

    def test_strings_raw(self):
        self.assertEqual(self._text('say "hi"\n'), 'say "hi"\n')
        self.assertEqual(self._text(""), "")

    def test_dicts_and_lists_as_compact_json(self):
        value = {"a": [1, 2, {"b": None}], "c": "d e"}
        text = self._text(value)
        self.assertEqual(json.loads(text), value)
        self.assertNotIn(", ", text)
        self.assertNotIn(": ", text)
        self.assertEqual(json.loads(self._text([1, "x"])), [1, "x"])

    def test_unsupported_result_types_are_internal_errors(self):
        for value in (None, 1.5, (1, 2)):
            server = _server()
            server.add_tool("self.t", "t", [], _Recorder(value))
            code, message = error_of(call_tool(server, "self.t"))
            self.assertEqual(code, INTERNAL_ERROR, value)
            self.assertIn("unsupported", message)


class ToolFailureTest(TestCase):
    def _error(self, error):
        server = _server()
        server.add_tool("self.t", "t", [], _Raiser(error))
        return error_of(call_tool(server, "self.t", request_id=21))

    def test_exception_text_becomes_the_message(self):
        self.assertEqual(self._error(RuntimeError("camera busy")), (INTERNAL_ERROR, "camera busy"))

    def test_exception_without_text_names_its_type(self):
        self.assertEqual(self._error(KeyError()), (INTERNAL_ERROR, "KeyError"))

    def test_memory_error_is_an_error_reply(self):
        self.assertEqual(
            self._error(MemoryError("alloc")), (INTERNAL_ERROR, "Out of memory in tool self.t")
        )

    def test_failure_keeps_the_request_id(self):
        server = _server()
        server.add_tool("self.t", "t", [], _Raiser(ValueError("bad")))
        self.assertEqual(call_tool(server, "self.t", request_id="x-9")["id"], "x-9")


async def _async_volume(args):
    await asyncio.sleep(0)
    return args["volume"] * 2


async def _async_failure(args):
    await asyncio.sleep(0)
    raise OSError("upload failed")


async def _async_memory(args):
    raise MemoryError()


class AsyncToolTest(TestCase):
    def setUp(self):
        self.server = _server()
        props = [integer("volume", minimum=0, maximum=100)]
        self.server.add_tool("self.async_volume", "a", props, _async_volume)
        self.server.add_tool("self.async_failure", "f", [], _async_failure)
        self.server.add_tool("self.async_memory", "m", [], _async_memory)

    async def test_handle_message_returns_async_call(self):
        call = call_tool(self.server, "self.async_volume", {"volume": 21.9}, request_id=8)
        self.assertIsInstance(call, AsyncCall)
        self.assertEqual((call.id, call.name), (8, "self.async_volume"))
        self.assertEqual(tool_text(await call.run()), "42")

    async def test_validation_errors_come_back_at_once(self):
        reply = call_tool(self.server, "self.async_volume", {"volume": 101})
        self.assertIsInstance(reply, dict)
        self.assertEqual(error_of(reply)[1], "Value exceeds maximum allowed: 100")

    async def test_handle_message_async(self):
        message = request("tools/call", {"name": "self.async_volume", "arguments": {"volume": 4}})
        self.assertEqual(tool_text(await self.server.handle_message_async(message)), "8")
        ping = await self.server.handle_message_async(request("ping"))
        self.assertEqual(ping["result"], {})
        notification = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        self.assertIsNone(await self.server.handle_message_async(notification))

    async def test_handle_async_text(self):
        message = request("tools/call", {"name": "self.async_volume", "arguments": {"volume": 5}})
        reply = json.loads(await self.server.handle_async(json.dumps(message)))
        self.assertEqual(tool_text(reply), "10")
        parse_error = json.loads(await self.server.handle_async("{"))
        self.assertEqual(error_of(parse_error)[0], PARSE_ERROR)

    async def test_async_exception_is_an_error_reply(self):
        reply = await self.server.handle_message_async(
            request("tools/call", {"name": "self.async_failure"}, request_id=30)
        )
        self.assertEqual(reply["id"], 30)
        self.assertEqual(error_of(reply), (INTERNAL_ERROR, "upload failed"))

    async def test_async_memory_error_is_an_error_reply(self):
        reply = await self.server.handle_message_async(
            request("tools/call", {"name": "self.async_memory"})
        )
        self.assertEqual(
            error_of(reply), (INTERNAL_ERROR, "Out of memory in tool self.async_memory")
        )

    async def test_calls_run_concurrently(self):
        started = asyncio.Event()
        order = []

        async def waiter(args):
            order.append("waiter started")
            started.set()
            await release.wait()
            order.append("waiter done")
            return "w"

        async def releaser(args):
            await started.wait()
            order.append("releaser")
            release.set()
            return "r"

        release = asyncio.Event()
        self.server.add_tool("self.waiter", "w", [], waiter)
        self.server.add_tool("self.releaser", "r", [], releaser)
        first = call_tool(self.server, "self.waiter")
        second = call_tool(self.server, "self.releaser")
        replies = await asyncio.gather(first.run(), second.run())
        self.assertEqual([tool_text(reply) for reply in replies], ["w", "r"])
        self.assertEqual(order, ["waiter started", "releaser", "waiter done"])

    async def test_cancellation_is_not_swallowed(self):
        async def forever(args):
            await asyncio.Event().wait()

        self.server.add_tool("self.forever", "f", [], forever)
        task = asyncio.create_task(call_tool(self.server, "self.forever").run())
        await asyncio.sleep(0)
        task.cancel()
        with self.assertRaises(asyncio.CancelledError):
            await task

    def test_sync_handle_refuses_async_tool_with_an_error(self):
        message = request("tools/call", {"name": "self.async_volume", "arguments": {"volume": 1}})
        reply = json.loads(self.server.handle(json.dumps(message)))
        code, text = error_of(reply)
        self.assertEqual(code, INTERNAL_ERROR)
        self.assertIn("handle_async", text)
