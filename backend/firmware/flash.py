"""Write a MicroPython image to an ESP32 with esptool."""

from pathlib import Path

from backend.firmware.errors import ImageError, UsageError
from backend.firmware.tools import check_port, require_tool, run_tool

# Where the MicroPython .bin starts, per chip (the micropython.org download page says the same).
FLASH_OFFSETS = {
    "esp32": "0x1000",
    "esp32s2": "0x1000",
    "esp32s3": "0x0",
    "esp32c3": "0x0",
    "esp32c6": "0x0",
}
ESP_IMAGE_MAGIC = 0xE9  # first byte of every ESP bootloader/app image
DEFAULT_CHIP = "esp32"
DEFAULT_BAUD = 460800
FLASH_TIMEOUT_S = 600.0  # erase + write of a 2 MB image on a slow USB bridge


def check_chip(chip: str) -> None:
    """Raise UsageError unless the chip is one whose flash offset is known."""
    if chip not in FLASH_OFFSETS:
        raise UsageError(f"unknown --chip {chip!r}: use one of {', '.join(FLASH_OFFSETS)}")


def check_image(image: Path) -> None:
    """ImageError unless `image` is a readable file that starts like an ESP image."""
    try:
        with image.open("rb") as file:
            first = file.read(1)
    except FileNotFoundError:
        raise ImageError(f"image file {image} not found") from None
    except OSError as exc:
        raise ImageError(f"cannot read image file {image}: {exc.strerror}") from None
    if first != bytes([ESP_IMAGE_MAGIC]):
        raise ImageError(
            f"{image} is not an ESP firmware image (get the .bin from micropython.org)"
        )


def flash_commands(
    esptool: str,
    chip: str,
    port: str,
    baud: int,
    image: Path,
    erase: bool = True,
) -> list[list[str]]:
    """esptool command lines: erase-flash (if `erase`), then write-flash at the chip's offset."""
    check_chip(chip)
    base = [esptool, "--chip", chip, "--port", port, "--baud", str(baud)]
    write = [*base, "write-flash", "-z", FLASH_OFFSETS[chip], str(image)]
    return [[*base, "erase-flash"], write] if erase else [write]


def flash(
    port: str,
    image: Path,
    chip: str = DEFAULT_CHIP,
    baud: int = DEFAULT_BAUD,
    *,
    erase: bool = True,
) -> None:
    """Check the chip, image and port, then run esptool (its progress goes to stdout)."""
    check_chip(chip)
    check_image(image)
    check_port(port)
    for command in flash_commands(require_tool("esptool"), chip, port, baud, image, erase):
        run_tool(command, FLASH_TIMEOUT_S)
