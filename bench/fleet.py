"""Benchmark 4: ten thousand simulated devices connected and ready in one bridge process.

The bridge (`python -m bench.peers bridge`, a real `Bridge`, GC tuned as `serve` tunes it), the
fleet started the way a user starts it, `esp32-bridge simulate --devices N` (which spreads itself
over worker processes), and this process, which measures. Time: from just before this process
launches the command to the bridge's N-th distinct READY event (CLOCK_MONOTONIC is one clock for
the machine). Memory: the bridge's RSS and USS (psutil) once it listens and once all N are
ready, per device = delta / N. Then `GET /api/devices` for all N devices (one page of N, a page
of 100, and filtered by state) through httpx.

Same-run baseline: a bare `websockets` echo server (same server options as the bridge) holding
N idle connections of the firmware's WebSocket client (handshake with the same headers, no
messages): its RSS / USS delta per connection is the floor for any `websockets`-based server,
so the ratio shows our own overhead.
"""

import asyncio
import os
import sys
import time
from dataclasses import dataclass

import httpx
import psutil

from bench.common import (
    ADMIN_TOKEN,
    DEVICE_TOKEN,
    REPO,
    Stats,
    bench_main,
    kib,
    ms,
    peer,
    quiet_logging,
    raise_open_files,
    ratio,
    table,
    verdict,
)
from bench.report import environment

NAME = "fleet"
DEVICES_FULL = 10_000
DEVICES_QUICK = 200
TARGET_S = 10.0
TARGET_KIB = 24.0
TARGET_LIST_MS = 200.0
LISTINGS = 7
SETTLE_S = 1.0
SETTLE_QUICK_S = 0.2


@dataclass(frozen=True)
class Memory:
    rss: int
    uss: int


@dataclass(frozen=True)
class FleetRun:
    devices: int
    ready_s: float
    before: Memory
    after: Memory
    settle_s: float
    listings: dict[str, Stats] | None = None

    def per_device(self, field: str) -> float:
        return (getattr(self.after, field) - getattr(self.before, field)) / self.devices


def memory_of(pid: int) -> Memory:
    info = psutil.Process(pid).memory_full_info()
    return Memory(rss=info.rss, uss=info.uss)


async def settled_memory(pid: int, settle_s: float) -> Memory:
    await asyncio.sleep(settle_s)
    return memory_of(pid)


async def bridge_run(count: int, settle_s: float) -> FleetRun:
    async with peer("bridge", "--expect", count) as bridge:
        info = await bridge.read()
        before = await settled_memory(info["pid"], settle_s)
        env = {**os.environ, "BRIDGE_DEVICE_TOKEN": DEVICE_TOKEN}
        started_at = time.monotonic_ns()
        fleet = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "backend.cli", "simulate", "--url", info["ws_url"],
            "--devices", str(count), cwd=REPO, env=env, stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            ready = await bridge.read(timeout_s=180)
            after = await settled_memory(info["pid"], settle_s)
            listings = await list_devices(info["api_url"], count)
        finally:
            fleet.terminate()
            await fleet.wait()
    ready_s = (ready["all_ready_at"] - started_at) / 1e9
    return FleetRun(count, ready_s, before, after, settle_s, listings)


async def list_devices(api_url: str, count: int) -> dict[str, Stats]:
    """Latency of `GET /api/devices`: all devices at once, one page of 100, by state."""
    cases = {
        f"all {count:,} in one page": {"limit": str(count)},
        "a page of 100": {"limit": "100"},
        f"state=ready, all {count:,}": {"limit": str(count), "state": "ready"},
    }
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    results: dict[str, Stats] = {}
    async with httpx.AsyncClient(base_url=api_url, headers=headers, timeout=60) as api:
        for label, params in cases.items():
            samples = []
            for _ in range(LISTINGS):
                began = time.perf_counter_ns()
                response = await api.get("/api/devices", params=params)
                samples.append(time.perf_counter_ns() - began)
                assert response.status_code == 200, response.text
            page = response.json()
            assert page["total"] == count and len(page["devices"]) == min(
                count, int(params["limit"])
            )
            results[label] = Stats.of(samples)
    return results


