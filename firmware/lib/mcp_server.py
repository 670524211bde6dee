"""The device's MCP server: JSON-RPC 2.0 in, JSON-RPC 2.0 out, tools backed by plain callables.

Pure (no I/O). It follows the stock xiaozhi-esp32 2.4 server (protocol reference §4: messages,
8000-byte tools/list pages, name cursors, argument binding) and deviates only where stock would
leave a spec-following client waiting or guessing:
- every error carries a JSON-RPC `code` next to the stock `message`;
- string ids are answered (stock drops them); `ping` answers `{}` (stock: not implemented);
- a batch (JSON array) gets one -32600 error with id null (stock ignores it);
- `jsonrpc` other than "2.0", a non-string `method` or a null/boolean/object id: -32600 when the
  message has an id, silently dropped without one (as stock);
- `params` that is not an object: -32602 (tools/call keeps the stock text "Missing params");
  `arguments: null` counts as no arguments;
- an unknown tools/list cursor: -32602 "Unknown cursor: <c>" (stock: a payload-size error);
- a tool too large for one page is refused by add_tool (ValueError), and if the page budget
  shrinks later, tools/list answers -32603 naming it;
- a tool that raises: -32603 with the exception text (stock sends the text too); MemoryError:
  gc.collect(), then -32603 "Out of memory in tool <name>";
- a tool result that is not bool/int/str/dict/list (e.g. None, float): -32603;
- handle() (sync) answers -32603 for an `async def` tool: use handle_async/handle_message_async;
- handle()/handle_async() never raise, whatever the text: JSON nested deeper than the parser can
  go is a -32700 parse error; a MemoryError anywhere becomes -32603 "Out of memory";
- an id that is a non-finite number (NaN, Infinity: no JSON can carry it back) is not usable;
- names echoed in error messages (method, tool, cursor) are clipped to ECHO_CHARS characters.

Memory: each tool keeps only its JSON byte size, measured once at registration (in this
runtime's json.dumps encoding); tools/list builds the dicts of one page when asked, and they
are garbage once the reply is sent. Measured for the 7 stock tools (1.5 KB of JSON), caching
would cost for the whole uptime about 1.5 KB as dicts or 1.8 KB as text on a 32-bit port.
"""

import gc
import json

from compat import const

PROTOCOL_VERSION = "2024-11-05"
PAGE_BUDGET = const(8000)

PARSE_ERROR = const(-32700)
INVALID_REQUEST = const(-32600)
METHOD_NOT_FOUND = const(-32601)
INVALID_PARAMS = const(-32602)
INTERNAL_ERROR = const(-32603)

KINDS = ("boolean", "integer", "string")

# Stock page arithmetic: the result text starts with '{"tools":[', every tool adds its JSON plus
# a comma, and 30 bytes stay free for the closing part.
_PAGE_HEAD = const(10)
_PAGE_SLACK = const(30)
_ANNOTATION_BYTES = len(',"annotations":{"audience":["user"]}')
_COMPACT = (",", ":")
ECHO_CHARS = const(100)  # longest name an error message repeats


class _NoDefault:
    def __repr__(self):
        return "NO_DEFAULT"


NO_DEFAULT = _NoDefault()


class Property:
    """One tool argument. A property without a default is required."""

    def __init__(self, name, kind, default=NO_DEFAULT, minimum=None, maximum=None):
        if not isinstance(name, str) or not name:
            raise ValueError("property name must be a non-empty string")
        if kind not in KINDS:
            raise ValueError("property " + name + ": unknown kind " + repr(kind))
        if kind != "integer" and (minimum is not None or maximum is not None):
            raise ValueError("property " + name + ": only integers have a range")
        self.name = name
        self.kind = kind
        self.default = default
        self.minimum = minimum
        self.maximum = maximum
        if self.has_default:
            self._check_default()

    @property
    def has_default(self) -> bool:
        return self.default is not NO_DEFAULT

    def _check_default(self):
        valid = self._accepts(self.default)
        if self.kind == "integer":
            valid = valid and isinstance(self.default, int)
        if not valid:
            raise ValueError("property " + self.name + ": default is not a " + self.kind)
        problem = self._range_problem(self.default)
        if problem is not None:
            raise ValueError("property " + self.name + ": default out of range: " + problem)

    def _accepts(self, value) -> bool:
        # bool is a subclass of int in Python, JSON keeps them apart.
        if self.kind == "boolean":
            return value is True or value is False
        if self.kind == "integer":
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        return isinstance(value, str)

    def _range_problem(self, value):
        if self.minimum is not None and value < self.minimum:
            return "Value is below minimum allowed: " + str(self.minimum)
        if self.maximum is not None and value > self.maximum:
            return "Value exceeds maximum allowed: " + str(self.maximum)
        return None

    def schema(self) -> dict:
        schema = {}  # filled key by key: the values have mixed types
        schema["type"] = self.kind
        if self.has_default:
            schema["default"] = self.default
        if self.minimum is not None:
            schema["minimum"] = self.minimum
        if self.maximum is not None:
            schema["maximum"] = self.maximum
        return schema

    def bind(self, arguments):
        """The argument's value per stock rules; raises _RpcError when there is none."""
        value = arguments.get(self.name, NO_DEFAULT)
        if value is not NO_DEFAULT and self._accepts(value):
            if self.kind == "integer":
                value = _truncate(value)
            if value is not None:
                problem = self._range_problem(value)
                if problem is not None:
                    raise _RpcError(INVALID_PARAMS, problem)
                return value
        if self.has_default:
            return self.default
        raise _RpcError(INVALID_PARAMS, "Missing valid argument: " + self.name)


