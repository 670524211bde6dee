"""Generated hostile input for every parser the bridge runs on device and API data, and the
property each parser must keep: no exception but its own one-line error escapes, and the link
(or API) keeps working afterwards.

Used by tests/test_fuzz_parsers.py (a few hundred examples per parser; `FUZZ_EXAMPLES` scales it
up) and bench/fuzz.py (100,000 per parser, with timings). Needs hypothesis (the `dev` extra).
"""

import contextlib
import json
from typing import Any

import hypothesis.strategies as st
from pydantic import ValidationError
from structlog.testing import capture_logs

from backend.api.app import ToolCallRequest
from backend.devices.validation import MAX_REASON_CHARS, argument_error
from backend.mcp_session import CallResult, InitializeResult, McpClient, ProtocolViolation
from backend.mcp_session.models import parse_tools
from backend.protocol import AudioFrameError, ParseError
from backend.protocol.audio import decode_audio
from backend.protocol.messages import decode_device_message, device_message

DEVICE_TYPES = ["hello", "listen", "abort", "mcp", "goodbye", "iot", "teleport", ""]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.text(max_size=12), inner, max_size=6),
    ),
    max_leaves=30,
)


@st.composite
def deep_nesting(draw: st.DrawFn) -> str:
    depth = draw(st.integers(min_value=100, max_value=60_000))
    opener = draw(st.sampled_from(["[", '{"a":', '{"type":"mcp","payload":', '{"type":"hello",'
                                   '"features":']))  # fmt: skip
    return opener * depth


@st.composite
def message_shaped(draw: st.DrawFn) -> dict[str, Any]:
    """A device message with a real or bogus type and every field of a random type."""
    message: dict[str, Any] = {"type": draw(st.one_of(st.sampled_from(DEVICE_TYPES), scalars))}
    for name in ("session_id", "state", "mode", "text", "reason", "payload", "features",
                 "audio_params", "version", "transport"):  # fmt: skip
        if draw(st.booleans()):
            message[name] = draw(json_values)
    return message


@st.composite
def jsonrpc_shaped(draw: st.DrawFn) -> Any:
    """A JSON-RPC payload with every field of a random type (or a batch of them)."""
    message: dict[str, Any] = {}
    for name in ("jsonrpc", "id", "method", "params", "result", "error"):
        if draw(st.booleans()):
            message[name] = draw(json_values)
    if draw(st.booleans()):
        message["method"] = draw(
            st.sampled_from(["ping", "notifications/tools/list_changed", "tools/call", ""])
        )
    return [message, message] if draw(st.integers(0, 9)) == 0 else message


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=True, default=str)


device_frames = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200),  # invalid UTF-8 included
    deep_nesting(),
    message_shaped().map(_dumps),
    st.builds(lambda p: _dumps({"type": "mcp", "payload": p}), jsonrpc_shaped()),
    json_values.map(_dumps),
)
mcp_payloads = st.one_of(jsonrpc_shaped(), json_values)
tool_declarations = st.one_of(
    json_values,
    st.lists(
        st.fixed_dictionaries(
            {"name": json_values, "inputSchema": json_values},
            optional={"description": json_values, "annotations": json_values},
        ),
        max_size=5,
    ),
)
audio_frames = st.tuples(st.sampled_from([1, 2, 3]), st.binary(max_size=300))
api_bodies = st.one_of(
    st.binary(max_size=300),
    deep_nesting().map(str.encode),
    json_values.map(lambda v: _dumps(v).encode()),
    st.fixed_dictionaries(
        {"name": json_values, "arguments": json_values, "timeout_s": json_values}
    ).map(lambda v: _dumps(v).encode()),
)


# ---- the properties ------------------------------------------------------------------------------


def check_device_frame(frame: str | bytes) -> None:
    """The frame decoder: a typed message, or ParseError; nothing else ever."""
    try:
        data = decode_device_message(frame)
    except ParseError:
        return
    if data["type"] == "mcp" and "payload" in data:
        return  # the session feeds the payload to the MCP client (checked below)
    try:
        device_message(data)
    except ParseError:
        return


class QuietLog:
    """A logger that counts lines instead of writing them."""

    def __init__(self) -> None:
        self.lines = 0

    def bind(self, **_fields: Any) -> "QuietLog":
        return self

    def _line(self, *_args: Any, **_kwargs: Any) -> None:
        self.lines += 1

    debug = info = warning = error = exception = _line


def check_mcp_payload(payload: Any) -> None:
    """`McpClient.feed` never raises and logs a bounded number of lines per payload."""
    log = QuietLog()
    client = McpClient(_never_sends, log=log)
    client.feed(payload)
    limit = 2 * len(payload) + 3 if isinstance(payload, list) else 3  # one per message, plus
    assert log.lines <= limit, (log.lines, payload)  # a schema repair or two


async def _never_sends(_payload: dict[str, Any]) -> None:
    raise AssertionError("nothing should be sent for this payload")


def check_reply_results(result: Any) -> None:
    """What a device answers to initialize, tools/call and tools/list: a typed view, or
    ProtocolViolation; a tool list keeps what is usable and never raises."""
    for parse in (InitializeResult.from_wire, CallResult.from_wire):
        with contextlib.suppress(ProtocolViolation):
            parse(result)
    tools = result if isinstance(result, list) else [result]
    parse_tools(tools, QuietLog())


