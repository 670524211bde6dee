"""The per-call fast paths give the same answers as the general code they short-cut."""

import copy
import http.server
import json
import threading

import pytest

from backend.devices.validation import argument_error
from backend.protocol import McpEnvelope, ParseError, parse_device_message
from backend.protocol.messages import decode_device_message, device_message, mcp_envelope

VOLUME_SCHEMA = {
    "type": "object",
    "properties": {"volume": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["volume"],
}


@pytest.mark.parametrize(
    "text",
    [
        '{"session_id":"s","type":"mcp","payload":{"jsonrpc":"2.0","id":1,"result":{}}}',
        '{"type":"mcp","payload":[1,2]}',
        '{"type":"listen","state":"detect","text":"hi"}',
        '{"type":"hello","version":1,"features":{"mcp":true}}',
    ],
)
def test_decode_then_type_equals_parse(text: str) -> None:
    data = decode_device_message(text)
    assert data == json.loads(text)
    assert device_message(data) == parse_device_message(text)


def test_mcp_without_payload_is_still_rejected() -> None:
    data = decode_device_message('{"type":"mcp"}')
    with pytest.raises(ParseError, match="missing 'payload'"):
        device_message(data)


def test_mcp_envelope_is_compact_and_keeps_unicode() -> None:
    payload = {"jsonrpc": "2.0", "id": 3, "params": {"text": "xin chào ü\u2028"}}
    text = mcp_envelope("ab", payload)
    expected = {"session_id": "ab", "type": "mcp", "payload": payload}
    assert text == json.dumps(expected, separators=(",", ":"), ensure_ascii=False)
    assert isinstance(parse_device_message(text), McpEnvelope)


def test_validation_answers_the_same_for_the_same_and_an_equal_schema() -> None:
    equal = copy.deepcopy(VOLUME_SCHEMA)
    for schema in (VOLUME_SCHEMA, equal, VOLUME_SCHEMA):
        assert argument_error(schema, {"volume": 42}) is None
        assert (
            argument_error(schema, {"volume": 101})
            == "volume: 101 is greater than the maximum of 100"
        )
        assert argument_error(schema, {}) == '"volume" is a required property'


def test_validation_of_different_schemas_is_not_mixed_up() -> None:
    strings = {"type": "object", "properties": {"volume": {"type": "string"}}}
    assert argument_error(VOLUME_SCHEMA, {"volume": "loud"}) is not None
    assert argument_error(strings, {"volume": "loud"}) is None


def test_validation_follows_the_schemas_draft_and_ignores_formats() -> None:
    draft7 = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"at": {"type": "string", "format": "date-time"}},
        "additionalProperties": False,
    }
    assert argument_error(draft7, {"at": "not a date"}) is None  # format is an annotation
    assert argument_error(draft7, {"at": 1}) == 'at: 1 is not of type "string"'
    reason = argument_error(draft7, {"other": 1})
    assert reason is not None and "other" in reason


class _CountingHandler(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self) -> None:
        type(self).hits += 1
        body = json.dumps({"type": "integer", "maximum": 1}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


def test_a_schema_that_refers_to_a_remote_schema_fetches_nothing_and_is_not_enforced() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CountingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        remote = f"http://127.0.0.1:{server.server_address[1]}/volume.json"
        schema = {"type": "object", "properties": {"volume": {"$ref": remote}}}
        # The device validates its own arguments; the bridge opens no connection for it.
        assert argument_error(schema, {"volume": 5}) is None
        assert _CountingHandler.hits == 0
    finally:
        server.shutdown()
        server.server_close()


def test_unusable_schemas_skip_validation() -> None:
    def nested(depth: int) -> dict[str, object]:
        schema: dict[str, object] = {}
        for _ in range(depth):
            schema = {"items": schema}
        return schema

    broken = ({"type": 5}, {"properties": {"a": {"$ref": "#/nowhere"}}})
    for schema in (*broken, nested(900), nested(5_000)):
        assert argument_error(schema, {"a": 1}) is None


def test_reasons_are_short_and_odd_text_is_a_reason_not_an_exception() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}
    reason = argument_error(schema, {"a": "x" * 1_000_000})
    assert reason is not None and reason.startswith('a: "xxx') and len(reason) < 400
    # json.loads (the chat pipeline's tool arguments) lets lone surrogates through.
    for arguments in ({"a": "\ud800" * 4}, {"\ud800": 1}):
        reason = argument_error(schema, arguments)
        assert reason is not None and "not valid JSON text" in reason, reason
