"""Benchmark: a chat turn that calls one external MCP server tool (stdio) and one device tool.

The figure is the turn's overhead beyond the two calls themselves, at p50. What runs is the real
`ChatService` on a real SQLite database (temporary folder), a zero-latency in-process model
(`bench.chat.ZeroLlm`'s kind) whose first round asks for both calls at once, a device running the
real firmware tool code in-process (`self.audio_speaker.set_volume`), and an external server
connected by the hub's `ConfiguredServer` over stdio: a child process written with the official
SDK's `MCPServer` (`bench/mcp_echo_server.py`, one `echo` tool).

Per turn the two calls are timed where the toolbox makes them (`DeviceToolBox.call` and
`ExternalServer.call`), so "overhead" is the turn minus its own two calls, turn by turn. Baselines
in the same run, interleaved with the turns: the same two calls made bare (the firmware device's
`call_tool`, and the SDK `ClientSession.call_tool` on the same connection), and the same turn with
the device tool alone (what the external server adds to a turn besides its call).
"""

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from backend.chat import (
    CHAT_MIGRATIONS,
    ChatService,
    DeviceToolBox,
    SqliteMemoryStore,
    TurnRequest,
    collect,
)
from backend.chat.events import Done
from backend.chat.llm.base import (
    ANY_SAMPLING,
    FunctionSpec,
    Message,
    Sampling,
    StreamEnd,
    StreamItem,
    TextDelta,
    ToolCall,
)
from backend.mcp_servers.connectors import ConfiguredServer
from backend.mcp_servers.hub import ServerState
from backend.mcp_servers.settings import McpServerSettings
from backend.mcp_servers.toolbox import CombinedToolBox
from backend.storage import Database
from bench.chat import ZeroLlm, ZeroSearch
from bench.common import Stats, bench_main, ms, quiet_logging, table, verdict
from bench.report import environment
from testkit.in_process import FirmwareDevice

NAME = "mcp_servers"
TARGET_OVERHEAD_P50_MS = (
    5.0  # the chat bench's per-turn target (bench/chat.py); the issue sets none
)
VOLUME = ("self_audio_speaker_set_volume", {"volume": 40})
ECHO = ("echo__echo", {"text": "hello"})
SERVER_SCRIPT = Path(__file__).with_name("mcp_echo_server.py")


class TwoCallLlm(ZeroLlm):
    """First round: the given tool calls at once; then the answer."""

    def __init__(self, *calls: tuple[str, dict[str, Any]]) -> None:
        super().__init__()
        self.calls = calls

    async def stream(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        tools: Sequence[FunctionSpec] = (),
        sampling: Sampling = ANY_SAMPLING,
    ) -> AsyncIterator[StreamItem]:
        if tools and messages[-1].role != "tool":
            offered = {spec.llm_name for spec in tools}
            for index, (name, arguments) in enumerate(self.calls):
                assert name in offered, f"{name} not offered: {sorted(offered)}"
                yield ToolCall(f"call_{index}", name, arguments, json.dumps(arguments))
            yield StreamEnd("tool_calls")
            return
        for delta in self._deltas:
            yield TextDelta(delta)
        yield StreamEnd("stop")


