"""What a device session logs of a device's own strings, over a real WebSocket: clipped, so a
device sending 60 KB fields gets log lines of a bounded length (docs/reliability.md)."""

import json
from typing import Any

from structlog.testing import capture_logs

from backend.devices import DeviceState
from testkit.stock_device import answer_with, stock_error
from tests.helpers import eventually, wait_state

HUGE = 60_000
LINE_CHARS = 1000  # no log line about one device message is longer than this


def rendered(entry: dict[str, Any]) -> str:
    return json.dumps(entry, default=str)


def long_lines(logs: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(e["event"], len(rendered(e))) for e in logs if len(rendered(e)) >= LINE_CHARS]


async def test_a_message_of_a_huge_unknown_type_is_logged_clipped(bridge, wire_devices) -> None:
    device = wire_devices()
    with capture_logs() as logs:
        await device.connect()
        await wait_state(bridge, device.device_id)
        await device.send(json.dumps({"type": "t" * HUGE}))
        await eventually(lambda: any(e["event"] == "dropped device message" for e in logs))
    dropped = next(e for e in logs if e["event"] == "dropped device message")
    assert "unknown message type" in dropped["reason"] and dropped["size"] > HUGE
    assert long_lines(logs) == []


async def test_a_huge_error_from_initialize_is_logged_clipped(bridge, wire_devices) -> None:
    device = wire_devices()
    device.handlers["initialize"] = answer_with(lambda p: stock_error(p, "m" * HUGE))
    with capture_logs() as logs:
        await device.connect()
        failed = await wait_state(bridge, device.device_id, DeviceState.FAILED)
    assert failed.error is not None and 0 < len(failed.error) < 300  # also in the API
    events = [e["event"] for e in logs]
    assert "MCP handshake failed; device stays connected" in events
    assert long_lines(logs) == []


async def test_a_huge_error_when_re_listing_tools_is_logged_clipped(bridge, wire_devices) -> None:
    device = wire_devices()
    with capture_logs() as logs:
        await device.connect()
        await wait_state(bridge, device.device_id)
        device.handlers["tools/list"] = answer_with(lambda p: stock_error(p, "m" * HUGE))
        await device.reply({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        await eventually(lambda: any(e["event"] == "re-listing tools failed" for e in logs), 10)
    assert long_lines(logs) == []
