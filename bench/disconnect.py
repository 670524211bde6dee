"""Benchmark 5: a device killed mid-call — how soon does the admin API answer 503?

The bridge (the real `Bridge`) and a device speaking the stock wire format run in this process.
The device answers initialize and tools/list, then never answers a tools/call; while the call
waits in `POST /api/devices/{id}/tools/call`, the device's TCP connection is aborted (no close
frame, as stock firmware does on reset or network loss). Measured: from the abort to the 503
response arriving at the HTTP client. Same-run baseline: a plain `GET /api/devices/{id}` round
trip through the same HTTP client, so the figure can be read on a noisy machine. Target: the
503 within 100 ms.
"""

import asyncio
import json
import time
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

from backend.devices import EventKind
from bench.common import (
    ADMIN_TOKEN,
    DEVICE_TOKEN,
    Stats,
    bench_main,
    ms,
    quiet_logging,
    ratio,
    running_bridge,
    table,
    verdict,
)
from bench.report import environment

NAME = "disconnect"
TARGET_MS = 100.0
REPS_FULL = 100
REPS_QUICK = 5
DEVICE_ID = "a4:cf:12:34:56:78"
TOOL = {"name": "self.slow", "description": "never answers", "inputSchema": {"type": "object"}}
HELLO = {"type": "hello", "version": 1, "features": {"mcp": True}, "transport": "websocket"}
RESULTS: dict[str, Any] = {
    "initialize": {
        "protocolVersion": "2024-11-05",
        "capabilities": {"tools": {}},
        "serverInfo": {"name": "bench-device", "version": "1"},
    },
    "tools/list": {"tools": [TOOL]},
}


async def hanging_device(
    url: str, call_arrived: asyncio.Event
) -> tuple[ClientConnection, asyncio.Task[None]]:
    """Connect, hello, answer the MCP handshake; flag the tools/call and leave it unanswered."""
    headers = {"Authorization": f"Bearer {DEVICE_TOKEN}", "Device-Id": DEVICE_ID}
    ws = await connect(url, additional_headers=headers, compression=None)
    await ws.send(json.dumps(HELLO))

    async def serve() -> None:
        async for text in ws:
            message = json.loads(text)
            payload = message.get("payload") or {}
            method = payload.get("method")
            if method in RESULTS:
                reply = {"jsonrpc": "2.0", "id": payload["id"], "result": RESULTS[method]}
                await ws.send(json.dumps({"type": "mcp", "payload": reply}))
            elif method == "tools/call":
                call_arrived.set()

    return ws, asyncio.create_task(serve())


async def one_kill(bridge: Any, api: httpx.AsyncClient) -> tuple[int, int]:
    """(ns from abort to the 503, ns of a plain GET round trip just before)."""
    call_arrived = asyncio.Event()
    ws, serving = await hanging_device(bridge.ws_url, call_arrived)
    device = await bridge.registry.wait_for_state(DEVICE_ID)
    began = time.perf_counter_ns()
    await api.get(f"/api/devices/{DEVICE_ID}")
    baseline = time.perf_counter_ns() - began
    path = f"/api/devices/{DEVICE_ID}/tools/call"
    request = asyncio.create_task(api.post(path, json={"name": "self.slow", "timeout_s": 30}))
    await call_arrived.wait()
    killed = time.perf_counter_ns()
    ws.transport.abort()
    response = await request
    elapsed = time.perf_counter_ns() - killed
    if response.status_code != 503:
        raise RuntimeError(f"expected 503, got {response.status_code}: {response.text}")
    serving.cancel()
    gone = asyncio.Event()
    unsubscribe = bridge.registry.subscribe(
        lambda event: gone.set() if event.kind is EventKind.DISCONNECTED else None
    )
    if bridge.registry.get(DEVICE_ID) is device:
        await gone.wait()
    unsubscribe()
    return elapsed, baseline


async def run(quick: bool) -> str:
    quiet_logging()
    reps = REPS_QUICK if quick else REPS_FULL
    kills, baselines = [], []
    async with running_bridge() as bridge:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as api:
            await one_kill(bridge, api)  # warm-up
            for _ in range(reps):
                elapsed, baseline = await one_kill(bridge, api)
                kills.append(elapsed)
                baselines.append(baseline)
    kill, base = Stats.of(kills), Stats.of(baselines)
    rows = [
        ["device killed mid-call → 503 from the admin API", ms(kill.p50), ms(kill.p99)],
        ["plain `GET /api/devices/{id}` round trip (**baseline**)", ms(base.p50), ms(base.p99)],
        ["ratio", ratio(kill.p50, base.p50), ratio(kill.p99, base.p99)],
    ]
    note = " — **quick run**" if quick else ""
    return f"""## 5. Device killed mid-call → 503

{environment()}{note}.

The bridge and a device speaking the stock wire format in one process; the device leaves a
`tools/call` unanswered and its TCP connection is aborted without a close frame while
`POST /api/devices/{{id}}/tools/call` waits. From the abort to the 503 arriving at the HTTP
client, {reps} kills after a warm-up (a fresh connection each).

{table(["path", "p50 ms", "p99 ms"], rows)}

Target: 503 within {TARGET_MS:g} ms: {verdict(kill.p99 / 1e6 < TARGET_MS)} (p99 {ms(kill.p99)} ms).
"""


def main() -> None:
    bench_main(NAME, __doc__ or NAME, run)


if __name__ == "__main__":
    main()
