"""Benchmark: a tool call to a dialed-in MCP server (the MCP endpoint) against the same call in
memory.

The figure is what the WebSocket hop adds to one `tools/call`, at p50: the hub's
`SessionServer.call` on a server that dialed in to `DialInEndpoint` (uvicorn on loopback, the
bridge's pipe adapter, the SDK `ClientSession`), minus the same `SessionServer.call` on a
`ClientSession` whose streams go straight to the same responder in memory (the **baseline**, no
socket). The responder answers `initialize`, `tools/list` and `tools/call` (an `echo`) the way a
pipe relays its server's answers; over the socket it is a `websockets` client, as the stock pipes
are. Everything runs in the benchmark process, in rounds that alternate the two paths. The
handshake (connect, `initialize`, `tools/list`, registered in the hub) is timed the same way.
"""

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import mcp_types
import uvicorn
from mcp import ClientSession
from mcp.shared.message import SessionMessage
from starlette.applications import Starlette
from websockets.asyncio.client import ClientConnection, connect

from backend.keys import Principal, Scope
from backend.mcp_dialin.endpoint import DialInEndpoint, DialInLimits, server_name
from backend.mcp_servers.hub import McpServerHub, SessionServer
from bench.common import Stats, bench_main, quiet_logging, table, us, verdict
from bench.report import environment

NAME = "mcp_dialin"
# The issue sets none: the hop should cost no more than a device's own tools/call over the
# device WebSocket does beyond a raw echo (bench/tool_call.py), well under a millisecond.
TARGET_HOP_P50_MS = 1.0
KEY_ID = "0123456789ab"
TOKEN = "bench-dialin-token"
ECHO_TOOL = {
    "name": "echo",
    "description": "Echo the text back.",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
}
ARGUMENTS = {"text": "hello"}


def answer(message: dict[str, Any]) -> dict[str, Any] | None:
    """The responder's reply to one JSON-RPC message (None for notifications and replies)."""
    method = message.get("method")
    if method is None or "id" not in message:
        return None
    if method == "initialize":
        result: dict[str, Any] = {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "bench-responder", "version": "1"},
        }
    elif method == "tools/list":
        result = {"tools": [ECHO_TOOL]}
    elif method == "tools/call":
        text = message["params"]["arguments"]["text"]
        result = {"content": [{"type": "text", "text": text}], "isError": False}
    else:
        result = {}
    return {"jsonrpc": "2.0", "id": message["id"], "result": result}


async def _respond_over(ws: ClientConnection) -> None:
    async for frame in ws:
        reply = answer(json.loads(frame))
        if reply is not None:
            await ws.send(json.dumps(reply))


