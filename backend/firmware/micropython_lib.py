"""micropython-lib packages the firmware needs on a host (the simulator, the unix port).

The firmware's MQTT transport uses `umqtt.simple` from micropython-lib. A board gets it with
`mpremote mip install umqtt.simple` (`esp32-bridge firmware deploy` does that), which reads the
micropython-lib index on micropython.org. Where that index cannot be reached (this project's
machines reach PyPI, Debian and npm only), the same module comes from micropython-lib's own PyPI
release, `micropython-umqtt.simple`: an sdist in upip's format without a setup.py, which pip
refuses to install, so it is fetched from PyPI's simple index here, checked against a pinned
SHA-256 and unpacked into an ignored folder — what upip, MicroPython's PyPI installer, did.
Never committed: `build/micropython-lib` in a source checkout (or `ESP32_BRIDGE_MPY_LIB`).
"""

import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from backend.firmware.errors import FirmwareError
from backend.firmware.source import firmware_dir

DEFAULT_INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class MpyPackage:
    """One pinned micropython-lib package the firmware needs, by its PyPI release."""

    module: str  # what the firmware imports, e.g. umqtt.simple
    project: str  # the PyPI project
    version: str
    sha256: str

    @property
    def filename(self) -> str:
        """The name of the release's sdist on the index."""
        return f"{self.project}-{self.version}.tar.gz"

    @property
    def path(self) -> str:
        """The module's file below the lib folder, e.g. umqtt/simple.py."""
        return self.module.replace(".", "/") + ".py"


UMQTT_SIMPLE = MpyPackage(
    "umqtt.simple",
    "micropython-umqtt.simple",
    "1.3.4",
    "b6a2520239e3992c63a7de9370ee9b3d9d27819a90359c521f1c0f7ccab8d12f",
)
FIRMWARE_PACKAGES = (UMQTT_SIMPLE,)


class FetchError(FirmwareError):
    """A package could not be fetched or did not match its pinned hash."""


def lib_dir() -> Path:
    """The ignored folder that holds the fetched modules (MICROPYPATH / sys.path entry)."""
    override = os.environ.get("ESP32_BRIDGE_MPY_LIB")
    if override:
        return Path(override)
    checkout = firmware_dir().parent
    if (checkout / "pyproject.toml").is_file():
        return checkout / "build" / "micropython-lib"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "esp32-bridge" / "micropython-lib"


def missing(packages: tuple[MpyPackage, ...] = FIRMWARE_PACKAGES) -> list[MpyPackage]:
    """The packages not yet fetched into the library folder."""
    folder = lib_dir()
    return [package for package in packages if not (folder / package.path).is_file()]


def ensure(packages: tuple[MpyPackage, ...] = FIRMWARE_PACKAGES) -> Path:
    """Fetch what is missing into `lib_dir()` and return that folder."""
    folder = lib_dir()
    for package in missing(packages):
        fetch(package, folder)
    return folder


def fetch(package: MpyPackage, folder: Path, index: str | None = None) -> Path:
    """Download the package's sdist, check its pinned SHA-256 and unpack its module; raises
    FetchError."""
    import httpx

    base = (index or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")
    normalized = package.project.replace(".", "-").replace("_", "-").lower()
    try:
        page = httpx.get(f"{base}/{normalized}/", timeout=30, follow_redirects=True)
        page.raise_for_status()
        url = _link(page.text, package.filename)
        data = httpx.get(url, timeout=60, follow_redirects=True).content
    except httpx.HTTPError as exc:
        raise FetchError(f"cannot fetch {package.filename} from {base}: {exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != package.sha256:
        raise FetchError(f"{package.filename}: sha256 {digest} is not the pinned {package.sha256}")
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        member = next(
            (m for m in archive.getmembers() if m.name.endswith("/" + package.path)), None
        )
        extracted = archive.extractfile(member) if member is not None else None
        if extracted is None:
            raise FetchError(f"{package.filename} has no {package.path}")
        source = extracted.read()
    target = folder / package.path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source)
    return target


def _link(page: str, filename: str) -> str:
    import re

    for href in re.findall(r'href="([^"]+)"', page):
        if href.split("#", 1)[0].rsplit("/", 1)[-1] == filename:
            return str(href.split("#", 1)[0])
    raise FetchError(f"{filename} is not listed in the package index")


def main() -> None:
    """Fetch what is missing and print where each package is."""
    folder = ensure()
    for package in FIRMWARE_PACKAGES:
        print(f"{package.module} {package.version}: {folder / package.path}")


if __name__ == "__main__":
    main()
