"""Reliability of the device HTTP listener (OTA, activation, vision) against one hostile address
(issue #32, items 2, 4 and 7), against a live bridge.

Each row: a fresh `testkit.siege.Siege` (a real `esp32-bridge serve`, JSON logs at the default
level, `rate_limit_exempt = []`, 4 simulated WebSocket devices whose `set_volume` is called
through the admin API every 50 ms, `/healthz` probed every 50 ms, the bridge's RSS sampled every
20 ms): a baseline window without an attacker, then the attack from 127.0.0.2 in its own process
while legitimate devices on 127.0.0.3 check OTA every 0.5 s (20 devices in turn) and upload a
photo every 2 s (stock firmware's chunked multipart, their own vision tokens).

Attacks (`python -m bench.reliability_device_http attack NAME URL SECONDS` runs one alone):

- `idle_sockets`: 1,100 sockets held open without a byte, each re-opened as soon as the bridge
  closes it (item 2);
- `slow_body`: OTA POSTs whose declared 1,000-byte body never comes, 50 at a time, each
  re-opened once closed; how long the bridge held them (item 2, the body deadline);
- `vision_flood`: unauthenticated uploads naming a victim's Device-Id (a wrong token) as fast
  as 20 connections go (item 4);
- `oversize`: 3 MB uploads (Content-Length and chunked) over a 2 MiB cap, each sent whole with
  `sendall` and then read: the 413 read, or a reset (item 7).

Targets: RSS growth < 20 MB, < 100 log lines a minute, others' call p99 < 2× the no-attacker
figure, `/healthz` under 50 ms, every legitimate OTA check and upload answered, an oversize
upload's client reads its 413 (no reset).
"""

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import socket
import sys
import time
from collections import Counter
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.common import bench_main, quiet_logging, raise_open_files, table, verdict
from bench.report import environment
from simulator.stock_ota import stock_headers, system_info
from testkit.camera_upload import chunked, fake_jpeg, read_answer, stock_head, stock_parts
from testkit.hostile import AttackReport
from testkit.siege import Attack, Siege, SiegeResult

NAME = "reliability-device-http"
ATTACKER = "127.0.0.2"
DEVICE_ADDRESS = "127.0.0.3"
SECRET = "bench-device-http-secret-0123456789abcdef"
VICTIM = "a4:cf:12:34:56:79"
CLIENT_ID = "7d2e0c9b-1a44-4c3e-9a55-0f8e2c611b7a"
VISION_PATH = "/vision/explain"
ATTACK_S = 60.0
BASELINE_S = 10.0
TARGET_RSS_MB = 20.0
TARGET_LINES_PER_MIN = 100.0
TARGET_P99_RATIO = 2.0
TARGET_HEALTHZ_MS = 50.0


def vision_token(device_id: str) -> str:
    """A device's vision token as the bridge derives it (`VisionService.token_for`; generation
    0: in shared mode no device is provisioned)."""
    message = f"vision-token\0{device_id}\0{0}".encode()
    digest = hmac.new(SECRET.encode(), message, hashlib.sha256).digest()
    return "vtk_" + base64.urlsafe_b64encode(digest).decode().rstrip("=")


# ---- the attacks (each in its own process) ---------------------------------------------------