class _Timed:
    """Adds up the time spent inside `call` of the wrapped object (a toolbox or a server)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.spent_ns = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def call(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter_ns()
        try:
            return await self.inner.call(*args, **kwargs)
        finally:
            self.spent_ns += time.perf_counter_ns() - began


async def _connected_server() -> ConfiguredServer:
    settings = McpServerSettings(
        name="echo", command=sys.executable, args=[str(SERVER_SCRIPT)], timeout_s=10
    )
    server = ConfiguredServer(settings, health_interval_s=3600)
    await server.start()
    async with asyncio.timeout(30):
        while server.state is not ServerState.READY:  # noqa: ASYNC110 - no event to wait on
            await asyncio.sleep(0.01)
    return server


async def measure(turns: int, warmup: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-mcp-") as folder:
        db = Database(Path(folder) / "bench.sqlite3", CHAT_MIGRATIONS)
        await db.open()
        memory = SqliteMemoryStore(db)
        both = ChatService(memory, TwoCallLlm(VOLUME, ECHO), ZeroSearch())
        device_only = ChatService(memory, TwoCallLlm(VOLUME), ZeroSearch())
        device = FirmwareDevice()
        server = await _connected_server()
        session = server._session
        assert session is not None
        samples: dict[str, list[int]] = {
            "turn": [],
            "turn - its two calls": [],
            "two calls inside the turn": [],
            "(baseline) the two calls, bare": [],
            "(baseline) the turn with the device tool alone": [],
        }
        try:
            for turn in range(warmup + turns):
                keep = turn >= warmup
                timed_server = _Timed(server)
                timed_device = _Timed(DeviceToolBox(device))
                toolbox = CombinedToolBox(
                    timed_device,
                    lambda server=timed_server: [server],  # type: ignore[misc]
                    actor="bench",
                )
                text = "Set the volume to 40 and echo hello"
                request = TurnRequest(text=text, conversation_id=f"c{turn % 50}")
                began = time.perf_counter_ns()
                events = await collect(both.run_turn(request, toolbox))
                elapsed = time.perf_counter_ns() - began
                assert isinstance(events[-1], Done) and events[-1].metadata.tool_rounds == 1
                inside = timed_device.spent_ns + timed_server.spent_ns
                assert timed_device.spent_ns and timed_server.spent_ns, "a call did not run"

                began = time.perf_counter_ns()
                await device.call_tool("self.audio_speaker.set_volume", VOLUME[1])
                await session.call_tool("echo", ECHO[1])
                bare = time.perf_counter_ns() - began

                alone = TurnRequest(text="Set the volume to 40", conversation_id=f"d{turn % 50}")
                began = time.perf_counter_ns()
                await collect(device_only.run_turn(alone, DeviceToolBox(device)))
                device_turn = time.perf_counter_ns() - began
                if keep:
                    samples["turn"].append(elapsed)
                    samples["turn - its two calls"].append(elapsed - inside)
                    samples["two calls inside the turn"].append(inside)
                    samples["(baseline) the two calls, bare"].append(bare)
                    samples["(baseline) the turn with the device tool alone"].append(device_turn)
        finally:
            await server.stop()
            await db.close()
    return {label: Stats.of(values) for label, values in samples.items()}


async def run(quick: bool) -> str:
    quiet_logging()
    turns, warmup = (40, 10) if quick else (1000, 100)
    stats = await measure(turns, warmup)
    rows = [[label, ms(s.p50), ms(s.p99), ms(s.mean), s.count] for label, s in stats.items()]
    overhead = stats["turn - its two calls"]
    inside, bare = stats["two calls inside the turn"], stats["(baseline) the two calls, bare"]
    alone = stats["(baseline) the turn with the device tool alone"]
    quick_note = " — **quick run**" if quick else ""
    return f"""## External MCP servers in a chat turn (`bench/mcp_servers.py`)

{environment()}{quick_note}.

One chat turn whose model calls, in one round, a device tool (`self.audio_speaker.set_volume`
on the firmware's tool code, in-process) and a tool of an external MCP server over stdio (an
SDK `MCPServer` child process, connected once by the hub's `ConfiguredServer`, one `echo`
tool). The real `ChatService` and SQLite memory; a zero-latency in-process model and search.
{turns} turns after {warmup} warm-up turns, each followed by its baselines (interleaved).

{table(["measure", "p50 ms", "p99 ms", "mean ms", "samples"], rows)}

**Figure: overhead of the turn beyond its two calls, p50: {ms(overhead.p50)} ms** (the turn
minus the time spent inside its own two calls, turn by turn). The two calls take
{ms(inside.p50)} ms at p50 inside the turn, against {ms(bare.p50)} ms made bare (the SDK
`ClientSession.call_tool` plus the device's `call_tool`): the toolbox's own share (name mapping,
risk check, audit event, result bounding) is {ms(inside.p50 - bare.p50)} ms. The same turn with
the device tool alone takes {ms(alone.p50)} ms: the external server adds
{ms(stats["turn"].p50 - alone.p50)} ms to a turn, its call included.

Target (set by this bench, the chat bench's per-turn figure; the issue names none): overhead
p50 ≤ {TARGET_OVERHEAD_P50_MS:g} ms: {verdict(overhead.p50 / 1e6 <= TARGET_OVERHEAD_P50_MS)}.
"""


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
