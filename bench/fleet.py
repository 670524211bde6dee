"""Benchmark 4: a thousand simulated devices connected and ready in one bridge process.

Three processes: the bridge (`python -m bench.peers bridge`, a real `Bridge`), the fleet
(`simulator.run_fleet`: the firmware code, stock tools) and this one, which measures. The
fleet notes `time.monotonic_ns()` just before it creates its first device; the bridge notes
when its N-th distinct device became READY (CLOCK_MONOTONIC is one clock for the machine).
Memory: the bridge's RSS and USS (psutil) once it listens and once all N are ready, per device
= delta / N.

Same-run baseline: a bare `websockets` echo server (same server options as the bridge) holding
N idle connections of the firmware's WebSocket client (handshake with the same headers, no
messages): its RSS / USS delta per connection is the floor for any `websockets`-based server,
so the ratio shows our own overhead.
"""

import asyncio
from dataclasses import dataclass

import psutil

from bench.common import (
    bench_main,
    kib,
    peer,
    quiet_logging,
    raise_open_files,
    ratio,
    table,
    verdict,
)
from bench.report import environment

NAME = "fleet"
DEVICES_FULL = 1000
DEVICES_QUICK = 50
TARGET_S = 10.0
TARGET_KIB = 60.0
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
        async with peer("fleet", "--url", info["ws_url"], "--count", count) as fleet:
            started = await fleet.read(timeout_s=120)
            ready = await bridge.read(timeout_s=120)
            after = await settled_memory(info["pid"], settle_s)
    ready_s = (ready["all_ready_at"] - started["started_at"]) / 1e9
    return FleetRun(count, ready_s, before, after, settle_s)


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
    note = " — **quick run** (targets apply to 1,000 devices)" if quick else ""
    return f"""## 4. {ours.devices:,} simulated devices in one bridge process

{environment()}{note}.

Three processes: the bridge (`Bridge`), the fleet (`simulator.run_fleet`: firmware code, stock
tools, one page of tools each) and the measuring one. Time: from just before the fleet creates
its first device to the bridge's {ours.devices}th READY event (CLOCK_MONOTONIC, both processes).
Memory: the bridge's RSS and USS (psutil) once it listens and {ours.settle_s:g} s after all are
ready; per device = delta / {ours.devices}. Baseline: a bare `websockets` server with the
bridge's server options holding as many idle connections of the firmware's WebSocket client
(same handshake headers).

{table(headers, rows)}

Targets: all ready in under {TARGET_S:g} s: {verdict(time_met)} ({ours.ready_s:.2f} s);
under {TARGET_KIB:g} KiB RSS per device: {verdict(memory_met)} ({kib(ours.per_device("rss"))} KiB).
"""


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
