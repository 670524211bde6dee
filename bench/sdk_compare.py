"""Benchmark 2: our MCP client vs the official SDK's `ClientSession`, latency and memory.

Latency: the same simulated device process (firmware code) keeps two links, one to the bridge
(`WebSocketTransport` → `DeviceSession` → `McpClient`) and one to a second `WebSocketTransport`
in this process whose sessions run the SDK (mcp 2.3.0) `ClientSession` instead: each outgoing
JSON-RPC message is wrapped in `{"session_id","type":"mcp","payload"}`, each incoming envelope
is unwrapped and validated with the SDK's own JSON-RPC adapter. Same transport, same envelopes,
same device: only the MCP client differs. Sequential `tools/call` of the volume tool, paths
interleaved in rounds.

Memory per session: in a fresh child process per side, K sessions are opened against K
in-process firmware MCP servers (stock tools, created before counting) over an in-memory text
link, each initialized and holding the device's tool list (all pages, the 5 tools an SDK client
sees). Counted, after `gc.collect()`: everything allocated to open and keep those K sessions
(Python heap via tracemalloc; RSS delta of another K sessions as a cross-check) divided by K.
Ours: the `McpClient`, its `send` closure and the tools it holds (Tool objects are shared
between sessions that declare the same tools: that is our design). SDK: the `ClientSession`,
its two memory-stream pairs, its receive-loop task and task group, the pump task that carries
its messages (what any SDK transport needs) and the `Tool` list returned by `list_tools`.
Neither side counts sockets or the firmware server.
"""

import argparse
import asyncio
import gc
import json
import secrets
import sys
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import psutil
from mcp import ClientSession, types
from mcp.shared.message import SessionMessage

from backend.mcp_session import McpClient
from backend.protocol import AudioFrame, AudioParams, ServerHello
from backend.transports.admission import Admission, SharedDeviceToken
from backend.transports.base import DeviceLink
from backend.transports.websocket import WebSocketTransport
from bench.common import (
    DEVICE_TOKEN,
    VOLUME_TOOL,
    PathResult,
    Plan,
    bench_main,
    bench_settings,
    interleaved,
    kib,
    peer,
    quiet_logging,
    ratio,
    running_bridge,
    table,
    us,
    verdict,
)
from bench.report import environment

NAME = "sdk_compare"
FULL = Plan(warmup=300, rounds=10, block=200)
QUICK = Plan(warmup=20, rounds=2, block=20)
SESSIONS_FULL = 200
SESSIONS_QUICK = 20
STREAM_BUFFER = 16
MessageStreams = tuple[Any, Any, Any, Any]


def memory_streams() -> MessageStreams:
    """(to_client_send, to_client_receive, from_client_send, from_client_receive)."""
    to_send, to_receive = anyio.create_memory_object_stream[SessionMessage | Exception](
        STREAM_BUFFER
    )
    from_send, from_receive = anyio.create_memory_object_stream[SessionMessage](STREAM_BUFFER)
    return to_send, to_receive, from_send, from_receive


async def list_all_tools(session: ClientSession) -> list[types.Tool]:
    tools: list[types.Tool] = []
    cursor: str | None = None
    while True:
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools += page.tools
        cursor = page.next_cursor
        if cursor is None:
            return tools


def parse_rpc(payload: Any) -> SessionMessage:
    return SessionMessage(types.jsonrpc_message_adapter.validate_python(payload, by_name=False))


# ---- the SDK on a device link -----------------------------------------------------------------


class SdkDeviceSession:
    """The SDK's ClientSession on one device link: the counterpart of our DeviceSession."""

    def __init__(self, link: DeviceLink, on_ready: Callable[["SdkDeviceSession"], None]) -> None:
        self.link = link
        self.session_id = secrets.token_hex(16)
        self.session: ClientSession | None = None
        self.tools: list[types.Tool] = []
        self._on_ready = on_ready
        self._streams = memory_streams()
        self._closed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def on_text(self, text: str) -> None:
        message = json.loads(text)
        if message.get("type") == "mcp":
            await self._streams[0].send(parse_rpc(message["payload"]))
        elif message.get("type") == "hello" and self._task is None:
            hello = ServerHello(session_id=self.session_id, audio_params=AudioParams())
            await self.link.send_text(hello.to_json())
            self._task = asyncio.create_task(self._run())

    def on_audio(self, _frame: AudioFrame) -> None:
        pass

    def on_closed(self, _reason: str) -> None:
        self._closed.set()

    async def _run(self) -> None:
        _to_send, to_receive, from_send, _from_receive = self._streams
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._write)
            async with ClientSession(to_receive, from_send, read_timeout_seconds=10) as session:
                await session.initialize()
                self.tools = await list_all_tools(session)
                self.session = session
                self._on_ready(self)
                await self._closed.wait()
            tasks.cancel_scope.cancel()

    async def _write(self) -> None:
        prefix = '{"session_id":"' + self.session_id + '","type":"mcp","payload":'
        async for outgoing in self._streams[3]:
            payload = outgoing.message.model_dump_json(by_alias=True, exclude_unset=True)
            await self.link.send_text(prefix + payload + "}")