def check_audio_frame(version: int, data: bytes) -> None:
    try:
        decode_audio(version, data)
    except AudioFrameError:
        return


# Tool arguments as the chat pipeline hands them over (`json.loads` lets lone surrogates
# through), checked against schemas as devices declare them: real ones, keyword soup, any JSON.
odd_text = st.text(st.characters(categories=["Cs", "Ll", "Nd", "So"]), max_size=20)
argument_values = st.recursive(
    st.one_of(scalars, odd_text),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(odd_text, inner, max_size=5)
    ),
    max_leaves=20,
)
DECLARED_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"volume": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["volume"],
    },
    {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^(a+)+$", "maxLength": 8},
            "mode": {"enum": ["on", "off", 1, None]},
            "at": {"type": "string", "format": "date-time"},
            "items": {"type": "array", "items": {"type": "number"}, "uniqueItems": True},
        },
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/x"}},
        "$defs": {"x": {"type": "integer"}},
    },
]
SCHEMA_KEYWORDS = ["type", "properties", "required", "items", "enum", "minimum", "maximum",
                   "pattern", "$ref", "anyOf", "oneOf", "not", "additionalProperties", "$schema",
                   "const", "minLength", "format", "if", "then", "$defs"]  # fmt: skip
schema_soup = st.dictionaries(st.sampled_from(SCHEMA_KEYWORDS), json_values, max_size=5)
tool_schemas = st.one_of(
    st.sampled_from(DECLARED_SCHEMAS),
    schema_soup,
    st.dictionaries(st.sampled_from(["volume", "x"]), schema_soup, max_size=2).map(
        lambda properties: {"type": "object", "properties": properties}
    ),
)
tool_arguments = st.tuples(
    tool_schemas, st.dictionaries(odd_text, argument_values, max_size=4) | json_values
)


def check_argument_check(schema: dict[str, Any], arguments: Any) -> None:
    """The argument check answers None or one short reason, and never raises: any schema a
    device declares, any arguments a model produces."""
    with capture_logs() as lines:
        reason = argument_error(schema, arguments)
    assert reason is None or (isinstance(reason, str) and len(reason) <= MAX_REASON_CHARS + 40)
    assert len(lines) <= 1, lines


def check_api_body(body: bytes) -> None:
    """The tool-call body parser: a request, or ValidationError (answered 422)."""
    from backend.api.app import _CALL_REQUEST

    try:
        request = _CALL_REQUEST.validate_json(body)
    except ValidationError:
        return
    assert isinstance(request, ToolCallRequest)


# MQTT 3.1.1 as a device (or anyone on the broker port) may send it: well-formed packets of every
# type, the same with one byte changed or cut, and bytes with a plausible first byte.
def _mqtt_string(text: bytes) -> bytes:
    return len(text).to_bytes(2, "big") + text


@st.composite
def mqtt_packet_bytes(draw: st.DrawFn) -> bytes:
    from backend.protocol.mqtt_packets import remaining_length

    kind = draw(st.integers(0, 15))
    flags = draw(st.sampled_from([0, 2, draw(st.integers(0, 15))]))
    topic = draw(st.binary(max_size=12) | st.sampled_from([b"xiaozhi/a/up", b"#", b"a/+/b", b""]))
    shape = draw(st.integers(0, 3))
    if shape == 0:  # a CONNECT's variable header, any flags, a client id
        connect_flags = draw(st.integers(0, 255))
        client_id = _mqtt_string(draw(st.binary(max_size=8)))
        body = _mqtt_string(b"MQTT") + bytes([4, connect_flags, 0, 60]) + client_id
    elif shape == 1:  # a PUBLISH-shaped body
        body = _mqtt_string(topic) + draw(st.binary(max_size=4)) + draw(st.binary(max_size=32))
    else:
        body = draw(st.binary(max_size=6 if shape == 2 else 64))
    if draw(st.booleans()) and body:  # one byte changed
        at = draw(st.integers(0, len(body) - 1))
        body = body[:at] + bytes([draw(st.integers(0, 255))]) + body[at + 1 :]
    data = bytes([kind << 4 | flags]) + remaining_length(len(body)) + body
    cut = draw(st.integers(0, len(data)))
    return data[:cut] if draw(st.booleans()) else data + draw(st.binary(max_size=16))


mqtt_streams = st.lists(mqtt_packet_bytes(), min_size=1, max_size=4).map(b"".join)


def check_mqtt_stream(data: bytes) -> None:
    """The MQTT codec: whole packets or MalformedPacket, never another exception, and a bounded
    buffer whatever the remaining length claims."""
    from backend.protocol.mqtt_packets import MalformedPacket, PacketReader

    reader = PacketReader(max_packet_bytes=256)
    for at in range(0, len(data), 7):  # fed in pieces, as TCP delivers it
        reader.feed(data[at : at + 7])
        try:
            list(reader.packets())
        except MalformedPacket:
            return
        assert reader.buffered <= 256 + 5 + 7
