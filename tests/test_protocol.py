"""Protocol models: tolerant parsing of device frames, server messages, audio framing."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.protocol import (
    Abort,
    AudioFrameError,
    DeviceHello,
    Listen,
    McpEnvelope,
    ParseError,
    ServerHello,
    Tts,
    decode_audio,
    encode_audio,
    parse_device_message,
)
from backend.protocol.messages import Alert, Goodbye, Llm, Stt, System, mcp_envelope
from testkit.stock_device import STOCK_HELLO


def test_stock_hello_parses_with_features_and_audio_params():
    hello = parse_device_message(json.dumps(STOCK_HELLO))
    assert isinstance(hello, DeviceHello)
    assert hello.features.mcp is True
    assert hello.audio_params.sample_rate == 16000
    # Unknown fields (text_font) are kept, not rejected.
    assert hello.model_extra is not None and "text_font" in hello.model_extra


def test_old_firmware_hello_without_features_has_no_mcp():
    hello = parse_device_message('{"type":"hello","version":1,"transport":"websocket"}')
    assert isinstance(hello, DeviceHello)
    assert hello.features.mcp is False


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ('{"session_id":"s","type":"listen","state":"start","mode":"auto"}', Listen),
        ('{"session_id":"s","type":"listen","state":"detect","text":"你好小智"}', Listen),
        ('{"session_id":"","type":"listen","state":"stop"}', Listen),
        ('{"session_id":"s","type":"abort","reason":"wake_word_detected"}', Abort),
        ('{"session_id":"s","type":"abort"}', Abort),
        ('{"session_id":"s","type":"goodbye"}', Goodbye),
        (
            '{"session_id":"s","type":"mcp","payload":{"jsonrpc":"2.0","id":1,"result":{}}}',
            McpEnvelope,
        ),
        # Other clients: no session_id at all, or pretty-printed with \\u escapes.
        ('{\n  "type": "mcp",\n  "payload": {"text": "\\u4f60\\u597d"}\n}', McpEnvelope),
    ],
)
def test_device_messages_parse(text, kind):
    assert isinstance(parse_device_message(text), kind)


def test_listen_detect_keeps_text_and_unicode():
    message = parse_device_message('{"type":"listen","state":"detect","text":"xin chào"}')
    assert isinstance(message, Listen) and message.text == "xin chào"


def test_mcp_payload_passes_through_untouched():
    payload = {"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": "ü"}]}}
    message = parse_device_message(json.dumps({"type": "mcp", "payload": payload}))
    assert isinstance(message, McpEnvelope) and message.payload == payload


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('"hello"', "expected a JSON object, got str"),
        ("{}", "no string 'type'"),
        ('{"type": 5}', "no string 'type'"),
        ('{"type": "iot", "update": true}', "unknown message type 'iot'"),
        ('{"type": "listen", "state": 5}', "invalid 'listen' message"),
        ('{"type": "listen", "state": "start", "mode": "turbo"}', "invalid 'listen' message"),
        ('{"type": "hello", "version": "one"}', "invalid 'hello' message"),
        ('{"type": "hello", "features": []}', "invalid 'hello' message"),
        ('{"type": "mcp"}', "missing 'payload'"),
        (b"\xff\xfe\x00binary", "invalid JSON"),
    ],
)
def test_bad_frames_raise_parse_error_with_reason(text, reason):
    with pytest.raises(ParseError, match=reason):
        parse_device_message(text)


def test_a_huge_unknown_type_is_clipped_in_the_reason():
    # The reason is logged as is: 60 KB of device data must not become 60 KB of log.
    with pytest.raises(ParseError, match="unknown message type") as caught:
        parse_device_message(json.dumps({"type": "t" * 60_000}))
    reason = str(caught.value)
    assert len(reason) < 200 and "(60000 chars)" in reason


def test_server_hello_always_has_transport_session_and_audio_params():
    hello = json.loads(ServerHello(session_id="00ff").to_json())
    assert hello == {
        "type": "hello",
        "transport": "websocket",
        "session_id": "00ff",
        "audio_params": {
            "format": "opus",
            "sample_rate": 24000,
            "channels": 1,
            "frame_duration": 60,
        },
    }


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (Stt(text="hi"), {"type": "stt", "text": "hi"}),
        (Tts(state="start"), {"type": "tts", "state": "start"}),
        (
            Tts(state="sentence_start", text="Hello"),
            {"type": "tts", "state": "sentence_start", "text": "Hello"},
        ),
        (Llm(emotion="happy"), {"type": "llm", "emotion": "happy"}),
        (System(command="reboot"), {"type": "system", "command": "reboot"}),
        (
            Alert(status="Warning", message="Low battery", emotion="sad"),
            {"type": "alert", "status": "Warning", "message": "Low battery", "emotion": "sad"},
        ),
    ],
)
def test_server_messages_serialise_compactly_without_nulls(message, expected):
    assert json.loads(message.to_json()) == expected


def test_mcp_envelope_is_compact_and_keeps_unicode():
    text = mcp_envelope(
        "abc", {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"x": "é"}}
    )
    assert " " not in text and "é" in text
    assert json.loads(text)["type"] == "mcp"


# ---- binary audio framing (§1.3) -------------------------------------------------------------


def test_v2_header_layout_is_big_endian():
    frame = encode_audio(2, b"\x01\x02\x03", timestamp_ms=0x01020304)
    assert frame[:16] == bytes.fromhex("00020000000000000102030400000003")
    assert frame[16:] == b"\x01\x02\x03"


def test_v3_header_layout_is_big_endian():
    assert encode_audio(3, b"\xaa" * 258)[:4] == bytes.fromhex("00000102")


def test_v1_is_the_raw_packet():
    assert encode_audio(1, b"opus") == b"opus"
    assert decode_audio(1, b"opus").payload == b"opus"


@given(
    version=st.sampled_from([1, 2, 3]),
    payload=st.binary(max_size=2000),
    timestamp=st.integers(0, 2**32 - 1),
)
def test_audio_round_trip(version, payload, timestamp):
    frame = decode_audio(version, encode_audio(version, payload, timestamp))
    assert frame.payload == payload
    assert frame.timestamp_ms == (timestamp if version == 2 else 0)


@pytest.mark.parametrize(
    ("version", "data", "reason"),
    [
        (2, b"\x00\x02" + b"\x00" * 10, "shorter than its 16-byte header"),
        (2, bytes.fromhex("0002000000000000000000000000000a") + b"abc", "payload_size 10 but 3"),
        (3, b"\x00\x00", "shorter than its 4-byte header"),
        (3, bytes.fromhex("00000005") + b"abcdef", "payload_size 5 but 6"),
        (4, b"x", "unsupported protocol version 4"),
    ],
)
def test_inconsistent_audio_frames_are_rejected(version, data, reason):
    with pytest.raises(AudioFrameError, match=reason):
        decode_audio(version, data)


def test_v3_rejects_oversized_payload():
    with pytest.raises(AudioFrameError):
        encode_audio(3, b"\x00" * 70000)
