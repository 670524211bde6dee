"""McpClient bounds against a hostile device (in memory): what it logs of the device's strings,
and the requests from the device awaiting an answer (docs/reliability.md)."""

import asyncio
import json
from typing import Any

import pytest
from structlog.testing import capture_logs

from backend.mcp_session import DeviceError, McpClient
from backend.mcp_session.client import MAX_DEVICE_REQUESTS, MAX_ERROR_CHARS
from testkit.stock_device import StockMcp, ok
from tests.fakes.mcp_link import Link, feed_json, running_device

HUGE = 60_000
LINE_CHARS = 1000  # no log line about one device message is longer than this


def rendered(entry: dict[str, Any]) -> str:
    return json.dumps(entry, default=str)


async def test_an_unknown_protocol_version_is_logged_clipped() -> None:
    version = "v" * HUGE
    stock = StockMcp()

    def device(message: dict[str, Any]) -> dict[str, Any] | None:
        if message.get("method") == "initialize":
            return ok(message, {"protocolVersion": version, "serverInfo": {"name": "n" * HUGE}})
        return stock.handle(message)

    link = Link()
    client = McpClient(link.send)
    with capture_logs() as logs:
        async with running_device(client, link, device):
            server = await client.initialize()
    assert server.protocol_version == version  # kept as the device said it, only logs clip
    warned = [entry for entry in logs if entry["event"] == "unknown MCP version from device"]
    assert len(warned) == 1 and warned[0]["version"].startswith("vvv")
    assert all(len(rendered(entry)) < LINE_CHARS for entry in logs), [
        len(rendered(e)) for e in logs
    ]


@pytest.mark.parametrize(
    "error",
    [
        {"message": "m" * HUGE},  # the stock shape, without code
        {"code": -32603, "message": "m" * HUGE},
        "m" * HUGE,  # not even an object
    ],
)
async def test_a_huge_device_error_message_is_clipped(error: Any) -> None:
    link = Link()
    client = McpClient(link.send)

    def device(message: dict[str, Any]) -> dict[str, Any] | None:
        if "id" not in message:
            return None
        return {"jsonrpc": "2.0", "id": message["id"], "error": error}

    async with running_device(client, link, device):
        with pytest.raises(DeviceError) as caught:
            await client.call_tool("self.anything")
    # It ends up in log lines, the device's `error`, API answers: bounded once, at the source.
    assert len(str(caught.value)) <= MAX_ERROR_CHARS + 50
    assert str(caught.value).count("m") >= MAX_ERROR_CHARS - 10


async def test_a_huge_error_without_request_id_is_logged_clipped() -> None:
    link = Link()
    client = McpClient(link.send)
    with capture_logs() as logs:
        feed_json(client, {"jsonrpc": "2.0", "id": None, "error": {"message": "m" * HUGE}})
    assert [entry["event"] for entry in logs] == ["device reported an error without request id"]
    assert len(rendered(logs[0])) < LINE_CHARS


class _Stalled:
    """A link to a device that does not read: every send waits until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.waiting = 0
        self.sent: list[dict[str, Any]] = []

    async def send(self, payload: dict[str, Any]) -> None:
        self.waiting += 1
        try:
            await self.release.wait()
        finally:
            self.waiting -= 1
        self.sent.append(payload)


async def test_requests_from_a_device_that_does_not_read_are_bounded() -> None:
    """Answers to the device's own requests that cannot be written pile up to
    MAX_DEVICE_REQUESTS; the next request is dropped, never queued, and reported once as a
    violation (the session closes the link with 1008 for it)."""
    link = _Stalled()
    violations: list[str] = []
    client = McpClient(link.send, on_violation=violations.append)
    with capture_logs() as logs:
        for n in range(MAX_DEVICE_REQUESTS):
            feed_json(client, {"jsonrpc": "2.0", "id": n, "method": "ping"})
        await _until(lambda: link.waiting == MAX_DEVICE_REQUESTS)
        assert violations == []
        feed_json(client, {"jsonrpc": "2.0", "id": "one too many", "method": "ping"})
        feed_json(client, {"jsonrpc": "2.0", "id": "and another", "method": "ping"})
        await asyncio.sleep(0)
        assert link.waiting == MAX_DEVICE_REQUESTS  # nothing more was queued for it
        assert violations == [f"more than {MAX_DEVICE_REQUESTS} requests in flight"] * 2
        dropped = [entry for entry in logs if entry["event"] == "dropped device request"]
        assert dropped and dropped[0]["reason"] == "too many requests in flight"
        # Once it reads again, the answers go out and its requests are answered again.
        link.release.set()
        await _until(lambda: len(link.sent) == MAX_DEVICE_REQUESTS)
        feed_json(client, {"jsonrpc": "2.0", "id": "later", "method": "ping"})
        await _until(lambda: len(link.sent) == MAX_DEVICE_REQUESTS + 1)
    assert [answer["id"] for answer in link.sent] == [*range(MAX_DEVICE_REQUESTS), "later"]
    client.close("test over")


async def _until(check: Any) -> None:
    async with asyncio.timeout(5):
        while not check():  # noqa: ASYNC110 - the condition has no event to wait on
            await asyncio.sleep(0)