class _SdkAcceptor:
    def __init__(self, on_ready: Callable[[SdkDeviceSession], None]) -> None:
        self._on_ready = on_ready

    def open_link(self, link: DeviceLink) -> SdkDeviceSession:
        return SdkDeviceSession(link, self._on_ready)


# ---- latency ----------------------------------------------------------------------------------


async def latency(plan: Plan) -> dict[str, PathResult]:
    ready: dict[str, SdkDeviceSession] = {}
    sdk_ready = asyncio.Event()

    def on_ready(session: SdkDeviceSession) -> None:
        ready[session.link.identity.device_id] = session
        sdk_ready.set()

    with tempfile.TemporaryDirectory(prefix="bench-") as data_dir:
        sdk_server = WebSocketTransport(
            bench_settings(Path(data_dir)), Admission(SharedDeviceToken(DEVICE_TOKEN))
        )
        await sdk_server.start(_SdkAcceptor(on_ready))
        try:
            async with running_bridge() as bridge:
                sdk_url = f"ws://127.0.0.1:{sdk_server.port}{bridge.settings.ws_path}"
                async with peer("device", "--url", bridge.ws_url, "--url", sdk_url) as devices:
                    ours_id, _sdk_id = (await devices.read())["device_ids"]
                    device = await bridge.registry.wait_for_state(ours_id, timeout_s=30)
                    await asyncio.wait_for(sdk_ready.wait(), 30)
                    sdk = next(iter(ready.values())).session
                    assert sdk is not None
                    check = await sdk.call_tool(VOLUME_TOOL, {"volume": 42})
                    assert not check.is_error and check.content[0].text == "true", check

                    async def ours_call(index: int) -> None:
                        await device.mcp.call_tool(VOLUME_TOOL, {"volume": index % 101})

                    async def sdk_call(index: int) -> None:
                        await sdk.call_tool(VOLUME_TOOL, {"volume": index % 101})

                    paths = {"ours": ours_call, "sdk": sdk_call}
                    probes = {"ours": devices.cpu, "sdk": devices.cpu}
                    return await interleaved(paths, plan, probes)
        finally:
            await sdk_server.stop()


# ---- memory (one child process per side) ------------------------------------------------------


def firmware_servers(count: int) -> list[Any]:
    from simulator.firmware import firmware_module
    from simulator.fleet import BOARD_NAME, FIRMWARE_VERSION

    mcp_server = firmware_module("mcp_server")
    tools_stock = firmware_module("tools_stock")
    hal_fake = firmware_module("hal_fake")
    servers = []
    for _ in range(count):
        server = mcp_server.McpServer(BOARD_NAME, FIRMWARE_VERSION)
        tools_stock.register(server, hal_fake.HalFake(BOARD_NAME, FIRMWARE_VERSION))
        servers.append(server)
    return servers


async def open_ours(server: Any, _stop: asyncio.Event) -> McpClient:
    loop = asyncio.get_running_loop()
    client: McpClient

    async def send(payload: dict[str, Any]) -> None:
        reply = server.handle(json.dumps(payload))
        if reply is not None:
            loop.call_soon(client.feed, json.loads(reply))

    client = McpClient(send)
    await client.initialize()
    await client.list_tools()
    return client


async def open_sdk(server: Any, stop: asyncio.Event) -> Any:
    to_send, to_receive, from_send, from_receive = memory_streams()
    opened: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def pump() -> None:
        async for outgoing in from_receive:
            text = outgoing.message.model_dump_json(by_alias=True, exclude_unset=True)
            reply = server.handle(text)
            if reply is not None:
                message = types.jsonrpc_message_adapter.validate_json(reply, by_name=False)
                await to_send.send(SessionMessage(message))

    async def hold() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(pump)
            async with ClientSession(to_receive, from_send, read_timeout_seconds=10) as session:
                await session.initialize()
                opened.set_result((session, await list_all_tools(session)))
                await stop.wait()
            tasks.cancel_scope.cancel()

    holder = asyncio.create_task(hold())
    return (holder, await opened)


async def memory_child(side: str, count: int) -> dict[str, float]:
    quiet_logging()
    opener = open_ours if side == "ours" else open_sdk
    stop = asyncio.Event()
    servers = firmware_servers(2 * count + 2)
    # Warm-up: imports, caches, the shared tools.
    kept = [await opener(servers.pop(), stop) for _ in range(2)]
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    kept += [await opener(servers.pop(), stop) for _ in range(count)]
    gc.collect()
    rss_after = psutil.Process().memory_info().rss
    tracemalloc.start()
    gc.collect()
    traced_before = tracemalloc.get_traced_memory()[0]
    kept += [await opener(servers.pop(), stop) for _ in range(count)]
    gc.collect()
    traced_after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    stop.set()
    return {
        "traced_per_session": (traced_after - traced_before) / count,
        "rss_per_session": (rss_after - rss_before) / count,
        "sessions": len(kept),
    }


