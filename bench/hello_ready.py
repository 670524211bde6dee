"""Benchmark 3: from a device's hello to READY in the bridge, with three pages of tools.

The simulated device (firmware code, in its own process) gets enough synthetic tools for its
`tools/list` to span three 8000-byte pages; the page count is checked from what the bridge
actually sent (the device counts the tools/list requests it received). The device notes
`time.monotonic_ns()` just before its hello frame goes out, the bridge (this process) notes it
when the READY event fires: CLOCK_MONOTONIC is one clock for the whole machine. Each repetition
is a fresh connection (connect, hello … READY, close).

Same-run baseline, interleaved with the real runs: the very same frames (recorded from our
client and the firmware server), in the same order and with the same dependencies, replayed by
a bare `websockets` server here and a bare `websockets` client in the device's process that
only wait for the right number of frames before sending the next ones: the floor for this
exchange on this machine, with no parsing or MCP work on either side.
"""

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from websockets.asyncio.server import ServerConnection, serve

from backend.devices import DeviceEvent, EventKind
from backend.mcp_session import McpClient
from backend.protocol import AudioParams, ServerHello
from backend.protocol.messages import mcp_envelope
from bench.common import (
    Stats,
    bench_main,
    ms,
    peer,
    quiet_logging,
    ratio,
    running_bridge,
    server_options,
    table,
    verdict,
)
from bench.report import environment

NAME = "hello_ready"
TARGET_MS = 5.0
PAGES = 3
REPS_FULL = 200
REPS_QUICK = 5
WARMUP_FULL = 10
WARMUP_QUICK = 2
SESSION = "0123456789abcdef0123456789abcdef"


def device_server(extra_tools: int) -> Any:
    """The MCP server of a simulated device with `extra_tools` synthetic tools (not started)."""
    from simulator import SimulatedDevice

    return SimulatedDevice("ws://127.0.0.1:9/", None, 1, extra_tools=extra_tools).server


def pages_of(server: Any) -> int:
    pages, cursor = 0, ""
    while True:
        params = {"cursor": cursor, "withUserTools": True}
        request = {"jsonrpc": "2.0", "id": pages + 1, "method": "tools/list", "params": params}
        pages += 1
        cursor = server.handle_message(request)["result"].get("nextCursor")
        if cursor is None:
            return pages


def extra_tools_for(pages: int) -> int:
    """The most synthetic tools that still fit in `pages` pages (so every page is full)."""
    count = 0
    while pages_of(device_server(count + 1)) <= pages:
        count += 1
    return count


async def record_exchange(extra_tools: int) -> list[tuple[str, str]]:
    """Every frame of hello → READY in order, as ("device" | "bridge", text)."""
    from simulator.firmware import firmware_module

    protocol = firmware_module("protocol")
    server = device_server(extra_tools)
    frames = [("device", protocol.device_hello(1))]
    hello = ServerHello(session_id=SESSION, audio_params=AudioParams(sample_rate=24000))
    frames.append(("bridge", hello.to_json()))
    loop = asyncio.get_running_loop()
    client: McpClient

    async def send(payload: dict[str, Any]) -> None:
        frames.append(("bridge", mcp_envelope(SESSION, payload)))
        reply = server.handle_message(payload)
        if reply is not None:
            frames.append(("device", protocol.mcp_envelope(SESSION, reply)))
            loop.call_soon(client.feed, reply)

    client = McpClient(send)
    await client.initialize()
    await client.list_tools(with_user_tools=True)
    return frames