def boolean(name, default=NO_DEFAULT) -> Property:
    return Property(name, "boolean", default)


def integer(name, default=NO_DEFAULT, minimum=None, maximum=None) -> Property:
    return Property(name, "integer", default, minimum, maximum)


def string(name, default=NO_DEFAULT) -> Property:
    return Property(name, "string", default)


def _truncate(number):
    """int(number) toward zero like the stock C cast; None for inf/NaN."""
    try:
        return int(number)
    except (OverflowError, ValueError):
        return None


class _RpcError(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


class _Tool:
    def __init__(self, name, description, properties, handler, user_only):
        self.name = name
        self.description = description
        self.properties = properties
        self.handler = handler
        self.user_only = user_only
        # Byte size of the JSON without annotations; the listing budget is counted in bytes.
        self.size = len(json.dumps(self.to_dict(False), separators=_COMPACT).encode("utf-8"))

    def listed_size(self) -> int:
        return self.size + (_ANNOTATION_BYTES if self.user_only else 0)

    def to_dict(self, annotate) -> dict:
        schema = {"type": "object", "properties": {}}
        required = []
        for prop in self.properties:
            schema["properties"][prop.name] = prop.schema()
            if not prop.has_default:
                required.append(prop.name)
        if required:
            schema["required"] = required
        tool = {"name": self.name, "description": self.description, "inputSchema": schema}
        if annotate and self.user_only:
            tool["annotations"] = {"audience": ["user"]}
        return tool


class AsyncCall:
    """A validated tools/call whose tool is `async def`: await run() for the reply dict."""

    def __init__(self, request_id, name, awaitable):
        self.id = request_id
        self.name = name
        self._awaitable = awaitable

    async def run(self) -> dict:
        try:
            value = await self._awaitable
            return _tool_reply(self.id, value)
        except Exception as error:  # a tool must never take the device down
            return _tool_failure(self.id, self.name, error)

    def close(self):
        """Drop the call without running it."""
        close = getattr(self._awaitable, "close", None)
        if close is not None:
            close()


class McpServer:
    def __init__(self, name, version):
        self.name = name
        self.version = version
        self.vision_url = None
        self.vision_token = None
        self.page_budget = PAGE_BUDGET
        self._tools = []

    # ---- registration ---------------------------------------------------------------------

    def add_tool(self, name, description, properties, handler, user_only=False):
        """Register a tool; handler(args) returns bool/int/str/dict/list or is `async def`."""
        if not isinstance(name, str) or not name:
            raise ValueError("tool name must be a non-empty string")
        if self._find(name) is not None:
            raise ValueError("duplicate tool name: " + name)
        if not isinstance(description, str):
            raise ValueError("tool " + name + ": description must be a string")
        if not callable(handler):
            raise ValueError("tool " + name + ": handler is not callable")
        properties = list(properties)
        _check_properties(name, properties)
        tool = _Tool(name, description, properties, handler, bool(user_only))
        if not self._fits_on_empty_page(tool):
            raise ValueError("tool " + name + " is too large for one tools/list page")
        self._tools.append(tool)

    def tool_names(self) -> list:
        return [tool.name for tool in self._tools]

    def _find(self, name):
        for tool in self._tools:
            if tool.name == name:
                return tool
        return None

    def _fits_on_empty_page(self, tool) -> bool:
        return _PAGE_HEAD + tool.listed_size() + 1 + _PAGE_SLACK <= self.page_budget

    # ---- entry points ---------------------------------------------------------------------

    def handle(self, text):
        """JSON text in, JSON reply text (or None) out; never raises. Async tools need
        handle_async."""
        msg, reply = _parse(text)
        if reply is None:
            try:
                reply = self.handle_message(msg)
            except MemoryError:
                reply = _out_of_memory(msg)
        if isinstance(reply, AsyncCall):
            reply.close()
            reply = _error(reply.id, INTERNAL_ERROR, "Tool " + reply.name + " needs handle_async")
        return _encode(reply)

    async def handle_async(self, text):
        """Like handle(), and runs `async def` tools; never raises."""
        msg, reply = _parse(text)
        if reply is None:
            try:
                reply = await self.handle_message_async(msg)
            except MemoryError:
                reply = _out_of_memory(msg)
        return _encode(reply)

    async def handle_message_async(self, msg):
        reply = self.handle_message(msg)
        if isinstance(reply, AsyncCall):
            return await reply.run()
        return reply

    def handle_message(self, msg):
        """Reply dict, None (nothing to send) or an AsyncCall, for any parsed JSON value.

        Raises nothing but MemoryError (the caller decides how to recover from that)."""
        if isinstance(msg, list):
            return _error(None, INVALID_REQUEST, "Batch requests are not supported")
        if not isinstance(msg, dict):
            return _error(None, INVALID_REQUEST, "Invalid Request: expected a JSON object")
        has_id = "id" in msg
        request_id = msg.get("id")
        problem = _envelope_problem(msg)
        if problem is not None:
            return _error(_usable_id(request_id), INVALID_REQUEST, problem) if has_id else None
        method = msg["method"]
        if not has_id or method.startswith("notifications/"):
            return None
        if _usable_id(request_id) is None:
            return _error(None, INVALID_REQUEST, "Invalid Request: id must be a string or number")
        try:
            return self._dispatch(request_id, method, msg.get("params"))
        except _RpcError as error:
            return _error(request_id, error.code, error.message)

    # ---- methods --------------------------------------------------------------------------

    def _dispatch(self, request_id, method, params):
        if method == "tools/call":
            return self._call_tool(request_id, params)
        if method == "initialize":
            result = self._initialize(_object_params(params))
        elif method == "tools/list":
            result = self._list_tools(_object_params(params))
        elif method == "ping":
            result = {}
        else:
            raise _RpcError(METHOD_NOT_FOUND, "Method not implemented: " + _clip(method))
        return {"jsonrpc": "2.0", "id": request_id, "result": result}

    def _initialize(self, params) -> dict:
        self._read_vision(params.get("capabilities"))
        return {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {"tools": {}},
            "serverInfo": {"name": self.name, "version": self.version},
        }

    def _read_vision(self, capabilities):
        vision = capabilities.get("vision") if isinstance(capabilities, dict) else None
        if not isinstance(vision, dict):
            return
        url = vision.get("url")
        if isinstance(url, str) and (url.startswith("http://") or url.startswith("https://")):
            token = vision.get("token")
            self.vision_url = url
            self.vision_token = token if isinstance(token, str) else None

    def _list_tools(self, params) -> dict:
        cursor = params.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise _RpcError(INVALID_PARAMS, "Invalid cursor: must be a string")
        with_user = params.get("withUserTools") is True or params.get("withSystemTools") is True
        index = self._cursor_index(cursor) if cursor else 0
        used = _PAGE_HEAD
        page = []
        while index < len(self._tools):
            tool = self._tools[index]
            index += 1
            if tool.user_only and not with_user:
                continue
            size = tool.listed_size() + 1
            if used + size + _PAGE_SLACK > self.page_budget:
                return self._partial_page(page, tool.name)
            page.append(tool.to_dict(True))
            used += size
        return {"tools": page}

    def _cursor_index(self, cursor) -> int:
        for index in range(len(self._tools)):
            if self._tools[index].name == cursor:
                return index
        raise _RpcError(INVALID_PARAMS, "Unknown cursor: " + _clip(cursor))

    def _partial_page(self, page, next_cursor) -> dict:
        if not page:
            raise _RpcError(
                INTERNAL_ERROR,
                "Failed to add tool " + next_cursor + " because of payload size limit",
            )
        return {"tools": page, "nextCursor": next_cursor}

    def _call_tool(self, request_id, params):
        if not isinstance(params, dict):
            raise _RpcError(INVALID_PARAMS, "Missing params")
        name = params.get("name")
        if not isinstance(name, str):
            raise _RpcError(INVALID_PARAMS, "Missing name")
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        elif not isinstance(arguments, dict):
            raise _RpcError(INVALID_PARAMS, "Invalid arguments")
        tool = self._find(name)
        if tool is None:
            raise _RpcError(INVALID_PARAMS, "Unknown tool: " + _clip(name))
        values = {}
        for prop in tool.properties:
            values[prop.name] = prop.bind(arguments)
        return _run_tool(request_id, tool, values)


def _run_tool(request_id, tool, values):
    try:
        outcome = tool.handler(values)
        if _is_awaitable(outcome):
            return AsyncCall(request_id, tool.name, outcome)
        return _tool_reply(request_id, outcome)
    except Exception as error:  # a tool must never take the device down
        return _tool_failure(request_id, tool.name, error)


def _is_awaitable(value) -> bool:
    # Calling an `async def` gives a coroutine (CPython) or a generator (MicroPython).
    return hasattr(value, "send") and hasattr(value, "throw")


def _tool_reply(request_id, value) -> dict:
    content = [{"type": "text", "text": _tool_text(value)}]
    return {"jsonrpc": "2.0", "id": request_id, "result": {"content": content, "isError": False}}


def _tool_text(value) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=_COMPACT)
    raise TypeError("unsupported tool result type: " + type(value).__name__)


