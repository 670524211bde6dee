"""Firmware tooling as a library: find the MicroPython tools and the firmware sources, build with
mpy-cross, deploy with mpremote, flash with esptool, run on the MicroPython unix port.

Functions return data and raise `FirmwareError` subclasses with one-line messages; printing and
exit codes belong to the caller (`backend.cli.firmware`). Modules: `tools` (lookup and running
of the tools), `source` (where the firmware is), `build`, `device_config`, `deploy`, `flash`,
`host`, `errors`. Only the standard library is needed to import them.
"""

from backend.firmware.errors import FirmwareError
from backend.firmware.source import firmware_dir
from backend.firmware.tools import find_tool, micropython_argv, micropython_env, require_tool

__all__ = [
    "FirmwareError",
    "find_tool",
    "firmware_dir",
    "micropython_argv",
    "micropython_env",
    "require_tool",
]
