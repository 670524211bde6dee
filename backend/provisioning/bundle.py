"""Firmware bundles: our MicroPython firmware's files in one download, for OTA updates.

Format (version 1), small enough to read on a device with a few kilobytes of RAM:

    EMB1\\n
    {"version": "1.2.0", "files": [["lib/app.mpy", 1234, "<sha256 hex>"], ...]}\\n
    <the bytes of every file, in the order of "files">

The device reads the header line and the manifest line, then streams each file into
`<name>.new`, checking its size and SHA-256, and renames the new files over the old ones only
when every file checked out (firmware/lib/ota.py `apply_bundle`). It then writes `version` (the
bundle's version, which the firmware reports from then on: the upgrade cannot loop) and reboots.
Names are relative paths of the build folder; `..`, absolute paths and anything but
`[A-Za-z0-9_./-]` are refused on both sides.
"""

import hashlib
import json
import re
from pathlib import Path

from backend.firmware.build import MANIFEST
from backend.firmware.errors import UsageError
from backend.provisioning.ota import valid_version

MAGIC = b"EMB1\n"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


def check_name(name: str) -> str:
    """The name if it may go into a bundle (relative, no `..`, at most 128 characters); raises
    UsageError."""
    if not _NAME.match(name) or ".." in name.split("/") or len(name) > 128:
        raise UsageError(f"file name {name!r} cannot go into a bundle")
    return name


def bundle_files(build: Path) -> list[Path]:
    """The files of a build folder that a device runs (not the build manifest)."""
    files = sorted(
        path
        for path in build.rglob("*")
        if path.is_file() and path.name != MANIFEST and not path.name.startswith(".")
    )
    if not files:
        raise UsageError(f"{build} holds no built firmware: run `esp32-bridge firmware build`")
    return files


def make_bundle(build: Path, version: str) -> bytes:
    """The bundle of every file in the build folder `build`, announcing `version`."""
    if not valid_version(version):
        raise UsageError(f"invalid version {version!r}: digits and dots only, e.g. 1.2.0")
    entries: list[list[object]] = []
    payload: list[bytes] = []
    for path in bundle_files(build):
        name = check_name(path.relative_to(build).as_posix())
        data = path.read_bytes()
        entries.append([name, len(data), hashlib.sha256(data).hexdigest()])
        payload.append(data)
    manifest = json.dumps({"version": version, "files": entries}, separators=(",", ":"))
    return MAGIC + manifest.encode() + b"\n" + b"".join(payload)


def read_manifest(bundle: bytes) -> dict[str, object]:
    """The manifest of a bundle (for checks and tests)."""
    if not bundle.startswith(MAGIC):
        raise UsageError("not a firmware bundle (no EMB1 header)")
    end = bundle.index(b"\n", len(MAGIC))
    manifest = json.loads(bundle[len(MAGIC) : end])
    if not isinstance(manifest, dict):
        raise UsageError("bad bundle manifest")
    return manifest
