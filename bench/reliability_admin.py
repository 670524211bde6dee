"""Reliability of the admin listener (issue #32 item 3): idle sockets against a live bridge.

Each row: a fresh `testkit.siege.Siege` (a real `esp32-bridge serve`, `rate_limit_exempt = []`,
4 simulated devices whose `set_volume` is called through the admin API every 50 ms on a kept-alive
connection) measures a baseline window, then the same window while an attacker process opens
6,000 TCP connections to the admin port from 127.0.0.2 (or spread over 100 loopback addresses)
and holds them without sending a byte for `HOLD_S`. Meanwhile this process probes `/healthz` on
the admin port and the OTA endpoint on the device HTTP port with a fresh connection each time,
samples the bridge's open descriptors and measures its CPU time. One row lowers the bridge's
descriptor limit (`prlimit`) to what it uses plus 200, so that the attack exhausts it.

`python -m bench.reliability_admin [--quick]`; `python -m bench.reliability_admin attack HOST
PORT COUNT ADDRESSES HOLD_S` is the attacker process (JSON report on stdout).
"""

import asyncio
import contextlib
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from bench.common import bench_main, quiet_logging, raise_open_files, table
from bench.report import environment
from testkit.hostile import AttackReport
from testkit.siege import Attack, Siege, SiegeResult, percentile

NAME = "reliability-admin"
HOLD_S = 20.0
BASELINE_S = 5.0
WINDOW_S = 30.0  # the attack (opening, then HOLD_S) and a few seconds of recovery
PROBE_INTERVAL_S = 0.2
SOCKETS = 6000


# ---- the attacker process ---------------------------------------------------------------------


async def attack(host: str, port: int, count: int, addresses: int, hold_s: float) -> dict[str, Any]:
    """Open `count` idle connections (from 127.0.0.2 onwards, `addresses` of them), hold them up
    to `hold_s`; report when the bridge closed each one."""
    began = time.monotonic()
    closed_after: list[float] = []
    still_open = 0
    not_connected = 0
    gate = asyncio.Semaphore(512)

    async def one(index: int) -> None:
        nonlocal still_open, not_connected
        source = f"127.0.0.{2 + index % addresses}"
        try:
            async with gate:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port, local_addr=(source, 0)), 5
                )
        except (OSError, TimeoutError):
            not_connected += 1
            return
        opened = time.monotonic()
        try:
            left = hold_s - (opened - began)
            await asyncio.wait_for(reader.read(1), max(left, 0.01))
            closed_after.append(time.monotonic() - opened)
        except TimeoutError:
            still_open += 1
        except OSError:
            closed_after.append(time.monotonic() - opened)
        finally:
            writer.transport.abort()

    await asyncio.gather(*(one(i) for i in range(count)))
    at_once = sum(1 for s in closed_after if s < 1.0)
    later = sorted(s for s in closed_after if s >= 1.0)
    return {
        "name": "admin_idle_sockets",
        "sent": count,
        "seconds": round(time.monotonic() - began, 2),
        "detail": {
            "dropped_at_once": at_once,
            "closed_later": len(later),
            "closed_later_p50_s": round(percentile(later, 50), 1) if later else None,
            "closed_later_max_s": round(later[-1], 1) if later else None,
            "still_open": still_open,
            "not_connected": not_connected,
        },
    }


# ---- the measurement --------------------------------------------------------------------------


class AdminSiege(Siege):
    """A siege whose attacker is `attack` above against the admin port."""

    def __init__(self, addresses: int, fd_headroom: int | None) -> None:
        super().__init__(4)
        self.addresses = addresses
        self.fd_headroom = fd_headroom
        self.ota_url = ""
        self.attack_began = self.attack_ended = 0.0

    def _started(self, runtime: dict[str, Any]) -> None:
        self.ota_url = runtime["ota_url"]

    def _attack_argv(self, attack_: Attack) -> list[str]:
        host, port = self.api_url.split("//")[1].rsplit(":", 1)
        argv = [sys.executable, "-m", "bench.reliability_admin", "attack", host, port]
        return [*argv, str(int(attack_.amount)), str(self.addresses), str(HOLD_S)]

    async def _attack(self, attack_: Attack) -> AttackReport:
        if self.fd_headroom is not None:
            in_use = psutil.Process(self.pid).num_fds()
            limit = in_use + self.fd_headroom
            resource.prlimit(self.pid, resource.RLIMIT_NOFILE, (limit, limit))
        self.attack_began = time.monotonic()
        try:
            return await super()._attack(attack_)
        finally:
            self.attack_ended = time.monotonic()


@dataclass
class Probes:
    healthz: list[tuple[float, float | None]] = field(default_factory=list)  # (at, ms or None)
    ota: list[tuple[float, float | None]] = field(default_factory=list)
    fds: list[tuple[float, int]] = field(default_factory=list)


async def _probe(url: str, into: list[tuple[float, float | None]], stop: asyncio.Event) -> None:
    limits = httpx.Limits(max_keepalive_connections=0)  # a fresh connection each time
    async with httpx.AsyncClient(timeout=2.0, limits=limits) as client:
        while not stop.is_set():
            began = time.monotonic()
            try:
                if "/ota" in url:
                    await client.post(url, json={}, headers={"Device-Id": "02:00:00:00:0a:01"})
                else:
                    await client.get(url)
                into.append((began, (time.monotonic() - began) * 1000))
            except httpx.HTTPError:
                into.append((began, None))
            await asyncio.sleep(PROBE_INTERVAL_S)


async def _sample_fds(pid: int, into: list[tuple[float, int]], stop: asyncio.Event) -> None:
    process = psutil.Process(pid)
    while not stop.is_set():
        with contextlib.suppress(psutil.Error):
            into.append((time.monotonic(), process.num_fds()))
        await asyncio.sleep(0.1)