async def memory(count: int) -> dict[str, dict[str, float]]:
    async def child(side: str) -> dict[str, float]:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.sdk_compare",
            "--memory-child",
            side,
            "--sessions",
            str(count),
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"memory child {side} failed with code {process.returncode}")
        return json.loads(out.decode().strip().splitlines()[-1])

    ours, sdk = await asyncio.gather(child("ours"), child("sdk"))
    return {"ours": ours, "sdk": sdk}


# ---- report -----------------------------------------------------------------------------------


async def run(quick: bool) -> str:
    quiet_logging()
    plan = QUICK if quick else FULL
    count = SESSIONS_QUICK if quick else SESSIONS_FULL
    results = await latency(plan)
    sizes = await memory(count)
    return render(plan, count, results, sizes)


def render(
    plan: Plan, count: int, results: dict[str, PathResult], sizes: dict[str, dict[str, float]]
) -> str:
    ours, sdk = results["ours"].stats, results["sdk"].stats
    ours_cpu, ours_peer = results["ours"].cpu_per_call_ns()
    sdk_cpu, sdk_peer = results["sdk"].cpu_per_call_ns()
    latency_rows = [
        ["ours: `McpClient.call_tool`", us(ours.p50), us(ours.p99), us(ours_cpu), us(ours_peer)],
        ["SDK: `ClientSession.call_tool`", us(sdk.p50), us(sdk.p99), us(sdk_cpu), us(sdk_peer)],
        [
            "ours / SDK",
            ratio(ours.p50, sdk.p50),
            ratio(ours.p99, sdk.p99),
            ratio(ours_cpu, sdk_cpu),
            "",
        ],
    ]
    mem_ours, mem_sdk = sizes["ours"], sizes["sdk"]
    memory_rows = [
        [
            "ours: `McpClient`",
            kib(mem_ours["traced_per_session"]),
            kib(mem_ours["rss_per_session"]),
        ],
        [
            "SDK: `ClientSession` + streams + tasks",
            kib(mem_sdk["traced_per_session"]),
            kib(mem_sdk["rss_per_session"]),
        ],
        [
            "ours / SDK",
            ratio(mem_ours["traced_per_session"], mem_sdk["traced_per_session"]),
            ratio(mem_ours["rss_per_session"], mem_sdk["rss_per_session"]),
        ],
    ]
    latency_ratio = ours.p50 / sdk.p50
    memory_ratio = mem_ours["traced_per_session"] / mem_sdk["traced_per_session"]
    quick = " — **quick run**" if plan.rounds < 3 else ""
    return f"""## 2. Our MCP client vs the official SDK `ClientSession` (mcp 2.3.0)

{environment()}{quick}.

Latency: one simulated device process (firmware code) keeps a link to the bridge and one to a
`WebSocketTransport` whose sessions run the SDK `ClientSession` on the same envelopes.
{plan.rounds} interleaved rounds of {plan.block} sequential `tools/call` per side after
{plan.warmup} warm-up calls ({ours.count} samples each). CPU per call: "client" is the benchmark
process, "device" the device process.

{table(["client", "p50 µs", "p99 µs", "CPU client µs", "CPU device µs"], latency_rows)}

Memory: {count} sessions per side, each initialized and holding the device's 5 tools, against
in-process firmware MCP servers over an in-memory link, one fresh process per side. Python heap
per session (tracemalloc, after `gc.collect()`) and RSS delta per session of another {count}
sessions (cross-check; page-granular). Ours counts the `McpClient`, its `send` closure and its
tools (Tool objects are shared between sessions declaring the same tools); the SDK counts the
`ClientSession`, its memory streams, its receive-loop task, task group and message pump, and the
`list_tools` result. Sockets and firmware servers are not counted on either side.

{table(["client", "heap KiB / session", "RSS KiB / session"], memory_rows)}

Targets: latency ours ≤ 0.5 × SDK (p50): {verdict(latency_ratio <= 0.5)} ({latency_ratio:.2f});
memory ours ≤ 1/3 × SDK: {verdict(memory_ratio <= 1 / 3)} ({memory_ratio:.2f}).
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--memory-child", choices=("ours", "sdk"))
    parser.add_argument("--sessions", type=int, default=SESSIONS_FULL)
    known, rest = parser.parse_known_args(argv)
    if known.memory_child:
        print(json.dumps(asyncio.run(memory_child(known.memory_child, known.sessions))))
        return
    bench_main(NAME, __doc__ or NAME, run, rest)


if __name__ == "__main__":
    main()
