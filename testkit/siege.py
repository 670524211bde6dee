"""A bridge under attack, measured: what one hostile device costs everyone else.

`Siege` runs a real bridge (`esp32-bridge serve`, its own process, JSON logs at the default
level) with well-behaved simulated devices (`esp32-bridge simulate`, another process) whose tools
are called in a loop through the admin API while `/healthz` is probed, and samples the bridge's
RSS. `measure(attack)` runs one attack from `testkit.hostile` against it and reports the
bridge's RSS growth, the log lines it wrote, and the other devices' call and `/healthz` latency.
`measure(None)` is the same window without an attacker: the baseline of the same run.

Needs psutil (the `dev` extra). Used by tests/test_hostile.py and bench/reliability.py.
"""

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import psutil

from simulator.fleet import device_id_for
from testkit.hostile import AttackReport
from testkit.processes import WatchedProcess

ADMIN_TOKEN = "siege-admin-token"
DEVICE_TOKEN = "siege-device-token"
VOLUME = "self.audio_speaker.set_volume"
EVIL_DEVICE = "a4:cf:66:66:66:66"


@dataclass(frozen=True)
class Attack:
    """One `testkit.hostile` attack by name; `amount` is seconds, or a count for storms."""

    name: str
    amount: float
    device_id: str = EVIL_DEVICE