@dataclass
class Row:
    label: str
    base: SiegeResult
    hit: SiegeResult
    probes: Probes
    cpu: float  # share of one core during the attack
    began: float
    ended: float
    limit: str


async def measure(label: str, addresses: int, fd_headroom: int | None, count: int) -> Row:
    async with AdminSiege(addresses, fd_headroom) as siege:
        base = await siege.measure(None, BASELINE_S)
        probes = Probes()
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(_probe(f"{siege.api_url}/healthz", probes.healthz, stop)),
            asyncio.create_task(_probe(siege.ota_url, probes.ota, stop)),
            asyncio.create_task(_sample_fds(siege.pid, probes.fds, stop)),
        ]
        process = psutil.Process(siege.pid)
        cpu_before = sum(process.cpu_times()[:2])
        await asyncio.sleep(1.0)  # a second of probes before the attack
        hit = await siege.measure(Attack("admin_idle_sockets", count), WINDOW_S)
        stop.set()
        await asyncio.gather(*tasks)
        began, ended = siege.attack_began, siege.attack_ended
        cpu = (sum(process.cpu_times()[:2]) - cpu_before) / (time.monotonic() - began + 1.0)
        soft, _hard = resource.prlimit(siege.pid, resource.RLIMIT_NOFILE)
        print(f"{label}: done", file=sys.stderr, flush=True)
        return Row(label, base, hit, probes, cpu, began, ended, f"{soft:,}")


def _answered(samples: list[tuple[float, float | None]], began: float, ended: float) -> str:
    during = [ms for at, ms in samples if began <= at < ended]
    ok = [ms for ms in during if ms is not None]
    after = [(at, ms) for at, ms in samples if at >= ended]
    first = next((at - ended for at, ms in after if ms is not None), None)
    text = f"{len(ok)}/{len(during)}"
    if ok:
        text += f" (p99 {percentile(ok, 99):.0f} ms)"
    return text + (f"; again {first:.1f} s after" if first is not None else "; not again")


def render(rows: list[Row], quick: bool) -> str:
    lines = []
    for row in rows:
        report = row.hit.attack
        assert report is not None
        detail = report.detail
        fds_before = next((n for at, n in row.probes.fds if at >= row.began), 0)
        during = [n for at, n in row.probes.fds if row.began <= at <= row.ended]
        fds_after = row.probes.fds[-1][1] if row.probes.fds else 0
        p99, base99 = row.hit.call_p(99), row.base.call_p(99)
        closed = (
            f"{detail['dropped_at_once']:,} at accept; {detail['closed_later']:,} after "
            f"{detail['closed_later_p50_s']} s (max {detail['closed_later_max_s']} s); "
            f"{detail['still_open']:,} still open at {HOLD_S:g} s; "
            f"{detail['not_connected']:,} not connected"
        )
        lines.append(
            [
                row.label,
                row.limit,
                closed,
                f"{fds_before:,} / {max(during, default=0):,} / {fds_after:,}",
                f"{p99:.1f} / {base99:.1f} = {p99 / base99:.2f}",
                str(row.hit.call_errors),
                _answered(row.probes.healthz, row.began, row.ended),
                _answered(row.probes.ota, row.began, row.ended),
                f"{row.cpu:.0%}",
            ]
        )
    headers = [
        "attack",
        "descriptor limit",
        "the attacker's sockets",
        "bridge descriptors before / peak / after",
        "others' call p99 ms: attack / none",
        "failed calls",
        "/healthz, new connection each: answered during",
        "OTA, new connection each: answered during",
        "bridge CPU (one core)",
    ]
    quick_note = " — **quick run**" if quick else ""
    return f"""## Reliability of the admin listener: idle sockets (issue #32)

{environment()}{quick_note}. `python -m bench.reliability_admin`.

Each row: a fresh bridge (`esp32-bridge serve`, `rate_limit_exempt = []`, default settings:
`http_head_timeout_s` 10, `http_max_connections` 1,024, `http_max_connections_per_address` 64)
with 4 simulated devices whose `set_volume` is called through the admin API every 50 ms; a
{BASELINE_S:g} s baseline, then an attacker process opens the sockets to the admin port and holds
each, silent, for up to {HOLD_S:g} s. `/healthz` (admin port) and the OTA endpoint (device HTTP
port) are probed every {PROBE_INTERVAL_S:g} s on a fresh connection with a 2 s timeout; "during"
is the attacker's run, "again" the first answer after it. Descriptors: the bridge's at the
attack's start, the most while it ran, and at the end of the {WINDOW_S:g} s window. CPU: the
bridge's CPU time over the attack and the window, per second. The last row lowers the bridge's
limit (`prlimit`, soft and hard) to the descriptors it uses plus 200 just before the attack.

{table(headers, lines)}
"""


async def run(quick: bool) -> str:
    quiet_logging()
    raise_open_files(20_000)  # the attacker inherits it
    count = 600 if quick else SOCKETS
    plans = [
        (f"{count:,} idle sockets, one address", 1, None),
        (f"{count:,} idle sockets, 100 addresses", 100, None),
        (f"{count:,} idle sockets, 100 addresses, out of descriptors", 100, 200),
    ]
    rows = [
        await measure(label, addresses, headroom, count) for label, addresses, headroom in plans
    ]
    return render(rows, quick)


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    if args[:1] == ["attack"]:
        host, port, count, addresses, hold_s = args[1:6]
        report = asyncio.run(attack(host, int(port), int(count), int(addresses), float(hold_s)))
        print(json.dumps(report))
        return
    bench_main(NAME, __doc__ or NAME, run, args)


if __name__ == "__main__":
    main()
