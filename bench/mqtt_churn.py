"""Benchmark: a 10,000-connection MQTT reconnect loop against `serve --mqtt embedded`.

One valid device login connects, sends CONNECT, waits for its CONNACK and sends DISCONNECT,
`CONCURRENCY` at a time, 10,000 times, against a real bridge in its own process
(`testkit.hostile_mqtt.MqttSiege`, no other devices). Reported: the bridge's RSS before the
first connection, every 1,000 connections, right after the last, and after a 5 s settle; and the
log lines the bridge wrote per 1,000 connections (with the events that wrote them).

The bridge's per-device handshake limit (`rate_limits.handshake_device`, 1/s burst 10) would
refuse nearly all of these, so for this figure it is raised to 100,000/s in the bridge's
environment; loopback stays exempt from the per-address limits (the default). Target (issue
#16): RSS within 10 % of where it started.
"""

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import bench_main, quiet_logging, raise_open_files, table, verdict
from bench.report import environment
from testkit.hostile_mqtt import LEGIT_DEVICE, SECRET, Link, MqttSiege, Target, open_link
from testkit.siege import EVIL_DEVICE

NAME = "mqtt-churn"
CONNECTIONS_FULL, CONNECTIONS_QUICK = 10_000, 500
CONCURRENCY = 4
SETTLE_S = 5.0
WINDOW_S = 600.0  # the loop stops here whatever the count
TARGET_GROWTH = 0.10
RAISED = {"handshake_device": {"per_s": 100_000, "burst": 100_000}}


async def churn(target: Target, total: int, on_thousand: "Checkpoint") -> dict[str, int]:
    """`total` connect + CONNECT + DISCONNECT cycles, CONCURRENCY at a time."""
    outcomes: dict[str, int] = {}
    done = 0
    started = time.monotonic()
    next_id = iter(range(total))

    async def worker() -> None:
        nonlocal done
        for _ in next_id:
            if time.monotonic() - started > WINDOW_S:
                return
            try:
                link: Link = await open_link(target)
            except OSError:
                outcomes["connect error"] = outcomes.get("connect error", 0) + 1
                continue
            code = "dropped" if link.code is None else str(link.code)
            outcomes[code] = outcomes.get(code, 0) + 1
            if link.code == 0:
                await link.disconnect()
            done += 1
            if done % 1000 == 0:
                on_thousand(done)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return outcomes


class Checkpoint:
    def __init__(self, siege: MqttSiege | None) -> None:
        self.siege = siege
        self.points: list[tuple[int, float]] = []

    def __call__(self, done: int) -> None:
        if self.siege is not None:
            self.points.append((done, self.siege.rss_mb()))


@dataclass
class ChurnResult:
    total: int
    outcomes: dict[str, int]
    seconds: float
    start: float
    after: float
    settled: float
    points: list[tuple[int, float]]
    lines: int
    settle_lines: int
    events: dict[str, int] = field(default_factory=dict)

    @property
    def accepted(self) -> int:
        return self.outcomes.get("0", 0)


async def measure(quick: bool) -> ChurnResult:
    total = CONNECTIONS_QUICK if quick else CONNECTIONS_FULL
    env = {"BRIDGE_RATE_LIMITS": json.dumps(RAISED), "BRIDGE_RATE_LIMIT_EXEMPT": '["127.0.0.0/8"]'}
    async with MqttSiege(devices=0, extra_env=env) as siege:
        assert siege.bridge is not None
        await asyncio.sleep(2.0)  # startup work done
        target = Target.parse(siege.mqtt_url, SECRET, EVIL_DEVICE, LEGIT_DEVICE)
        start = siege.rss_mb()
        first_line = len(siege.bridge.lines)
        checkpoint = Checkpoint(siege)
        began = time.monotonic()
        outcomes = await churn(target, total, checkpoint)
        seconds = time.monotonic() - began
        after = siege.rss_mb()
        lines = siege.bridge.lines[first_line:]
        await asyncio.sleep(SETTLE_S)
        settled = siege.rss_mb()
        settle_lines = siege.bridge.lines[first_line + len(lines) :]
    events: dict[str, int] = {}
    for line in lines:
        try:
            event = str(json.loads(line).get("event", "?"))
        except ValueError:
            event = line[:60]
        events[event] = events.get(event, 0) + 1
    return ChurnResult(
        total,
        outcomes,
        seconds,
        start,
        after,
        settled,
        checkpoint.points,
        len(lines),
        len(settle_lines),
        events,
    )


