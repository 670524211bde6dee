"""Import the firmware's own modules (firmware/lib) into CPython, unchanged."""

import importlib
import sys
from types import ModuleType

from backend.firmware.source import firmware_dir

__all__ = ["firmware_dir", "firmware_module"]


def firmware_module(name: str) -> ModuleType:
    """Import `name` from firmware/lib (the modules import each other as top-level names)."""
    lib = str(firmware_dir() / "lib")
    if lib not in sys.path:
        sys.path.insert(0, lib)
    return importlib.import_module(name)
