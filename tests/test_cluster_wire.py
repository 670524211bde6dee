"""The cluster's wire format: every error a forwarded call can raise comes back as the same class
with the same message (so the API's status and body are the local ones), and malformed fleet
events or replies are refused with a clear error, never half-applied."""

from typing import Any

import pytest

from backend.cluster import wire
from backend.devices.errors import (
    ConfirmationRequired,
    DeviceBusy,
    DeviceElsewhere,
    DeviceNotReady,
    DeviceOffline,
    InvalidArguments,
    UnknownDevice,
    UnknownTool,
)
from backend.devices.state import DeviceState, EventKind
from backend.mcp_session import (
    CallResult,
    DeviceDisconnected,
    DeviceError,
    ProtocolViolation,
    RequestTimeout,
)

ERRORS: list[Exception] = [
    UnknownDevice("d1"),
    DeviceOffline("d1", "2026-11-28T10:00:00Z"),
    DeviceNotReady("d1", "initializing"),
    DeviceElsewhere("d1", "c"),
    UnknownTool("d1", "self.audio_speaker.set_volum", ["self.audio_speaker.set_volume"]),
    DeviceBusy("d1", 256),
    InvalidArguments("self.audio_speaker.set_volume", "volume: 500 is greater than 100"),
    ConfirmationRequired("d1", "self.reboot", "it restarts the device"),
    RequestTimeout("tools/call", 0.3, "sim.synthetic_000"),
    DeviceDisconnected("bridge instance c left"),
    DeviceError("no such file", -32603, {"path": "/x"}),
    ProtocolViolation("tools/call content is a string, not an array"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_every_forwarded_error_comes_back_as_itself(error: Exception) -> None:
    reply = wire.loads(wire.dumps(wire.error_reply(error)))
    with pytest.raises(type(error)) as raised:
        wire.parse_reply(reply)
    assert type(raised.value) is type(error)
    assert str(raised.value) == str(error)


def test_an_unknown_error_class_becomes_a_device_error_with_its_message() -> None:
    reply = {"error": {"type": "KeyboardInterrupt", "message": "boom", "fields": {}}}
    with pytest.raises(DeviceError, match="boom"):
        wire.parse_reply(reply)


@pytest.mark.parametrize(
    "reply",
    [
        {},
        {"error": "text"},
        {"error": {"type": "DeviceBusy", "message": "m", "fields": {"device_id": "d"}}},
        {"result": "not an object"},
        {"result": {"content": "not a list"}},
    ],
)
def test_malformed_replies_raise_clear_errors(reply: dict[str, Any]) -> None:
    with pytest.raises((ProtocolViolation, DeviceError)):
        wire.parse_reply(reply)


def test_a_result_round_trips() -> None:
    result = CallResult([{"type": "text", "text": "true"}], False, {"ok": 1}, {})
    parsed = wire.parse_reply(wire.loads(wire.dumps(wire.result_reply(result))))
    assert (parsed.content, parsed.is_error, parsed.structured_content) == (
        result.content,
        False,
        {"ok": 1},
    )


GOOD_REPORT = {
    "kind": "ready",
    "device_id": "d1",
    "owner": "b",
    "epoch": 3,
    "state": "ready",
    "client_id": "c1",
    "transport": "websocket",
    "connected_at": 1.5,
    "server_info": {"name": "sim"},
    "tools": [{"name": "self.get_status", "inputSchema": {"type": "object"}}],
}


def test_a_report_parses() -> None:
    report = wire.parse_report(dict(GOOD_REPORT, extra="ignored"))
    assert (report.kind, report.state, report.epoch, report.owner) == (
        EventKind.READY,
        DeviceState.READY,
        3,
        "b",
    )
    assert report.tools is not None and [t.name for t in report.tools.tools] == ["self.get_status"]


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "tool_called"},  # not a fleet event
        {"kind": "nope"},
        {"state": "asleep"},
        {"epoch": "3"},
        {"epoch": True},
        {"device_id": 7},
        {"owner": None},
        {"tools": {"name": "x"}},
    ],
)
def test_malformed_reports_are_refused(change: dict[str, Any]) -> None:
    with pytest.raises(wire.WireError):
        wire.parse_report({**GOOD_REPORT, **change})


@pytest.mark.parametrize("payload", [b"", b"\xff\xfe", b"[1, 2]", b"nul\x00l", b"{"])
def test_payloads_that_are_not_json_objects_are_refused(payload: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.loads(payload)


def test_reports_are_packed_in_order_under_the_brokers_message_size() -> None:
    reports = [{**GOOD_REPORT, "device_id": f"d{i}", "pad": "x" * 3000} for i in range(60)]
    messages = wire.pack(reports)
    assert len(messages) > 1
    assert all(len(message) <= wire.MAX_MESSAGE_BYTES for message in messages)
    unpacked = [r["device_id"] for m in messages for r in wire.loads(m)["reports"]]
    assert unpacked == [f"d{i}" for i in range(60)]
    assert wire.pack([]) == []