class _Host:
    """The endpoint alone under uvicorn on 127.0.0.1:0, with one key."""

    def __init__(self) -> None:
        self.hub = McpServerHub()
        principal = Principal(KEY_ID, "bench", frozenset({Scope.MCP_ENDPOINT}), frozenset({"d"}))
        self.endpoint = DialInEndpoint(
            self.hub,
            lambda token: principal if token == TOKEN else None,
            DialInLimits(max_per_key=4),
        )
        # proto TCP: asyncio then sets TCP_NODELAY on accepted sockets (as backend/server.py does)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(64)
        config = uvicorn.Config(
            Starlette(routes=self.endpoint.routes),
            log_config=None,
            access_log=False,
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        port = self._socket.getsockname()[1]
        return f"ws://127.0.0.1:{port}/v1/mcp-endpoint/?token={TOKEN}"

    async def __aenter__(self) -> "_Host":
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:  # noqa: ASYNC110 - uvicorn sets a flag, no event
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.endpoint.stop()
        self._server.should_exit = True
        if self._task is not None:
            await self._task

    async def dial(self) -> tuple[SessionServer, ClientConnection, asyncio.Task[None]]:
        """A responder dialing in; returns once its server is registered."""
        name = server_name(KEY_ID)
        old = self.hub.get(name)
        ws = await connect(self.url)
        task = asyncio.create_task(_respond_over(ws))
        while (server := self.hub.get(name)) is None or server is old:  # noqa: ASYNC110
            await asyncio.sleep(0)
        assert isinstance(server, SessionServer)
        return server, ws, task


async def _in_memory() -> tuple[SessionServer, Callable[[], Awaitable[None]]]:
    """The baseline: the same server type on a `ClientSession` wired to the responder directly."""
    to_server, server_reads = anyio.create_memory_object_stream[SessionMessage](0)
    to_client, client_reads = anyio.create_memory_object_stream[SessionMessage | Exception](0)

    async def respond() -> None:
        async for incoming in server_reads:
            message = incoming.message.model_dump(by_alias=True, exclude_none=True, mode="json")
            reply = answer(message)
            if reply is not None:
                parsed = mcp_types.jsonrpc_message_adapter.validate_python(reply, by_name=False)
                await to_client.send(SessionMessage(parsed))

    responder = asyncio.create_task(respond())
    session = ClientSession(client_reads, to_server)
    await session.__aenter__()
    await session.initialize()
    server = SessionServer("memory", kind="dialin", bound_device_ids=frozenset({"d"}))
    await server.attach(session)

    async def close() -> None:
        await session.__aexit__(None, None, None)
        responder.cancel()

    return server, close


async def measure(rounds: int, per_round: int, warmup: int) -> dict[str, Stats]:
    samples: dict[str, list[int]] = {"dialin": [], "memory": [], "dial": [], "attach": []}
    async with _Host() as host:
        dialed, ws, task = await host.dial()
        memory, close_memory = await _in_memory()
        for _ in range(warmup):
            await dialed.call("echo", ARGUMENTS)
            await memory.call("echo", ARGUMENTS)
        for _ in range(rounds):
            for label, server in (("dialin", dialed), ("memory", memory)):
                for _ in range(per_round):
                    began = time.perf_counter_ns()
                    result = await server.call("echo", ARGUMENTS)
                    samples[label].append(time.perf_counter_ns() - began)
                    assert result.content == [{"type": "text", "text": "hello"}]
            began = time.perf_counter_ns()
            dialed, new_ws, new_task = await host.dial()  # replaces the previous dial-in
            samples["dial"].append(time.perf_counter_ns() - began)
            await ws.close()
            task.cancel()
            ws, task = new_ws, new_task
            began = time.perf_counter_ns()
            _extra, close_extra = await _in_memory()
            samples["attach"].append(time.perf_counter_ns() - began)
            await close_extra()
        await close_memory()
        await ws.close()
        task.cancel()
    return {label: Stats.of(values) for label, values in samples.items()}


async def run(quick: bool) -> str:
    quiet_logging()
    rounds, per_round, warmup = (4, 25, 20) if quick else (20, 250, 300)
    stats = await measure(rounds, per_round, warmup)
    dialin, memory = stats["dialin"], stats["memory"]
    hop_ns = dialin.p50 - memory.p50
    met = hop_ns / 1e6 <= TARGET_HOP_P50_MS
    rows = [
        ["`SessionServer.call` to a dialed-in server (WebSocket)", us(dialin.p50), us(dialin.p99)],
        ["the same call in memory (**baseline**)", us(memory.p50), us(memory.p99)],
        [
            "dial-in: connect, initialize, tools/list, registered",
            us(stats["dial"].p50),
            us(stats["dial"].p99),
        ],
        [
            "in memory: initialize, tools/list (**baseline**)",
            us(stats["attach"].p50),
            us(stats["attach"].p99),
        ],
    ]
    quick_note = " — **quick run**" if quick else ""
    return f"""## A dialed-in MCP server's tool call (`bench/mcp_dialin.py`)

{environment()}{quick_note}.

One `tools/call` (an `echo`) through the hub's `SessionServer.call` to a server that dialed in to
the MCP endpoint (`DialInEndpoint` under uvicorn on loopback, a `websockets` client answering as
a pipe relays its server's answers), against the same call on a `ClientSession` wired to the same
responder in memory. {rounds} rounds of {per_round} calls per path, alternating, after
{warmup} warm-up calls each; one dial-in (replacing the previous) per round. Everything in the
benchmark process.

{table(["path", "p50 µs", "p99 µs"], rows)}

The WebSocket hop adds {us(hop_ns)} µs per call at p50; target ≤ {TARGET_HOP_P50_MS:g} ms:
{verdict(met)}.
"""


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
