"""Benchmark 9: the OTA endpoint — checks per second for approved devices, and an activation storm.

Processes: the bridge (`python -m bench.peers ota_bridge`: a real `Bridge` with per-device
tokens, its device-facing HTTP listener and 200 approved devices, whose per-device OTA rate
limit is lifted since the load asks for each of them thousands of times) and this process, the
load.

Throughput and latency: `CONNECTIONS` keep-alive HTTP/1.1 connections, each sending its next
request as soon as the last answer arrived (closed loop), for a fixed time: stock OTA checks of
approved devices (the §5.1 headers and system-info body; the answer carries `server_time`,
`firmware` and the device's own `websocket` credentials, and records its report in the
catalogue) against `GET /healthz` of the admin API in the same bridge process, interleaved in
rounds. The load generator is a raw asyncio HTTP client, so the figure is the bridge's.

Storm: `STORM` devices nobody approved POST their OTA check at once, one connection each (from
loopback, which `rate_limit_exempt` leaves unlimited per IP; each device id asks once). Checked:
every one gets HTTP 200 with an activation code of its own and no credentials; the bridge's RSS
before and after (the pending activations are capped by `max_pending_activations`); OTA checks
of approved devices before and during the storm (one connection, one request at a time).
"""

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from bench.common import (
    ADMIN_TOKEN,
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
from bench.http_client import KeepAliveHttp
from bench.peers import known_client, known_device
from bench.report import environment
from simulator.stock_ota import stock_headers, system_info

NAME = "ota"
KNOWN = 200
CONNECTIONS = 16
STORM = 1000
RESPONSIVE_P99_MS = 1000.0  # approved devices still answered within a second during the storm
BYTES_PER_PENDING = 16 * 1024


def ota_request(host: str, port: int, path: str, mac: str, client_id: str) -> bytes:
    """One stock OTA check (§5.1 headers and body) as raw HTTP/1.1 bytes."""
    body = json.dumps(system_info(mac, client_id), separators=(",", ":")).encode()
    headers = {
        "Host": f"{host}:{port}",
        **stock_headers(mac, client_id),
        "Content-Length": str(len(body)),
    }
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode() + body


@dataclass
class Endpoint:
    host: str
    port: int
    path: str

    @classmethod
    def of(cls, url: str) -> "Endpoint":
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        return cls(parts.hostname, parts.port, parts.path or "/")


async def closed_loop(
    endpoint: Endpoint, make: Callable[[int], bytes], duration_s: float
) -> tuple[list[int], float]:
    """(latency samples ns, elapsed s) of CONNECTIONS connections for `duration_s`."""
    samples: list[int] = []
    deadline = time.perf_counter() + duration_s

    async def worker(first: int) -> None:
        async with KeepAliveHttp(endpoint.host, endpoint.port, ADMIN_TOKEN) as http:
            index = first
            while time.perf_counter() < deadline:
                request = make(index)
                began = time.perf_counter_ns()
                status, _body = await http.send(request)
                samples.append(time.perf_counter_ns() - began)
                if status != 200:
                    raise RuntimeError(f"HTTP {status}")
                index += CONNECTIONS

    began = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(CONNECTIONS)))
    return samples, time.perf_counter() - began


PROBES = 4  # connections checking approved devices during a storm
WAVES = 3  # storms of STORM new devices each (3,000 pending stay under the 4,096 cap)


async def new_device(endpoint: Endpoint, index: int) -> tuple[int, dict[str, Any]]:
    mac = "a4:cf:02:" + ":".join(f"{byte:02x}" for byte in index.to_bytes(3, "big"))
    client = f"11111111-0000-4000-8000-{index:012x}"
    async with KeepAliveHttp(endpoint.host, endpoint.port, "") as http:
        status, body = await http.send(
            ota_request(endpoint.host, endpoint.port, endpoint.path, mac, client)
        )
    return status, json.loads(body) if body else {}


async def probe(endpoint: Endpoint, stop: asyncio.Event, samples: list[int], limit: int) -> None:
    """OTA checks of approved devices, one at a time, until `stop` (or `limit` samples)."""
    async with KeepAliveHttp(endpoint.host, endpoint.port, "") as http:
        index = 0
        while not stop.is_set() and len(samples) < limit:
            request = ota_request(
                endpoint.host,
                endpoint.port,
                endpoint.path,
                known_device(index % KNOWN),
                known_client(index % KNOWN),
            )
            began = time.perf_counter_ns()
            status, _ = await http.send(request)
            samples.append(time.perf_counter_ns() - began)
            if status != 200:
                raise RuntimeError(f"probe: HTTP {status}")
            index += 1