def _tool_failure(request_id, name, error) -> dict:
    if isinstance(error, MemoryError):
        gc.collect()
        return _error(request_id, INTERNAL_ERROR, "Out of memory in tool " + name)
    return _error(request_id, INTERNAL_ERROR, str(error) or type(error).__name__)


def _check_properties(tool_name, properties):
    names = []
    for prop in properties:
        if not isinstance(prop, Property):
            raise ValueError("tool " + tool_name + ": properties must be Property objects")
        if prop.name in names:
            raise ValueError("tool " + tool_name + ": duplicate property " + prop.name)
        names.append(prop.name)


def _envelope_problem(msg):
    if msg.get("jsonrpc") != "2.0":
        return 'Invalid Request: jsonrpc must be "2.0"'
    if not isinstance(msg.get("method"), str):
        return "Invalid Request: method must be a string"
    return None


def _usable_id(request_id):
    """The id if a reply may carry it (string or finite number), else None."""
    if isinstance(request_id, bool):
        return None
    if isinstance(request_id, float):
        # NaN and the infinities: x - x is NaN for them, and JSON has no way to send them back.
        return request_id if request_id - request_id == 0 else None
    if isinstance(request_id, (str, int)):
        return request_id
    return None


def _clip(name):
    """`name` as an error message may repeat it: long ones are cut (they could be a whole frame)."""
    if len(name) <= ECHO_CHARS:
        return name
    return name[:ECHO_CHARS] + "..."