async def baseline_run(count: int, settle_s: float) -> FleetRun:
    async with peer("echo") as echo:
        info = await echo.read()
        before = await settled_memory(info["pid"], settle_s)
        async with peer("idle", "--url", info["url"], "--count", count) as idle:
            connected = await idle.read(timeout_s=120)
            after = await settled_memory(info["pid"], settle_s)
    ready_s = (connected["done_at"] - connected["started_at"]) / 1e9
    return FleetRun(count, ready_s, before, after, settle_s)


async def run(quick: bool) -> str:
    quiet_logging()
    count = DEVICES_QUICK if quick else DEVICES_FULL
    raise_open_files(2 * count + 256)
    settle_s = SETTLE_QUICK_S if quick else SETTLE_S
    floor = await baseline_run(count, settle_s)
    ours = await bridge_run(count, settle_s)
    return render(ours, floor, quick)


def render(ours: FleetRun, floor: FleetRun, quick: bool) -> str:
    rows = [
        [
            f"bridge: {ours.devices} simulated devices, all READY",
            f"{ours.ready_s:.2f}",
            kib(ours.per_device("rss")),
            kib(ours.per_device("uss")),
            f"{ours.before.rss / 2**20:.1f} → {ours.after.rss / 2**20:.1f}",
        ],
        [
            f"bare `websockets` echo server: {floor.devices} idle connections (**baseline**)",
            f"{floor.ready_s:.2f} (connected)",
            kib(floor.per_device("rss")),
            kib(floor.per_device("uss")),
            f"{floor.before.rss / 2**20:.1f} → {floor.after.rss / 2**20:.1f}",
        ],
        [
            "ratio",
            "",
            ratio(ours.per_device("rss"), floor.per_device("rss")),
            ratio(ours.per_device("uss"), floor.per_device("uss")),
            "",
        ],
    ]
    headers = [
        "server",
        "seconds",
        "RSS KiB / device",
        "USS KiB / device",
        "RSS MiB before → after",
    ]
    time_met = ours.ready_s < TARGET_S
    memory_met = ours.per_device("rss") / 1024 < TARGET_KIB
    listings = ours.listings or {}
    list_rows = [[label, ms(s.p50), ms(s.p99)] for label, s in listings.items()]
    full_listing = next(iter(listings.values()), None)
    list_met = full_listing is not None and full_listing.p50 / 1e6 < TARGET_LIST_MS
    note = f" — **quick run** (targets apply to {DEVICES_FULL:,} devices)" if quick else ""
    return f"""## 4. {ours.devices:,} simulated devices in one bridge process

{environment()}{note}.

Processes: the bridge (`Bridge`, GC tuned as `serve` tunes it), the fleet started as a user
starts it, `esp32-bridge simulate --devices {ours.devices}` (firmware code, stock tools, one page
of tools each; it spreads itself over worker processes, one per 5,000 devices and CPU), and the
measuring one. Time: from just before the command is launched to the bridge's
{ours.devices:,}th READY event (CLOCK_MONOTONIC, both processes). Memory: the bridge's RSS and
USS (psutil) once it listens and {ours.settle_s:g} s after all are ready; per device = delta /
{ours.devices}. Baseline: a bare `websockets` server with the bridge's server options holding as
many idle connections of the firmware's WebSocket client (same handshake headers).

{table(headers, rows)}

`GET /api/devices` with {ours.devices:,} devices connected (httpx, {LISTINGS} requests each):

{table(["request", "p50 ms", "p99 ms"], list_rows)}

Targets: all ready in under {TARGET_S:g} s: {verdict(time_met)} ({ours.ready_s:.2f} s);
under {TARGET_KIB:g} KiB RSS per device: {verdict(memory_met)} ({kib(ours.per_device("rss"))} KiB);
the whole listing in under {TARGET_LIST_MS:g} ms: {verdict(list_met)}.
"""


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
