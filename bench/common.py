"""Shared pieces of the benchmarks: statistics, tables, peer and watched processes, settings.

Peers (`bench/peers.py`) run in their own processes so that each side of a link can have a
core of its own; they talk to the benchmark in JSON lines (commands on stdin, reports on stdout) and
exit when their stdin closes. Timestamps that cross processes use `time.monotonic_ns()`, which
is CLOCK_MONOTONIC on Linux: one clock for the whole machine. A `WatchedProcess` (the firmware
under MicroPython, or a bridge) only prints; it lives in `testkit.processes` because the tests
use it too, and is re-exported here.
"""

import argparse
import asyncio
import contextlib
import json
import resource
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testkit.processes import WatchedProcess as WatchedProcess  # re-exported for benchmarks

if TYPE_CHECKING:  # imported lazily below: peers that need no bridge start faster without them
    from backend.config import Settings
    from backend.server import Bridge

REPO = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "bench-admin-token"
DEVICE_TOKEN = "bench-device-token"
VOLUME_TOOL = "self.audio_speaker.set_volume"

Call = Callable[[int], Awaitable[Any]]
CpuProbe = Callable[[], Awaitable[float]]


# ---- statistics -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stats:
    """Percentiles of samples in nanoseconds."""

    count: int
    p50: float
    p99: float
    mean: float

    @classmethod
    def of(cls, samples: Sequence[int | float]) -> "Stats":
        ordered = sorted(samples)
        return cls(
            len(ordered),
            percentile(ordered, 50),
            percentile(ordered, 99),
            sum(ordered) / len(ordered),
        )


def percentile(ordered: Sequence[int | float], q: float) -> float:
    """Linear interpolation between closest ranks of an already sorted sequence."""
    if not ordered:
        raise ValueError("no samples")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def us(ns: float) -> str:
    return f"{ns / 1000:.0f}" if ns >= 100_000 else f"{ns / 1000:.1f}"


def ms(ns: float) -> str:
    return f"{ns / 1e6:.2f}"


def kib(size: float) -> str:
    return f"{size / 1024:.1f}"


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base else "n/a"


def verdict(met: bool) -> str:
    return "**met**" if met else "**not met**"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- running ----------------------------------------------------------------------------------


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a fast smoke run (few samples)")
    return parser.parse_args(argv)


def quiet_logging() -> None:
    """Warnings only, so log I/O does not distort the figures."""
    from backend.logs import configure_logging

    configure_logging("warning", "json")