async def _connect(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(host, port, local_addr=(ATTACKER, 0))


async def idle_sockets(url: str, seconds: float, count: int = 1100) -> AttackReport:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    end = time.monotonic() + seconds
    stats: Counter[str] = Counter()

    async def hold() -> None:
        while time.monotonic() < end:
            stats["opened"] += 1
            try:
                reader, writer = await _connect(host, port)
            except OSError:
                stats["refused_at_connect"] += 1
                await asyncio.sleep(0.05)
                continue
            try:
                async with asyncio.timeout(max(0.0, end - time.monotonic())):
                    await reader.read(1)  # the bridge closing it (or resetting it)
                stats["closed_by_bridge"] += 1
            except TimeoutError:
                stats["still_open"] += 1
            except OSError:
                stats["closed_by_bridge"] += 1
            finally:
                writer.close()

    began = time.monotonic()
    await asyncio.gather(*(hold() for _ in range(count)))
    return AttackReport(
        "idle_sockets", stats["opened"], time.monotonic() - began, None, dict(stats)
    )


async def slow_body(url: str, seconds: float, count: int = 50) -> AttackReport:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    end = time.monotonic() + seconds
    held: list[float] = []
    stats: Counter[str] = Counter()
    headers = stock_headers(mac=VICTIM, client_id=CLIENT_ID)
    head = f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Length: 1000\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"

    async def one() -> None:
        while time.monotonic() < end:
            stats["sent"] += 1
            try:
                reader, writer = await _connect(host, port)
            except OSError:
                stats["refused_at_connect"] += 1
                await asyncio.sleep(0.05)
                continue
            opened = time.monotonic()
            try:
                writer.write(head.encode() + b'{"ver')
                async with asyncio.timeout(max(0.0, end - time.monotonic())):
                    answer = await reader.read(64)
                    while await reader.read(65536):
                        pass
                status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP") else "-"
                stats[f"answered {status}" if status != "-" else "dropped"] += 1
                held.append(time.monotonic() - opened)
            except TimeoutError:
                stats["still_open"] += 1
            except OSError:
                stats["dropped"] += 1
            finally:
                writer.close()

    began = time.monotonic()
    await asyncio.gather(*(one() for _ in range(count)))
    detail: dict[str, Any] = dict(stats)
    if held:
        held.sort()
        detail["held_s_median"] = round(held[len(held) // 2], 2)
        detail["held_s_max"] = round(held[-1], 2)
    return AttackReport("slow_body", stats["sent"], time.monotonic() - began, None, detail)


async def vision_flood(url: str, seconds: float, count: int = 20) -> AttackReport:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    vision = f"http://{parts.netloc}{VISION_PATH}"
    request = stock_head(vision, device_id=VICTIM, client_id=CLIENT_ID, token="vtk_wrong")
    request += chunked([b"x"])
    end = time.monotonic() + seconds
    stats: Counter[str] = Counter()

    async def one() -> None:
        while time.monotonic() < end:
            stats["sent"] += 1
            try:
                reader, writer = await _connect(host, port)
            except OSError:
                stats["refused_at_connect"] += 1
                continue
            try:
                writer.write(request)
                answer = await asyncio.wait_for(read_answer(reader), 10)
                stats[str(answer.status)] += 1
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                stats["dropped"] += 1
            except TimeoutError:
                stats["timeout"] += 1
            finally:
                writer.close()

    began = time.monotonic()
    await asyncio.gather(*(one() for _ in range(count)))
    return AttackReport("vision_flood", stats["sent"], time.monotonic() - began, None, dict(stats))


def _oversize_once(host: str, port: int, request: bytes) -> str:
    with socket.socket() as sock:
        sock.bind((ATTACKER, 0))
        sock.settimeout(15)
        try:
            sock.connect((host, port))
            sock.sendall(request)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            return "reset"
        except BrokenPipeError:
            return "reset"
        except OSError:
            return "error"
    return received.split(b" ", 2)[1].decode() if received.startswith(b"HTTP") else "empty"


async def oversize(url: str, seconds: float) -> AttackReport:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    vision = f"http://{parts.netloc}{VISION_PATH}"
    token = vision_token(VICTIM)
    pieces = stock_parts("what is it?", fake_jpeg(3 * 1024 * 1024))
    head = stock_head(vision, device_id=VICTIM, client_id=CLIENT_ID, token=token)
    chunked_request = head + chunked(pieces)
    body = b"".join(pieces)
    declared = head.replace(
        b"Transfer-Encoding: chunked\r\n", f"Content-Length: {len(body)}\r\n".encode()
    )
    requests = [declared + body, chunked_request]
    stats: Counter[str] = Counter()
    end = time.monotonic() + seconds
    began = time.monotonic()
    index = 0
    while time.monotonic() < end:
        outcome = await asyncio.to_thread(_oversize_once, host, port, requests[index % 2])
        stats[outcome] += 1
        index += 1
        await asyncio.sleep(0.5)  # the vision address limit is 1/s: mostly 413, some 429
    return AttackReport("oversize", index, time.monotonic() - began, None, dict(stats))


ATTACKS = {
    "idle_sockets": idle_sockets,
    "slow_body": slow_body,
    "vision_flood": vision_flood,
    "oversize": oversize,
}


def attack_main(argv: list[str]) -> None:
    """`attack NAME OTA_URL SECONDS`: run one attack, print its report as one JSON line."""
    name, url, seconds = argv[0], argv[1], float(argv[2])
    raise_open_files(8192)
    report = asyncio.run(ATTACKS[name](url, seconds))
    print(json.dumps(asdict(report)), flush=True)


# ---- the siege -------------------------------------------------------------------------------


class DeviceHttpSiege(Siege):
    """A `Siege` whose attacks come from this module, against the device HTTP listener, while
    legitimate devices on another address check OTA and upload photos."""

    _folder_prefix = "siege-device-http-"

    def __init__(self, devices: int = 4) -> None:
        super().__init__(devices, extra_env={"BRIDGE_DEVICE_SECRET": SECRET})
        self.ota_url = ""
        self.legit: Counter[str] = Counter()

    def _started(self, runtime: dict[str, Any]) -> None:
        self.ota_url = runtime["ota_url"]

    def _attack_argv(self, attack: Attack) -> list[str]:
        return [sys.executable, "-m", "bench.reliability_device_http", "attack", attack.name,
                self.ota_url, str(attack.amount)]  # fmt: skip

    async def measure(
        self, attack: Attack | None, duration_s: float, *, settle_s: float = 1.0
    ) -> SiegeResult:
        self.legit = Counter()
        stop = asyncio.Event()
        legit = asyncio.create_task(self._legit_devices(stop))
        try:
            return await super().measure(attack, duration_s, settle_s=settle_s)
        finally:
            stop.set()
            await legit

    async def _legit_devices(self, stop: asyncio.Event) -> None:
        transport = httpx.AsyncHTTPTransport(local_address=DEVICE_ADDRESS)
        async with httpx.AsyncClient(transport=transport, timeout=15) as http:
            index = 0
            while not stop.is_set():
                mac = f"a4:cf:12:00:00:{index % 20:02x}"
                try:
                    answer = await http.post(
                        self.ota_url,
                        json=system_info(mac=mac, client_id=CLIENT_ID),
                        headers=stock_headers(mac=mac, client_id=CLIENT_ID),
                    )
                    self.legit[f"ota {answer.status_code}"] += 1
                except httpx.HTTPError:
                    self.legit["ota failed"] += 1
                if index % 4 == 0:
                    status = await self._upload(f"a4:cf:12:00:01:{index % 40:02x}")
                    self.legit[f"vision {status}"] += 1
                index += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)

    async def _upload(self, device_id: str) -> str:
        parts = urlsplit(self.ota_url)
        url = f"http://{parts.netloc}{VISION_PATH}"
        head = stock_head(
            url, device_id=device_id, client_id=CLIENT_ID, token=vision_token(device_id)
        )
        try:
            reader, writer = await asyncio.open_connection(
                parts.hostname, parts.port, local_addr=(DEVICE_ADDRESS, 0)
            )
        except OSError:
            return "failed"
        try:
            writer.write(head + chunked(stock_parts("what is it?", fake_jpeg(20_000))))
            return str((await asyncio.wait_for(read_answer(reader), 15)).status)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
            return "failed"
        finally:
            writer.close()


def attacks(duration_s: float) -> dict[str, Attack]:
    return {
        "1,100 idle sockets, re-opened as closed (item 2)": Attack("idle_sockets", duration_s),
        "OTA POSTs whose declared body never comes, 50 at a time (item 2)": Attack(
            "slow_body", duration_s
        ),
        "unauthenticated uploads naming a victim, 20 connections (item 4)": Attack(
            "vision_flood", duration_s
        ),
        "3 MB uploads over the 2 MiB cap, sent whole then read (item 7)": Attack(
            "oversize", duration_s
        ),
    }


Row = tuple[str, SiegeResult, SiegeResult, Counter[str], Counter[str]]


async def measure_all(duration_s: float) -> list[Row]:
    rows: list[Row] = []
    for label, attack in attacks(duration_s).items():
        async with DeviceHttpSiege(4) as siege:
            baseline = await siege.measure(None, min(duration_s, BASELINE_S))
            idle_legit = siege.legit
            attacked = await siege.measure(attack, duration_s)
            rows.append((label, baseline, attacked, idle_legit, siege.legit))
            await asyncio.sleep(1.0)
            after = siege.rss_mb()
        attacked.events["rss after"] = int(after * 10)  # MB × 10, shown in the table
        top = sorted(attacked.events.items(), key=lambda item: -item[1])[:8]
        print(f"{label}: done; log events {top}", file=sys.stderr, flush=True)
    return rows


def _legit_cell(legit: Counter[str]) -> tuple[str, bool]:
    ota_all = sum(v for k, v in legit.items() if k.startswith("ota"))
    vision_all = sum(v for k, v in legit.items() if k.startswith("vision"))
    ota_ok, vision_ok = legit["ota 200"], legit["vision 200"]
    others = ", ".join(f"{k}: {v}" for k, v in sorted(legit.items()) if not k.endswith(" 200"))
    text = f"OTA {ota_ok}/{ota_all}, vision {vision_ok}/{vision_all}"
    return (text + (f" ({others})" if others else "")), (
        ota_ok == ota_all and vision_ok == vision_all and ota_all > 0
    )


def _answer_cell(report: AttackReport) -> str:
    detail = {k: v for k, v in report.detail.items() if k != "sent"}
    return ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in detail.items())


def render(rows: list[Row], duration_s: float, quick: bool) -> str:
    lines = []
    missed = 0
    for label, base, hit, _idle_legit, legit in rows:
        report = hit.attack
        assert report is not None
        minutes = max(duration_s, report.seconds) / 60
        per_min = hit.log_lines / minutes
        ratio = hit.call_p(99) / base.call_p(99) if base.call_ms else float("nan")
        healthz_max = max(hit.healthz_ms, default=float("nan"))
        legit_text, legit_ok = _legit_cell(legit)
        after = hit.events.get("rss after", 0) / 10
        met = (
            hit.rss_growth_mb < TARGET_RSS_MB
            and per_min < TARGET_LINES_PER_MIN
            and ratio < TARGET_P99_RATIO
            and healthz_max < TARGET_HEALTHZ_MS
            and hit.call_errors == 0
            and legit_ok
            and not report.detail.get("reset")
        )
        missed += not met
        lines.append(
            [
                label,
                f"{report.sent:,} in {report.seconds:.1f} s",
                f"{hit.rss_growth_mb:.1f} (after: {after - hit.rss_before_mb:+.1f})",
                f"{hit.log_lines} ({per_min:.0f}/min)",
                f"{hit.call_p(99):.1f} / {base.call_p(99):.1f} = {ratio:.2f}",
                f"{hit.healthz_p(99):.1f} (max {healthz_max:.1f})",
                legit_text,
                _answer_cell(report),
                verdict(met),
            ]
        )
    headers = [
        "attack (from 127.0.0.2)",
        "sent",
        "RSS growth MB (1 s after)",
        "log lines",
        "others' call p99 ms: attack / none",
        "/healthz p99 ms",
        "legitimate devices on 127.0.0.3 answered",
        "what the attacker got",
        "targets",
    ]
    quick_note = " — **quick run**" if quick else ""
    overall = (
        f"{verdict(True)} for all {len(rows)} attacks"
        if missed == 0
        else f"{verdict(False)} for {missed} of {len(rows)} attacks"
    )
    return f"""## Reliability of the device HTTP listener: one hostile address

{environment()}{quick_note}. `python -m bench.reliability_device_http`.

Each row: a fresh bridge (`esp32-bridge serve`, JSON logs at the default level,
`rate_limit_exempt = []`, default bounds) with 4 simulated WebSocket devices whose `set_volume`
is called through the admin API every 50 ms while `/healthz` is probed every 50 ms; a
{min(duration_s, BASELINE_S):g} s window without an attacker, then {duration_s:g} s of the
attack from 127.0.0.2 in its own process. Meanwhile legitimate devices on 127.0.0.3 check OTA
every 0.5 s and upload a 20 KB photo (stock firmware's chunked multipart, their own tokens)
every 2 s; "answered" is HTTP 200 (no vision model is configured: the upload's answer is the
200 that says so). "log lines" counts every line the bridge wrote from the attack's start
until 1 s after its end (about 30 a minute are the legitimate uploads' own `vision upload`
lines). "What the attacker got": answers by status; "closed by bridge",
"dropped" (closed or reset at accept by the per-address share or the penalty box); for the slow
bodies how long the bridge held each; for the oversize uploads whether the client read the
413 or saw a reset.

{table(headers, lines)}

Targets: RSS growth < {TARGET_RSS_MB:g} MB, < {TARGET_LINES_PER_MIN:g} log lines a minute,
others' call p99 < {TARGET_P99_RATIO:g}× the no-attacker figure, `/healthz` under
{TARGET_HEALTHZ_MS:g} ms, every legitimate OTA check and upload answered, no reset seen by an
oversize upload: {overall}.
"""


async def run(quick: bool) -> str:
    quiet_logging()
    raise_open_files(8192)
    duration_s = 3.0 if quick else ATTACK_S
    rows = await measure_all(duration_s)
    return render(rows, duration_s, quick)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "attack":
        attack_main(args[1:])
        return
    bench_main(NAME, __doc__ or NAME, run, args)


if __name__ == "__main__":
    main()
