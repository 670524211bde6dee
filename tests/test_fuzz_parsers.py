"""Every parser of device and API data takes generated hostile input (deep nesting, huge
numbers, invalid UTF-8, wrong types in every field) and lets only its own error out.

A few hundred examples per parser by default; `FUZZ_EXAMPLES=100000` for a long run (the
benchmark `python -m bench.fuzz` runs 100,000 each and reports the time).
"""

import os
from typing import Any

from hypothesis import HealthCheck, given, settings

from testkit.fuzzing import (
    api_bodies,
    audio_frames,
    check_api_body,
    check_argument_check,
    check_audio_frame,
    check_device_frame,
    check_mcp_payload,
    check_mqtt_stream,
    check_reply_results,
    device_frames,
    mcp_payloads,
    mqtt_streams,
    tool_arguments,
    tool_declarations,
)

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
if "FUZZ_EXAMPLES" in os.environ:  # a long run must not hit the suite's per-test timeout
    import pytest

    pytestmark = pytest.mark.timeout(0)


@FUZZ
@given(device_frames)
def test_device_frame_decoder(frame: str | bytes) -> None:
    check_device_frame(frame)


@FUZZ
@given(mcp_payloads)
def test_mcp_client_feed(payload: Any) -> None:
    check_mcp_payload(payload)


@FUZZ
@given(tool_declarations)
def test_mcp_reply_results(result: Any) -> None:
    check_reply_results(result)


@FUZZ
@given(audio_frames)
def test_audio_frame_decoder(frame: tuple[int, bytes]) -> None:
    check_audio_frame(*frame)


@FUZZ
@given(api_bodies)
def test_admin_api_call_body(body: bytes) -> None:
    check_api_body(body)


@FUZZ
@given(tool_arguments)
def test_tool_argument_check(case: tuple[dict[str, Any], Any]) -> None:
    check_argument_check(*case)


@FUZZ
@given(mqtt_streams)
def test_mqtt_packet_reader(data: bytes) -> None:
    check_mqtt_stream(data)


def test_the_known_bombs_are_plain_parse_errors() -> None:
    for frame in ("[" * 30_000, '{"type":"mcp","payload":' + "[" * 20_000, b"\xff\xfe"):
        check_device_frame(frame)
    check_api_body(b"[" * 100_000)