async def run(quick: bool) -> str:
    quiet_logging()
    raise_open_files(STORM * 2 + 512)
    rounds, seconds = (1, 0.5) if quick else (3, 4.0)
    storm = 100 if quick else STORM
    async with peer("ota_bridge", "--count", KNOWN) as bridge:
        info = await bridge.read(60)
        ota = Endpoint.of(info["ota_url"])
        api = Endpoint.of(info["api_url"])

        def known(index: int) -> bytes:
            mac, client = known_device(index % KNOWN), known_client(index % KNOWN)
            return ota_request(ota.host, ota.port, ota.path, mac, client)

        health = KeepAliveHttp(api.host, api.port, ADMIN_TOKEN).prepare("GET", "/healthz")
        async with KeepAliveHttp(ota.host, ota.port, "") as check:
            status, body = await check.send(known(0))
            answer = json.loads(body)
            assert status == 200 and answer["websocket"]["token"].startswith("dtk_"), answer
            assert "activation" not in answer
        await closed_loop(ota, known, 0.3)  # warm-up
        await closed_loop(api, lambda _i: health, 0.3)
        ota_samples: list[int] = []
        health_samples: list[int] = []
        ota_time = health_time = 0.0
        for index in range(rounds):
            paths = [("ota", ota), ("health", api)]
            for name, endpoint in paths if index % 2 == 0 else paths[::-1]:
                if name == "ota":
                    samples, spent = await closed_loop(endpoint, known, seconds)
                    ota_samples += samples
                    ota_time += spent
                else:
                    samples, spent = await closed_loop(endpoint, lambda _i: health, seconds)
                    health_samples += samples
                    health_time += spent

        # ---- the storm
        await bridge.send(cmd="stats")
        before = await bridge.read()
        quiet: list[int] = []
        await probe(ota, asyncio.Event(), quiet, 50 if quick else 300)
        during: list[int] = []
        results: list[tuple[int, dict[str, Any]]] = []
        storm_s: list[float] = []
        waves = 1 if quick else WAVES
        for wave in range(waves):
            stop = asyncio.Event()
            probers = [
                asyncio.create_task(probe(ota, stop, during, 1_000_000)) for _ in range(PROBES)
            ]
            began = time.perf_counter()
            first = wave * storm
            results += await asyncio.gather(
                *(new_device(ota, index) for index in range(first, first + storm))
            )
            storm_s.append(time.perf_counter() - began)
            stop.set()
            await asyncio.gather(*probers)
        await bridge.send(cmd="stats")
        after = await bridge.read()

    codes = {r[1].get("activation", {}).get("code") for r in results if r[0] == 200}
    all_coded = (
        all(status == 200 and "activation" in body and "websocket" not in body
            for status, body in results)
        and len(codes) == storm * waves
    )  # fmt: skip
    pending = after["pending"] - before["pending"]
    rss_delta = after["rss"] - before["rss"]
    ota_stats, health_stats = Stats.of(ota_samples), Stats.of(health_samples)
    quiet_stats, during_stats = Stats.of(quiet), Stats.of(during or [0])
    ota_rate = len(ota_samples) / ota_time
    health_rate = len(health_samples) / health_time
    rows = [
        [
            "OTA check of an approved device (credentials, report recorded)",
            f"{ota_rate:.0f}",
            ms(ota_stats.p50),
            ms(ota_stats.p99),
        ],
        [
            "`GET /healthz`, admin API, same process (**baseline**)",
            f"{health_rate:.0f}",
            ms(health_stats.p50),
            ms(health_stats.p99),
        ],
        ["ratio OTA / baseline", ratio(ota_rate, health_rate), "", ""],
    ]
    storm_rows = [
        ["new devices, all at once, per storm", storm, f"{waves} storm(s)", ""],
        ["answered 200 with a code of their own, no credentials", len(codes), "", ""],
        ["storm wall time, slowest (s)", f"{max(storm_s):.2f}", "", ""],
        ["pending activations added", pending, "", ""],
        [
            "bridge RSS before → after (MiB)",
            f"{before['rss'] / 2**20:.1f}",
            f"{after['rss'] / 2**20:.1f}",
            f"{kib(max(rss_delta, 0) / max(pending, 1))} KiB per pending",
        ],
        [
            "approved device OTA check, before the storm (p50 / p99 ms)",
            ms(quiet_stats.p50),
            ms(quiet_stats.p99),
            f"{len(quiet)} checks",
        ],
        [
            "approved device OTA check, during the storm (p50 / p99 ms)",
            ms(during_stats.p50),
            ms(during_stats.p99),
            f"{len(during)} checks",
        ],
    ]
    bounded = pending == storm * waves and rss_delta < BYTES_PER_PENDING * max(pending, 1)
    responsive = bool(during) and during_stats.p99 / 1e6 < RESPONSIVE_P99_MS
    note = " — **quick run**" if quick else ""
    return f"""## 9. OTA endpoint: checks per second, activation storm

{environment()}{note}.

The bridge (`python -m bench.peers ota_bridge`: per-device tokens, {KNOWN} approved devices,
their per-device OTA limit lifted for the load) in its own process; the load from this one:
{CONNECTIONS} keep-alive connections in a closed loop, {rounds} round(s) of {seconds:g} s per
path, interleaved. An OTA check is the stock §5.1 request (headers, system-info body); its
answer carries `server_time`, `firmware` and the device's own `websocket` URL and token, and the
report goes into the catalogue.

{table(["path", "requests/s", "p50 ms", "p99 ms"], rows)}

Storm: {storm} devices nobody approved, one connection each, all at once (loopback: not limited
per IP by the default `rate_limit_exempt`; a LAN address would meet `ota_ip`), {waves} time(s)
with new devices each time, while {PROBES} connections keep checking approved devices.

{table(["storm", "value", "", ""], storm_rows)}

Targets: every new device gets its own activation code and no credentials:
{verdict(all_coded)}; memory bounded (the pending activations counted, RSS growth under
{BYTES_PER_PENDING // 1024} KiB each, and capped by `max_pending_activations`):
{verdict(bounded)}; approved devices answered during the storm with p99 under
{RESPONSIVE_P99_MS:g} ms: {verdict(responsive)} (p99 {ms(during_stats.p99)} ms).
"""


def main() -> None:
    bench_main(NAME, __doc__ or NAME, run)


if __name__ == "__main__":
    main()
