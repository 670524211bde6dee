"""Firmware heap use on a small MicroPython heap, against a real bridge: the scenario that
tests/test_firmware_memory.py checks and bench/firmware_memory.py reports.

The firmware runs as it is deployed (firmware/lib compiled by `backend.firmware.build`, main.py
as source, the fake HAL) under the MicroPython unix port with `-X heapsize=180K`: about 1.8 x
the ~100 KB Python heap of an ESP32, because objects are 64-bit here. firmware_memory_harness.py
(beside this module) wraps it to read gc figures inside MicroPython. A bridge in this process
takes the connection; then `calls` tools/call go one at a time through `Device.call_tool`
(set_volume, get_device_status, set_brightness) and straight through the bridge's McpClient
(set_volume 101, which only the device's own check refuses).
"""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.auth import Tokens
from backend.config import Settings
from backend.devices import DeviceState
from backend.devices.device import Device
from backend.firmware.build import build
from backend.firmware.tools import micropython_argv, micropython_env
from backend.mcp_session import CallResult, DeviceError
from backend.server import Bridge
from testkit.processes import WatchedProcess

HARNESS = Path(__file__).resolve().parent / "firmware_memory_harness.py"
HEAP_KB = 180
CALLS = 1000
QUICK_CALLS = 200
ADMIN_TOKEN = "firmware-memory-admin-token"
DEVICE_TOKEN = "firmware-memory-device-token"
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
    bridge = Bridge(_bridge_settings(work_dir / "bridge"), Tokens(ADMIN_TOKEN, DEVICE_TOKEN))
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


def _bridge_settings(data_dir: Path) -> Settings:
    """A bridge on ephemeral loopback ports with fixed tokens."""
    return Settings.on_loopback(
        data_dir,
        admin_token=ADMIN_TOKEN,
        device_token=DEVICE_TOKEN,
        init_timeout_s=10.0,
        call_timeout_s=10.0,
    )


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
    figures: dict[str, Any] = json.loads(line.removeprefix("[mem] "))
    return figures


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