def _object_params(params) -> dict:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise _RpcError(INVALID_PARAMS, "Invalid params: params must be an object")
    return params


def _error(request_id, code, message) -> dict:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}


def _parse(text):
    """(message, None) or (None, error reply) for text that is not JSON."""
    try:
        return json.loads(text), None
    except MemoryError:
        gc.collect()
        return None, _error(None, INTERNAL_ERROR, "Out of memory")
    except (ValueError, TypeError):  # not JSON (UnicodeDecodeError is a ValueError), not text
        return None, _error(None, PARSE_ERROR, "Parse error: invalid JSON")
    except RuntimeError:  # recursion limit: CPython's RecursionError is a RuntimeError
        return None, _error(None, PARSE_ERROR, "Parse error: nesting too deep")


def _out_of_memory(msg):
    """The reply to `msg` when handling it ran out of memory (None for a notification)."""
    gc.collect()
    if not isinstance(msg, dict):
        return _error(None, INTERNAL_ERROR, "Out of memory")
    if "id" not in msg:
        return None
    return _error(_usable_id(msg.get("id")), INTERNAL_ERROR, "Out of memory")


def _encode(reply):
    if reply is None:
        return None
    try:
        return json.dumps(reply, separators=_COMPACT)
    except MemoryError:
        gc.collect()
        return json.dumps(
            _error(reply.get("id"), INTERNAL_ERROR, "Out of memory"), separators=_COMPACT
        )
