"""Firmware heap use on a small MicroPython heap, against a real bridge.

    python -m bench.firmware_memory [--quick]

Runs the scenario of testkit/firmware_memory.py (the firmware as deployed, under the
MicroPython unix port with `-X heapsize=180K`, connected to a real bridge in this process; 1,000
tools/call one at a time) three times: .mpy, .mpy with a collect at every probe (peak live heap),
and plain .py sources; then, without --quick, bisects the smallest heap that survives. Writes the
"firmware-memory" section of docs/benchmarks.md. tests/test_firmware_memory.py runs the same
scenario.
"""

import argparse
import asyncio
import contextlib
import subprocess
import tempfile
from pathlib import Path

from backend.firmware.tools import find_tool
from bench.report import environment, write_section
from testkit.firmware_memory import CALLS, QUICK_CALLS, MemoryRun, run_scenario, smallest_heap

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
            f"`{build}` {kb}K (~{kb / 1.8:.0f} KB on the 32-bit ESP32)"
            for build, kb in smallest.items()
        )
        + "."
        if smallest
        else "Smallest heap: not measured in --quick mode."
    )
    return f"""## Firmware memory (MicroPython unix port)

`python -m bench.firmware_memory` ({environment()}, MicroPython {_micropython_version()}).
firmware/lib compiled with `mpy-cross -O2`, main.py as source, fake HAL, under
`micropython -X heapsize={mpy.heap_kb}K` (about 1.8 x the ESP32's ~100 KB Python heap: objects
are 64-bit here), connected over loopback to a real bridge; {mpy.calls:,} `tools/call` one at a
time (set_volume, get_device_status, set_brightness through `Device.call_tool`; set_volume 101
through the bridge's `McpClient`, refused by the device with its stock message). Figures are
read inside MicroPython by testkit/firmware_memory_harness.py. "Live" means `gc.mem_alloc()`
right after `gc.collect()`; the peak-live figures come from a second run that collects at every
probe (after each reply is built and before each frame is written), because MicroPython collects
only when an allocation fails, so without that the peak `gc.mem_alloc()` is simply the heap size.

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