def device_script(frames: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Steps for the replaying device: wait for N bridge frames, then send its next frames."""
    steps: list[dict[str, Any]] = []
    waiting = 0
    for side, text in frames:
        if side == "bridge":
            waiting += 1
        elif steps and waiting == 0:
            steps[-1]["send"].append(text)
        else:
            steps.append({"wait_for": waiting, "send": [text]})
            waiting = 0
    return steps


def bridge_script(frames: list[tuple[str, str]]) -> list[list[str]]:
    """For the replaying server: what to send after the i-th device frame."""
    replies: list[list[str]] = []
    for side, text in frames:
        if side == "device":
            replies.append([])
        else:
            replies[-1].append(text)
    return replies


class ReplayServer:
    """Plays the bridge's side of the recorded exchange; notes when the last frame arrived."""

    def __init__(self, replies: list[list[str]]) -> None:
        self.replies = replies
        self.done_at = 0
        self.done = asyncio.Event()

    async def handler(self, connection: ServerConnection) -> None:
        for texts in self.replies:
            await connection.recv()
            for text in texts:
                await connection.send(text)
        self.done_at = time.monotonic_ns()
        self.done.set()
        await connection.wait_closed()


class ReadyWatch:
    """READY and DISCONNECTED times of one device id, from the registry's events."""

    def __init__(self, device_id: str) -> None:
        self.device_id = device_id
        self.ready_at = 0
        self.ready = asyncio.Event()
        self.gone = asyncio.Event()

    def __call__(self, event: DeviceEvent) -> None:
        if event.device_id != self.device_id:
            return
        if event.kind is EventKind.READY:
            self.ready_at = time.monotonic_ns()
            self.ready.set()
        elif event.kind is EventKind.DISCONNECTED:
            self.gone.set()

    def reset(self) -> None:
        self.ready.clear()
        self.gone.clear()


async def bridge_rep(device: Any, watch: ReadyWatch) -> tuple[int, int]:
    watch.reset()
    await device.send(cmd="device")
    await asyncio.wait_for(watch.ready.wait(), 30)
    await device.send(cmd="stop")
    report = await device.read()
    await asyncio.wait_for(watch.gone.wait(), 30)
    return watch.ready_at - report["hello_at"], report["tools_list_requests"]


async def replay_rep(device: Any, server: ReplayServer) -> int:
    server.done.clear()
    await device.send(cmd="replay")
    await asyncio.wait_for(server.done.wait(), 30)
    await device.send(cmd="stop")
    report = await device.read()
    return server.done_at - report["hello_at"]


async def run(quick: bool) -> str:
    quiet_logging()
    reps, warmup = (REPS_QUICK, WARMUP_QUICK) if quick else (REPS_FULL, WARMUP_FULL)
    extra = extra_tools_for(PAGES)
    frames = await record_exchange(extra)
    replay = ReplayServer(bridge_script(frames))
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        script = Path(scratch) / "script.json"
        script.write_text(json.dumps(device_script(frames)))
        async with (
            running_bridge() as bridge,
            serve(replay.handler, "127.0.0.1", 0, **server_options()) as replay_server,
        ):
            replay_url = f"ws://127.0.0.1:{replay_server.sockets[0].getsockname()[1]}/"
            watch = ReadyWatch("02:00:00:00:00:01")
            bridge.registry.subscribe(watch)
            options = ("--extra-tools", extra, "--replay-url", replay_url, "--script", script)
            async with peer("hello", "--url", bridge.ws_url, *options) as device:
                ours: list[int] = []
                floor: list[int] = []
                pages: set[int] = set()
                for rep in range(warmup + reps):
                    took, listed = await bridge_rep(device, watch)
                    floor_took = await replay_rep(device, replay)
                    pages.add(listed)
                    if rep >= warmup:
                        ours.append(took)
                        floor.append(floor_took)
    return render(extra, frames, pages, Stats.of(ours), Stats.of(floor), quick)


def render(
    extra: int,
    frames: list[tuple[str, str]],
    pages: set[int],
    ours: Stats,
    floor: Stats,
    quick: bool,
) -> str:
    sizes = [len(text.encode()) for _side, text in frames]
    page_note = ", ".join(str(p) for p in sorted(pages))
    rows = [
        ["bridge + simulated device (firmware code)", ms(ours.p50), ms(ours.p99), ms(ours.mean)],
        [
            "replay of the same frames, bare `websockets` (**baseline**)",
            ms(floor.p50),
            ms(floor.p99),
            ms(floor.mean),
        ],
        [
            "ratio",
            ratio(ours.p50, floor.p50),
            ratio(ours.p99, floor.p99),
            ratio(ours.mean, floor.mean),
        ],
    ]
    met = ours.p50 / 1e6 < TARGET_MS
    note = " — **quick run**" if quick else ""
    return f"""## 3. Hello → READY with three pages of tools

{environment()}{note}.

Device: `SimulatedDevice` with {extra} synthetic tools besides the stock ones, in its own
process; tools/list requests the bridge sent per connection, counted on the device:
{page_note}. The exchange is {len(frames)} frames, {sum(sizes):,} bytes (hello, server hello,
initialize and its reply, notifications/initialized, a request and a reply per page). Time from
just before the device's hello frame goes out to the bridge's READY event, on CLOCK_MONOTONIC
across the two processes; {ours.count} fresh connections after warm-up, each followed by one run
of the baseline.

{table(["path", "p50 ms", "p99 ms", "mean ms"], rows)}

Target: under {TARGET_MS:g} ms on loopback (p50): {verdict(met)} ({ms(ours.p50)} ms; p99
{ms(ours.p99)} ms).
"""


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