async def run(quick: bool) -> str:
    quiet_logging()
    raise_open_files(4096)
    m = await measure(quick)
    per_thousand = m.lines / max(m.accepted, 1) * 1000
    growth = (m.settled - m.start) / m.start
    met = growth <= TARGET_GROWTH
    trend = ", ".join(f"{done // 1000}k: {rss:.1f}" for done, rss in m.points) or "-"
    by_event = ", ".join(f"{name} {count:,}" for name, count in sorted(m.events.items()))
    rows = [
        [
            f"{m.accepted:,} of {m.total:,}",
            f"{m.seconds:.1f}",
            f"{m.start:.1f}",
            f"{m.after:.1f}",
            f"{m.settled:.1f} ({growth:+.1%})",
            f"{per_thousand:.0f}",
        ]
    ]
    quick_note = " — **quick run**" if quick else ""
    print(json.dumps(m.outcomes), file=sys.stderr)
    headers = [
        "connections accepted",
        "seconds",
        "RSS start MB",
        "RSS after MB",
        "RSS after 5 s MB",
        "log lines / 1,000",
    ]
    return f"""## MQTT reconnect loop: 10,000 connections of one login

{environment()}{quick_note}. `python -m bench.mqtt_churn`.

`esp32-bridge serve --mqtt embedded` in its own process (JSON logs at the default level, no other
devices); one valid device login connects, sends CONNECT, waits for the CONNACK and sends
DISCONNECT, {CONCURRENCY} at a time. For this figure `rate_limits.handshake_device` is raised to
100,000/s (its default, 1/s burst 10, refuses nearly every one of these logins); loopback is
exempt from the per-address limits (the default). RSS is the bridge's; "after 5 s" is after a
{SETTLE_S:g} s settle with no connections (the bridge has no hook to force a collection, so this
is what its own collector left).

{table(headers, rows)}

RSS every 1,000 connections (MB): {trend}.

Log lines during the loop, by event: {by_event or "none"}; {m.settle_lines} more in the
settle.

Target: RSS within {TARGET_GROWTH:.0%} of the start after the loop: {verdict(met)}
({growth:+.1%}). `python -m bench.mqtt_churn --trace N` runs the bridge in-process and prints
what `tracemalloc` still holds after N more connections (after a warm-up and `gc.collect()`).
"""


async def trace(total: int) -> None:
    """Where the memory of a reconnect loop stays: the bridge in this process, `tracemalloc`
    snapshots after a warm-up and after the loop (both after `gc.collect()`), the largest
    differences by traceback printed. Diagnosis only; nothing is written to the docs."""
    from bench.mqtt import SECRET as BENCH_SECRET
    from bench.mqtt import bridge

    quiet_logging()
    raise_open_files(4096)
    with tempfile.TemporaryDirectory(prefix="bench-churn-") as folder:
        async with bridge(Path(folder), mqtt_url="embedded", rate_limits=RAISED) as running:
            target = Target.parse(running.mqtt.device_url, BENCH_SECRET, EVIL_DEVICE, LEGIT_DEVICE)
            await churn(target, 500, Checkpoint(None))  # warm-up: caches, pools, first imports
            gc.collect()
            tracemalloc.start(25)
            before = tracemalloc.take_snapshot()
            outcomes = await churn(target, total, Checkpoint(None))
            await asyncio.sleep(SETTLE_S)
            gc.collect()
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
    print(f"outcomes: {outcomes}")
    diffs = after.compare_to(before, "traceback")
    grown = sum(d.size_diff for d in diffs)
    print(f"traced growth over {total:,} connections: {grown / 2**20:.2f} MB")
    for diff in diffs[:8]:
        print(f"\n{diff.size_diff / 1024:+.1f} KiB in {diff.count_diff:+,} blocks")
        for frame in diff.traceback.format()[-12:]:
            print(f"  {frame}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--trace", type=int, default=0, help="diagnose N connections in-process")
    args, rest = parser.parse_known_args(argv if argv is not None else sys.argv[1:])
    if args.trace:
        asyncio.run(trace(args.trace))
        return
    bench_main(NAME, __doc__ or NAME, run, rest)


if __name__ == "__main__":
    main()