def percentile(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class SiegeResult:
    attack: AttackReport | None
    rss_before_mb: float
    rss_peak_mb: float
    log_lines: int
    log_bytes: int
    call_ms: list[float] = field(default_factory=list)
    healthz_ms: list[float] = field(default_factory=list)
    call_errors: int = 0
    events: dict[str, int] = field(default_factory=dict)
    # Lines that carry an exception or a traceback, in any field (see `escaped_errors`).
    errors: list[str] = field(default_factory=list)

    @property
    def rss_growth_mb(self) -> float:
        return self.rss_peak_mb - self.rss_before_mb

    def call_p(self, q: float) -> float:
        return percentile(self.call_ms, q)

    def healthz_p(self, q: float) -> float:
        return percentile(self.healthz_ms, q)


class Siege:
    """`async with Siege(devices=4) as siege: result = await siege.measure(attack, 3.0)`."""

    def __init__(
        self,
        devices: int = 4,
        *,
        call_interval_s: float = 0.05,
        extra_env: dict[str, str] | None = None,
        serve_args: tuple[str, ...] = (),
    ) -> None:
        self.devices = devices
        self.call_interval_s = call_interval_s
        self.extra_env = extra_env or {}
        self.serve_args = serve_args
        self.bridge: WatchedProcess | None = None
        self.fleet: asyncio.subprocess.Process | None = None
        self.ws_url = ""
        self.api_url = ""
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._api: httpx.AsyncClient | None = None

    @property
    def pid(self) -> int:
        assert self.bridge is not None and self.bridge.process is not None
        return self.bridge.process.pid

    async def __aenter__(self) -> Self:
        self._folder = tempfile.TemporaryDirectory(prefix=self._folder_prefix)
        data_dir = Path(self._folder.name)
        env = {
            **os.environ,
            "BRIDGE_ADMIN_TOKEN": ADMIN_TOKEN,
            "BRIDGE_DEVICE_TOKEN": DEVICE_TOKEN,
            "BRIDGE_LOG_FORMAT": "json",
            # Every attack comes from loopback here: limit it as if it came from the LAN.
            "BRIDGE_RATE_LIMIT_EXEMPT": "[]",
            # One shared token (development mode): an attacker holding "the device token".
            "BRIDGE_DEVICE_AUTH": "shared",
            **self._bridge_env(),
            **self.extra_env,
        }
        argv = [sys.executable, "-m", "backend.cli", "serve", "--data-dir", str(data_dir)]
        argv += ["--ws-port", "0", "--http-port", "0", "--device-http-port", "0"]
        argv += [*self._transport_args(), *self.serve_args]
        self.bridge = WatchedProcess(argv, env)
        await self.bridge.start()
        runtime = data_dir / "bridge.json"
        await self.bridge.wait_for(runtime.exists, "the runtime file")
        info = json.loads(runtime.read_text())
        self.ws_url, self.api_url = info["ws_url"], info["api_url"]
        self._started(info)
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        self._api = httpx.AsyncClient(base_url=self.api_url, headers=headers, timeout=30)
        if self.devices:
            self.fleet = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "backend.cli", "simulate", *self._simulate_args(data_dir),
                "--devices", str(self.devices), "--workers", "1", env=env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            await self._wait_ready()
        return self

    # What a siege over another transport changes (`hostile_mqtt.MqttSiege`).
    _folder_prefix = "siege-"

    def _bridge_env(self) -> dict[str, str]:
        return {}

    def _transport_args(self) -> list[str]:
        return []

    def _started(self, runtime: dict[str, Any]) -> None:
        """The bridge wrote its runtime file (its endpoints)."""

    def _simulate_args(self, data_dir: Path) -> list[str]:
        return ["--url", self.ws_url]

    async def __aexit__(
        self, _t: type[BaseException] | None, _v: BaseException | None, _tb: TracebackType | None
    ) -> None:
        if self.fleet is not None and self.fleet.returncode is None:
            self.fleet.terminate()
            await self.fleet.wait()
        if self._api is not None:
            await self._api.aclose()
        if self.bridge is not None:
            await self.bridge.stop()
        if self._folder is not None:
            self._folder.cleanup()

    async def _wait_ready(self) -> None:
        assert self._api is not None
        wanted = {device_id_for(i) for i in range(1, self.devices + 1)}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            page = (await self._api.get("/api/devices", params={"state": "ready"})).json()
            if wanted <= {d["device_id"] for d in page["devices"]}:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError("the simulated devices did not become ready")

    def rss_mb(self) -> float:
        return psutil.Process(self.pid).memory_info().rss / 2**20

    async def measure(
        self, attack: Attack | None, duration_s: float, *, settle_s: float = 1.0
    ) -> SiegeResult:
        """Run `attack` (or nothing) while calling the good devices; then wait `settle_s` for
        the bridge's late log lines (summaries, disconnects)."""
        assert self.bridge is not None
        rss_before = self.rss_mb()
        first_line = len(self.bridge.lines)
        peak = [rss_before]
        result = SiegeResult(None, rss_before, rss_before, 0, 0)
        stop = asyncio.Event()
        samplers = [
            asyncio.create_task(self._sample_rss(peak, stop)),
            asyncio.create_task(self._call_loop(result, stop)),
            asyncio.create_task(self._healthz_loop(result, stop)),
        ]
        try:
            began = time.monotonic()
            if attack is not None:
                result.attack = await self._attack(attack)
            remaining = duration_s - (time.monotonic() - began)
            if remaining > 0:
                await asyncio.sleep(remaining)
        finally:
            stop.set()
            await asyncio.gather(*samplers, return_exceptions=True)
        await asyncio.sleep(settle_s)
        lines = self.bridge.lines[first_line:]
        result.rss_peak_mb = max(peak)
        result.log_lines = len(lines)
        result.log_bytes = sum(len(line) + 1 for line in lines)
        result.events = _events(lines)
        result.errors = escaped_errors(lines)
        return result

    def _attack_argv(self, attack: Attack) -> list[str]:
        """The command line of the attack's process."""
        argv = [sys.executable, "-m", "testkit.hostile", attack.name, self.ws_url]
        return [*argv, DEVICE_TOKEN, attack.device_id, str(attack.amount)]

    async def _attack(self, attack: Attack) -> AttackReport:
        """The attack in its own process: its bursts must not slow this measuring one."""
        argv = self._attack_argv(attack)
        process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
        out, _ = await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"attack {attack.name} failed with status {process.returncode}")
        fields = json.loads(out.decode().strip().splitlines()[-1])
        return AttackReport(**fields)

    async def _sample_rss(self, peak: list[float], stop: asyncio.Event) -> None:
        while not stop.is_set():
            peak.append(self.rss_mb())
            await asyncio.sleep(0.02)

    async def _call_loop(self, result: SiegeResult, stop: asyncio.Event) -> None:
        assert self._api is not None
        index = 0
        while not stop.is_set():
            device_id = device_id_for(index % self.devices + 1)
            began = time.perf_counter()
            try:
                response = await self._api.post(
                    f"/api/devices/{device_id}/tools/call",
                    json={"name": VOLUME, "arguments": {"volume": index % 101}},
                )
                if response.status_code == 200:
                    result.call_ms.append((time.perf_counter() - began) * 1000)
                else:
                    result.call_errors += 1
            except httpx.HTTPError:
                result.call_errors += 1
            index += 1
            await asyncio.sleep(self.call_interval_s)

    async def _healthz_loop(self, result: SiegeResult, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.api_url, timeout=30) as probe:
            while not stop.is_set():
                began = time.perf_counter()
                with contextlib.suppress(httpx.HTTPError):
                    await probe.get("/healthz")
                    result.healthz_ms.append((time.perf_counter() - began) * 1000)
                await asyncio.sleep(0.05)


def _events(lines: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in lines:
        try:
            event = json.loads(line).get("event", "?")
        except ValueError:
            event = line[:60]
        counts[str(event)] = counts.get(str(event), 0) + 1
    return counts


def escaped_errors(lines: list[str]) -> list[str]:
    """The bridge's lines that show an exception got as far as the log: a JSON line with an
    `exception` (where structlog puts a rendered traceback) or `exc_info` field, or any line
    with a traceback in any field or in plain text (each line clipped to 500 characters)."""
    found: list[str] = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        has_field = isinstance(entry, dict) and ("exception" in entry or "exc_info" in entry)
        if has_field or "Traceback" in line:
            found.append(line[:500])
    return found


def device_ids(count: int) -> list[str]:
    return [device_id_for(i) for i in range(1, count + 1)]