def raise_open_files(wanted: int) -> None:
    """Raise RLIMIT_NOFILE towards `wanted` (each device link is one fd on each side)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def bench_settings(data_dir: Path, **overrides: Any) -> "Settings":
    """Bridge settings on ephemeral loopback ports with fixed tokens; devices share one token
    (`device_auth = "shared"`) except where a benchmark measures provisioning itself."""
    from backend.config import Settings

    values: dict[str, Any] = {"admin_token": ADMIN_TOKEN, "device_token": DEVICE_TOKEN}
    return Settings.on_loopback(data_dir, **{**values, **overrides})


def server_options() -> dict[str, Any]:
    """The `websockets.serve` options the bridge uses, for like-for-like bare servers."""
    settings = bench_settings(Path(tempfile.gettempdir()))
    return {
        "compression": None,
        "max_size": settings.max_message_bytes,
        "max_queue": settings.max_queue,
        "ping_interval": settings.ping_interval_s,
        "ping_timeout": settings.ping_interval_s,
        "server_header": None,
    }


@contextlib.asynccontextmanager
async def running_bridge(**overrides: Any) -> AsyncIterator["Bridge"]:
    """A real Bridge (device endpoint + admin API) in this process."""
    from backend.auth import Tokens
    from backend.server import Bridge

    with tempfile.TemporaryDirectory(prefix="bench-") as data_dir:
        settings = bench_settings(Path(data_dir), **overrides)
        async with Bridge(settings, Tokens(admin=ADMIN_TOKEN, device=DEVICE_TOKEN)) as bridge:
            yield bridge


async def timed(call: Call, count: int, start: int = 0) -> list[int]:
    """Durations (ns) of `count` sequential awaits of `call(i)`."""
    samples = []
    for index in range(start, start + count):
        began = time.perf_counter_ns()
        await call(index)
        samples.append(time.perf_counter_ns() - began)
    return samples


@dataclass(frozen=True)
class Plan:
    """Warm-up calls per path, then `rounds` rounds of `block` calls per path."""

    warmup: int
    rounds: int
    block: int

    @property
    def calls(self) -> int:
        return self.warmup + self.rounds * self.block


@dataclass
class PathResult:
    """Latency samples of one path, and CPU seconds spent in this process and in its peer."""

    samples: list[int]
    own_cpu_s: float = 0.0
    peer_cpu_s: float = 0.0

    @property
    def stats(self) -> Stats:
        return Stats.of(self.samples)

    def cpu_per_call_ns(self) -> tuple[float, float]:
        calls = len(self.samples)
        return self.own_cpu_s * 1e9 / calls, self.peer_cpu_s * 1e9 / calls


async def interleaved(
    paths: dict[str, Call], plan: Plan, peer_cpu: dict[str, CpuProbe] | None = None
) -> dict[str, PathResult]:
    """Warm every path up, then time them in rounds, rotating which one goes first.

    Interleaving spreads the machine's noise over all paths alike. `peer_cpu[name]` (if given)
    reads the CPU time of the process at the other end of that path, before and after each block.
    """
    names = list(paths)
    for name in names:
        await timed(paths[name], plan.warmup)
    results = {name: PathResult([]) for name in names}
    start = plan.warmup
    for round_index in range(plan.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            probe = (peer_cpu or {}).get(name)
            peer_before = await probe() if probe else 0.0
            own_before = time.process_time()
            results[name].samples += await timed(paths[name], plan.block, start)
            results[name].own_cpu_s += time.process_time() - own_before
            results[name].peer_cpu_s += (await probe() - peer_before) if probe else 0.0
        start += plan.block
    return results


# ---- peer processes ---------------------------------------------------------------------------


class Peer:
    """A `python -m bench.peers ROLE ...` child: JSON lines out, commands in."""

    def __init__(self, process: asyncio.subprocess.Process, role: str) -> None:
        self.process = process
        self.role = role

    @classmethod
    async def start(cls, role: str, *args: Any) -> "Peer":
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.peers",
            role,
            *(str(arg) for arg in args),
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=1 << 20,
        )
        return cls(process, role)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def read(self, timeout_s: float = 30.0) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout_s)
        if not line:
            code = await self.process.wait()
            raise RuntimeError(f"peer {self.role} exited with code {code}")
        return json.loads(line)

    async def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command).encode() + b"\n")
        await self.process.stdin.drain()

    async def cpu(self) -> float:
        """CPU seconds the peer has used so far (it answers between its other work)."""
        await self.send(cmd="cpu")
        return float((await self.read())["cpu"])

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Close its stdin (it exits on EOF); kill it if it does not."""
        if self.process.returncode is not None:
            return
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), timeout_s)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


@contextlib.asynccontextmanager
async def peer(role: str, *args: Any) -> AsyncIterator[Peer]:
    started = await Peer.start(role, *args)
    try:
        yield started
    finally:
        await started.stop()


def bench_main(
    name: str,
    description: str,
    run: Callable[[bool], Awaitable[str]],
    argv: Sequence[str] | None = None,
) -> None:
    """`python -m bench.NAME [--quick]`: run, print the markdown, write its report section."""
    from bench.report import write_section

    args = parse_args(description, argv)
    markdown = asyncio.run(run(args.quick))
    print(markdown)
    print(f"\nwritten to {write_section(name, markdown)}")
