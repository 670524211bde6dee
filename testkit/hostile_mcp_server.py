"""A hostile MCP server that dials in to the bridge's MCP endpoint (issue #32, item 1).

Raw JSON-RPC over the dial-in WebSocket (one message per text frame, as `mcp_pipe.py` relays),
so every byte is the attacker's choice: `tools/list` answers 50 pages of ~1 MiB (500 tools with
~95 KB input schemas), over-long and bad-charset names and a deep schema on the first page, a
`notifications/tools/list_changed` every 20 ms, and a `big` tool whose result is 1 MB of text.

`HostileServer` is used by tests/test_mcp_server_bounds.py and, in its own process
(`python -m testkit.hostile_mcp_server URL SECONDS`, one JSON report line on stdout), by
bench/reliability_mcp_servers.py.
"""

import asyncio
import contextlib
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

ECHO = {
    "name": "echo",
    "description": "Echo the text back.",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
}
BIG = {"name": "big", "description": "A lot of text.", "inputSchema": {"type": "object"}}
LONG_NAME = "n" * 200
BAD_NAMES = ("say hi", "say/ü", "drop;table", "tab\there")
DEEP_DEPTH = 40


def fat_schema(size: int) -> dict[str, Any]:
    """An object schema of about `size` bytes (properties with long descriptions)."""
    count = max(1, size // 1000)
    filler = "y" * max(1, size // count - 40)
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": filler} for i in range(count)},
    }


def deep_schema(depth: int) -> dict[str, Any]:
    """An object schema nested `depth` levels deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@dataclass
class HostileReport:
    """What the attacker saw: requests it got, re-lists (tools/list for the first page after the
    first), their spacing, notifications it sent, and the bytes of its answers."""

    tools_list: int = 0
    first_pages: int = 0
    first_page_times: list[float] = field(default_factory=list)
    notifications: int = 0
    calls: int = 0
    bytes_sent: int = 0
    close_code: int | None = None

    def relists(self) -> int:
        """tools/list requests for the first page after the handshake's."""
        return max(0, self.first_pages - 1)

    def min_relist_gap_s(self) -> float | None:
        """The shortest time between two first-page requests (None with fewer than two)."""
        times = self.first_page_times
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
        return min(gaps) if gaps else None


class HostileServer:
    """`await HostileServer(url).start()`; `flood(seconds)` sends list_changed every 20 ms."""

    def __init__(
        self,
        url: str,
        *,
        pages: int = 50,
        fat_per_page: int = 10,
        schema_bytes: int = 95_000,
        result_bytes: int = 1_000_000,
        notify_every_s: float = 0.02,
    ) -> None:
        self.url = url
        self.pages = pages
        self.fat_per_page = fat_per_page
        self.fat = fat_schema(schema_bytes)
        self.result_bytes = result_bytes
        self.notify_every_s = notify_every_s
        self.report = HostileReport()
        self.ws: ClientConnection | None = None
        self._task: asyncio.Task[None] | None = None
        self._page_cache: dict[int, str] = {}

    def page(self, index: int) -> dict[str, Any]:
        """The tools of page `index` (fresh names on every page; the first has the odd ones)."""
        tools: list[dict[str, Any]] = []
        if index == 0:
            tools += [ECHO, BIG, {**ECHO, "name": LONG_NAME}]
            tools += [{**ECHO, "name": name} for name in BAD_NAMES]
            tools.append({**ECHO, "name": "deep", "inputSchema": deep_schema(DEEP_DEPTH)})
        tools += [
            {"name": f"fat_{index}_{i}", "description": "d" * 200, "inputSchema": self.fat}
            for i in range(self.fat_per_page)
        ]
        result: dict[str, Any] = {"tools": tools}
        if index + 1 < self.pages:
            result["nextCursor"] = f"page-{index + 1}"
        return result

    async def start(self) -> "HostileServer":
        self.ws = await connect(self.url, max_size=None)
        self._task = asyncio.create_task(self._serve())
        return self

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task

    async def flood(self, seconds: float) -> None:
        """`notifications/tools/list_changed` every `notify_every_s` for `seconds`."""
        assert self.ws is not None
        notice = json.dumps({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                await self.ws.send(notice)
            except ConnectionClosed:
                return
            self.report.notifications += 1
            await asyncio.sleep(self.notify_every_s)

    async def _serve(self) -> None:
        assert self.ws is not None
        try:
            async for frame in self.ws:
                message = json.loads(frame)
                reply = self.reply(message)
                if reply is not None:
                    self.report.bytes_sent += len(reply)
                    await self.ws.send(reply)
        except ConnectionClosed:
            pass
        self.report.close_code = self.ws.close_code

    def reply(self, message: dict[str, Any]) -> str | None:
        """The answer to one request, as the text frame to send (None for anything else)."""
        method, request_id = message.get("method"), message.get("id")
        if request_id is None or method is None:
            return None
        if method == "initialize":
            result: dict[str, Any] = {
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": {"name": "hostile", "version": "1"},
            }
        elif method == "tools/list":
            cursor = (message.get("params") or {}).get("cursor") or "page-0"
            index = int(cursor.removeprefix("page-"))
            self.report.tools_list += 1
            if index == 0:
                self.report.first_pages += 1
                self.report.first_page_times.append(time.monotonic())
            if index not in self._page_cache:
                self._page_cache[index] = json.dumps(self.page(index))
            head = f'{{"jsonrpc":"2.0","id":{json.dumps(request_id)},"result":'
            return f"{head}{self._page_cache[index]}}}"
        elif method == "tools/call":
            self.report.calls += 1
            name = message["params"]["name"]
            text = "x" * self.result_bytes if name == "big" else "echo"
            result = {"content": [{"type": "text", "text": text}], "isError": False}
        elif method == "ping":
            result = {}
        else:
            error = {"code": -32601, "message": "no"}
            return json.dumps({"jsonrpc": "2.0", "id": request_id, "error": error})
        return json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result})


async def attack(url: str, seconds: float) -> HostileReport:
    """Dial in, wait for the handshake, flood list_changed for `seconds`, then leave."""
    server = await HostileServer(url).start()
    try:
        while server.report.tools_list == 0:  # noqa: ASYNC110 - no event: the bridge lists
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        await server.flood(seconds)
    finally:
        await server.close()
    return server.report


def main() -> None:
    url, seconds = sys.argv[1], float(sys.argv[2])
    report = asyncio.run(attack(url, seconds))
    fields = asdict(report)
    fields["relists"] = report.relists()
    fields["min_relist_gap_s"] = report.min_relist_gap_s()
    del fields["first_page_times"]
    print(json.dumps(fields))


if __name__ == "__main__":
    main()
