"""Import the firmware's own modules (firmware/lib) into CPython, unchanged."""

import importlib
import sys
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).resolve().parent
# A source checkout has firmware/ beside simulator/; a wheel carries it as simulator/_firmware.
_CANDIDATES = (_HERE.parent / "firmware", _HERE / "_firmware")


def firmware_dir() -> Path:
    for candidate in _CANDIDATES:
        if (candidate / "lib" / "mcp_server.py").is_file():
            return candidate
    raise FileNotFoundError("firmware sources not found next to the simulator package")


def firmware_module(name: str) -> ModuleType:
    """Import `name` from firmware/lib (the modules import each other as top-level names)."""
    lib = str(firmware_dir() / "lib")
    if lib not in sys.path:
        sys.path.insert(0, lib)
    return importlib.import_module(name)
